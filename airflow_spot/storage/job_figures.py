"""A job's money figures and headline, from its attempts or the finish task's summary, and its log line.

:meth:`JobView.snapshot <airflow_spot.storage.job_view.JobView.snapshot>` builds its figures with these, and
the UI (``ui/jobs.py``, ``ui/app.py``) uses them on a finished job's summary alone, without reading the
job's store: both must round and name the figures the same way, so they live in one place, apart from the
store reads. No Airflow import (see job_view).
"""
from __future__ import annotations

import math
from typing import Any

from airflow_spot.policy.ledger import restarted_segment
from airflow_spot.storage.attempt_view import AttemptView, _not_a_number
from airflow_spot.storage.protocol import Outcome


def _live_credit(a: AttemptView, attempts: list[AttemptView], committed: int | None) -> float:
    """The on-demand dollars of an attempt without a ledger row, credited as its row will be
    (``policy.ledger.credited_seconds``): a completed one its whole bill, another its kept steps. A running one
    is credited as if it completes, its time so far: an on-demand attempt then never shows a loss against
    on-demand. One that restarted its segment after a preemption gets its steps only, as its row will."""
    if a.billed_seconds is None or not a.on_demand_price_per_hour:
        return 0.0
    whole = (a.outcome in (Outcome.COMPLETED.value, "running")
             and not restarted_segment(a.segment_index, a.started_at, attempts))
    seconds = a.billed_seconds if whole else _useful_seconds(a, committed)
    return seconds / 3600.0 * a.on_demand_price_per_hour


def _useful_seconds(a: AttemptView, committed: int | None) -> float:
    """``LedgerRow.useful_seconds`` of an attempt whose row has not landed: its kept steps' time. A running
    one keeps its steps so far; an ended one the job's newest checkpoint past its resume (what its row will
    say), at most the steps it took."""
    taken = a.steps_done or 0
    kept = taken
    if a.outcome != "running":
        past = max(0, committed - a.resume_step) if committed is not None and a.resume_step is not None else 0
        kept = min(taken, past) if a.steps_done is not None else past
    if a.step_seconds:
        return min(a.billed_seconds, kept * a.step_seconds)
    if a.outcome == Outcome.COMPLETED.value:
        return a.billed_seconds
    return a.billed_seconds * kept / taken if taken else 0.0


def summary_stands(summary: dict[str, Any], attempts: list[AttemptView]) -> bool:
    """Whether the finish task's summary is still the job's final account: no attempt was launched after it
    was written (a failed run its user cleared trains on, and nothing removes the old summary)."""
    written = summary.get("written_at")
    if written is not None and not _not_a_number(written):
        return not any(a.started_at is not None and a.started_at > written for a in attempts)
    # an earlier release's summary, undated: written after its rows ended, so an attempt after it is none of
    # them and started after their last end. It must also have left more than its launch record (a
    # heartbeat, an end): one launched just before the finish task, which ended its instance, left nothing
    rows = summary.get("rows")
    if not isinstance(rows, list):  # nor rows: it stands while nothing trains
        return not any(a.outcome == "running" and a.last_beat_at is not None for a in attempts)
    rows = [r for r in rows if isinstance(r, dict)]
    held = {r.get("attempt_id") for r in rows}
    last = max((r["ended_at"] for r in rows if r.get("ended_at") is not None and not _not_a_number(r["ended_at"])),
               default=None)
    return not any(
        a.attempt_id not in held and (a.last_beat_at is not None or a.ended_at is not None)
        and (last is None or (a.started_at is not None and a.started_at > last)) for a in attempts)


def money_figures(cost: float, on_demand: float) -> dict[str, float | None]:
    """Cost, on-demand cost, savings and their fraction, rounded as the UI shows them. The fraction is None
    with no on-demand cost to compare with (nothing kept yet): a loss is no 0 %."""
    cost, on_demand = round(cost, 6), round(on_demand, 6)
    return {"cost": cost, "on_demand_cost": on_demand, "savings": round(on_demand - cost, 6),
            "savings_fraction": round((on_demand - cost) / on_demand, 4) if on_demand > 0 else None}


#: what a job summary must hold for its headline (one of an older version may lack some)
FINAL_FIELDS = ("total_steps", "latest_step", "cost", "on_demand_cost", "preemptions")


def final_figures(summary: dict[str, Any]) -> dict[str, Any] | None:
    """A finished job's headline from the finish task's summary: the figures its log printed (the ledger's
    totals; progress at the newest *usable* checkpoint). None when the summary lacks one or holds one of
    the wrong type (the caller then reads the job from its store)."""
    if not all(k in summary for k in FINAL_FIELDS):
        return None
    total, step, preemptions = summary["total_steps"], summary["latest_step"], summary["preemptions"]
    numbers = (summary["cost"], summary["on_demand_cost"])
    if (any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in numbers)
            or any(v is not None and (isinstance(v, bool) or not isinstance(v, int)) for v in (total, step))
            or isinstance(preemptions, bool) or not isinstance(preemptions, int)):
        return None
    money = money_figures(float(numbers[0]), float(numbers[1]))
    # the summary's own savings (computed before rounding, as the finish task's log printed them): the
    # difference of the rounded cost and on-demand cost can be off in the last digit
    for k in ("savings", "savings_fraction"):
        v = summary.get(k)
        if (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and money[k] is not None):  # the summary's 0.0 of no on-demand cost is no fraction either
            money[k] = float(v)
    return {
        "state": finished_state(summary),
        "current_step": step,
        "total_steps": total,
        "progress": round(min(1.0, step / total), 4) if total and step is not None else None,
        **money,
        "preemptions": preemptions,
    }


def finished_state(summary: dict[str, Any]) -> str:
    """A job with a summary: ``finished``, or ``incomplete`` when the finish task found its newest
    checkpoint short of the last step (the run failed; the UI then shows Airflow's state)."""
    return "finished" if summary.get("completed", True) else "incomplete"


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def _dollars(value) -> str:
    """``$0.1234``, or ``$?`` for a figure not known yet (no step time measured)."""
    return "$?" if value is None else f"${value:.4f}"


def progress_line(snap: dict[str, Any]) -> str:
    """One line for a task log: ``%``, steps/s, ETA and cost so far (from :meth:`JobView.snapshot`)."""
    est = snap.get("estimate") or {}
    step = est.get("step_seconds")
    pct = f"{100 * snap['progress']:.1f} %" if snap.get("progress") is not None else "?"
    n = snap.get("preemptions", 0)
    return (
        f"progress: step {snap.get('current_step')} of {snap.get('total_steps') or '?'} ({pct}), "
        f"{(1 / step) if step else 0:.2f} steps/s, ETA {_clock(est.get('remaining_seconds'))}, "
        f"cost so far ${snap.get('cost', 0.0):.4f} (remaining ~{_dollars(est.get('remaining_cost'))}), "
        f"{n} preemption{'' if n == 1 else 's'}"
    )
