"""One attempt as :class:`~airflow_spot.storage.job_view.JobView` merges it, and how fast it trained.

:class:`AttemptView` joins an attempt's launch record, final status or live heartbeat, and ledger row. The
helpers here check a launch record, read an attempt's pace from its heartbeat and its committed checkpoints
(the mean from its first step; the steady pace past its warm-up), and turn the attempts into what the online
estimate (:mod:`airflow_spot.policy.estimate`) reads: paces and the pool's MTBF. They are pure functions of
records already read, kept apart from the view's reads of the store. No Airflow import (see job_view).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from airflow_spot.policy.checkpoint_interval import estimate_mtbf
from airflow_spot.policy.estimate import WARMUP_STEPS, AttemptPace
from airflow_spot.storage.protocol import Heartbeat, Outcome, SegmentRequest


@dataclass(frozen=True)
class AttemptView:
    """One attempt as the timeline shows it: its launch, its final status or live heartbeat, its ledger row."""

    attempt_id: str
    segment_index: int | None
    instance_id: str | None
    instance_type: str | None
    zone: str | None
    market: str | None
    price_per_hour: float | None
    on_demand_price_per_hour: float | None
    started_at: float | None
    ended_at: float | None
    outcome: str  # completed | preempted | failed | lost | running
    resume_step: int | None
    end_step: int | None
    current_step: int | None
    steps_done: int | None
    steps_lost: int | None
    cost: float | None
    step_seconds: float | None
    new_instance: bool | None
    #: when the preemption notice reached the training process (ledger row, or a running attempt's heartbeat:
    #: a preemption under way; None: no notice seen)
    notice_at: float | None = None
    #: the attempt's last heartbeat (time, save cost EWMA): what its end cost after its last step
    last_beat_at: float | None = None
    save_seconds: float | None = None
    #: when the attempt finished its first training step (its heartbeat; None before it or not recorded)
    first_step_at: float | None = None
    #: mean seconds per step from that first step to its last heartbeat (None: too few steps since)
    pace_seconds: float | None = None
    #: the steps that mean is over (its first step to its last heartbeat)
    pace_steps: int = 0
    #: seconds per step past the warm-up: from the attempt's oldest committed checkpoint past its warm-up
    #: to its last heartbeat (None: no such checkpoint kept, or too few steps since)
    steady_seconds: float | None = None
    #: the steps that pace is over
    steady_steps: int = 0
    #: its first step to that checkpoint, beyond the steady pace: what its warm-up cost (None: not measured)
    warmup_seconds: float | None = None
    #: the heartbeat's step
    beat_step: int | None = None
    #: how long the attempt's newest committed checkpoint took to write (what a save on a notice costs)
    write_seconds: float | None = None
    #: the seconds billed: its ledger row's (whole seconds, with the minimum on a new instance), or for a
    #: running attempt the seconds since it was billed from (what its cost so far is priced over)
    billed_seconds: float | None = None

    @property
    def is_preemption(self) -> bool:
        return self.outcome in (Outcome.PREEMPTED.value, Outcome.LOST.value)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["preemption"] = self.is_preemption
        return d


def _not_a_number(value: Any) -> bool:
    return value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)))


def _malformed_launch(data: dict[str, Any]) -> str | None:
    """What makes a launch record unusable for the view (None: usable): the fields it computes with."""
    offer = data.get("offer", {})
    if not isinstance(offer, dict):
        return "its offer is not an object"
    for name in ("billed_from", "requested_at", "resume_step", "end_step", "segment_index"):
        if _not_a_number(data.get(name)):
            return f"{name} is not a number: {data[name]!r}"
    for name in ("price_per_hour", "on_demand_price_per_hour"):  # what its cost and credit are priced at
        if _not_a_number(offer.get(name)):
            return f"offer.{name} is not a number: {offer[name]!r}"
    return None


def _checkpoint_marks(checkpoints: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Per writer (an attempt), its committed checkpoints as ``(step, time the step was reached)``: the
    manifest's commit time less its save time (the write runs behind the training), oldest first."""
    out: dict[str, list[tuple[int, float]]] = {}
    for c in checkpoints:
        if c.get("writer") and c.get("time"):
            out.setdefault(c["writer"], []).append((c["step"], c["time"] - (c.get("save_seconds") or 0.0)))
    return {w: sorted(v) for w, v in out.items()}


def _steady_window(hb: Heartbeat | None,
                   marks: list[tuple[int, float]]) -> tuple[float | None, float | None, int]:
    """An attempt's pace past its warm-up and what the warm-up cost beyond it, from its oldest checkpoint
    at least ``WARMUP_STEPS`` past its first step and at least as many before its heartbeat.

    ``steady = (beat time - mark time) / (beat step - mark step)``; ``warm-up = (mark time - first step's
    time) - (mark step - first step) x steady``; and the steps of that window. (None, None, 0) without
    such a checkpoint.
    """
    if hb is None or hb.first_step_at is None or hb.first_step is None:
        return None, None, 0
    for step, at in marks:
        if step - hb.first_step < WARMUP_STEPS or hb.step - step < WARMUP_STEPS or at <= hb.first_step_at:
            continue
        if hb.time <= at:
            break
        steady = (hb.time - at) / (hb.step - step)
        return steady, (at - hb.first_step_at) - (step - hb.first_step) * steady, hb.step - step
    return None, None, 0


def _pace(hb: Heartbeat | None) -> float | None:
    """Mean seconds per step of an attempt from its first step to its heartbeat, once past the warm-up."""
    if hb is None or hb.first_step_at is None or hb.first_step is None:
        return None
    steps = hb.step - hb.first_step
    if steps <= WARMUP_STEPS or hb.time <= hb.first_step_at:
        return None
    return (hb.time - hb.first_step_at) / steps


def _paces(attempts: list, now: float) -> list[AttemptPace]:
    """The attempts as the estimator reads them (failed ones left out: user code, not the pool)."""
    paces, previous_end = [], None
    for a in attempts:
        if a.outcome != Outcome.FAILED.value:
            paces.append(AttemptPace(
                steps=a.steps_done or 0, step_seconds=a.step_seconds,
                seconds=max(0.0, (a.ended_at or now) - (a.started_at or now)),
                preempted=a.is_preemption, finished=a.outcome != "running",
                new_instance=a.new_instance is not False,
                notice_seconds=(max(0.0, a.notice_at - a.started_at)
                                if a.notice_at is not None and a.started_at is not None else None),
                steps_lost=a.steps_lost or 0,
                gap_before=(a.started_at - previous_end
                            if previous_end is not None and a.started_at is not None else None),
                # last step to end: the final save (its cost EWMA), then last heartbeat to the end
                pace_seconds=a.pace_seconds,
                pace_steps=a.pace_steps,
                steady_seconds=a.steady_seconds,
                steady_steps=a.steady_steps,
                warmup_seconds=a.warmup_seconds,
                save_seconds=a.write_seconds,
                exit_seconds=(max(0.0, a.ended_at - a.last_beat_at)
                              if a.is_preemption and a.ended_at is not None and a.last_beat_at is not None
                              else None),
                startup_seconds=(a.first_step_at - a.started_at
                                 if a.first_step_at is not None and a.started_at is not None else None),
                end_seconds=(max(0.0, a.ended_at - a.last_beat_at) + (a.save_seconds or 0.0)
                             if a.outcome == Outcome.COMPLETED.value and a.ended_at is not None
                             and a.last_beat_at is not None else None),
            ))
        previous_end = a.ended_at if a.ended_at is not None else previous_end
    return paces


def _mtbf(requests: list[SegmentRequest], attempts: list[AttemptView], now: float,
          prior: float | None = None) -> float | None:
    """MTBF of the current pool: a prior (given, else the operator's in the newest request) blended with
    the preemptions this job has seen over its time on instances; None when the job runs on demand."""
    if attempts and attempts[-1].market == "on-demand":
        return None
    if prior is None:
        prior = next((r.mtbf_seconds for r in reversed(requests) if r.mtbf_seconds), None)
    # a running attempt told to go is a preemption seen too
    seen = sum(a.is_preemption or (a.outcome == "running" and a.notice_at is not None) for a in attempts)
    # time exposed to the pool: launch to the notice (the notice window after it is not), or to the end
    seconds = sum(max(0.0, (a.notice_at or a.ended_at or now) - a.started_at)
                  for a in attempts if a.started_at is not None)
    if prior is None:
        return seconds / seen if seen else None
    return estimate_mtbf(prior, seen, seconds)
