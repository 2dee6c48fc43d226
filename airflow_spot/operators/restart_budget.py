"""The restart the deadline rule budgets: what a preemption or a switch costs the job before it trains again.

The rule (:mod:`airflow_spot.policy.deadline`) keeps slack for restarts: its floor, the switch from
on-demand back to spot, the reserve for preemptions to come. ``simulate`` replays it with the job's true
restart (``--restart-overhead-hours``); the operators measure theirs, so a user need not know the figure:

* start-up: a fresh instance's launch (its ledger row's start) to the end of its first training step (its
  heartbeat's ``first_step_at``): boot, image, Python, restore, the first step;
* hand-off: a preempted attempt's end to the next attempt's launch (Airflow's retry, the plan), counted
  only where no capacity refusal of the job fell in between (waiting out an outage is the rule's own
  decision, not part of a restart).

Each is the median of the job's most recent samples, else the deployment's (the overhead history the
finish task records, :mod:`airflow_spot.storage.overhead_history`), else what the operator was told
(600 s by default). A figure the DAG sets in ``restart_overhead_seconds`` is used as given.

``simulate`` replays a job that knows its restart; the operators know it once the job's first fresh start
has trained (or an earlier job of the deployment has), so only the first segment of the first job of a
deployment that does not declare it decides on the default.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_spot.policy.ledger import PREEMPTION_OUTCOMES

#: the job's most recent fresh starts (and hand-offs) the budget is the median of: recent enough to follow
#: a changed image or region, enough to shrug off one slow boot
RESTART_SAMPLES = 8


@dataclass(frozen=True)
class RestartBudget:
    seconds: float
    #: ``declared`` (the DAG's figure), ``measured`` (this job's starts), ``deployment`` (other jobs'),
    #: ``default`` (nothing measured yet)
    source: str
    startup_seconds: float | None = None
    handoff_seconds: float | None = None
    samples: int = 0

    def describe(self) -> str:
        if self.source in ("declared", "default"):
            return f"restart {self.seconds:.0f} s ({self.source})"
        parts = f"start-up {self.startup_seconds:.0f} s" + (
            "" if self.handoff_seconds is None else f" + hand-off {self.handoff_seconds:.0f} s")
        where = f"{self.samples} of this job's starts" if self.source == "measured" else "the deployment's jobs"
        return f"restart {self.seconds:.0f} s ({parts}, measured over {where})"


def fresh_starts(rows: Sequence[Any], limit: int = RESTART_SAMPLES) -> list[Any]:
    """The job's most recent ledger rows on a fresh instance, newest first: whose heartbeats to read."""
    fresh = [r for r in rows if r.new_instance]
    return sorted(fresh, key=lambda r: r.started_at, reverse=True)[:limit]


def startup_samples(rows: Sequence[Any], heartbeats: Mapping[str, Any]) -> list[float]:
    """Launch to the end of the first training step, per fresh start whose heartbeat recorded it."""
    out = []
    for r in fresh_starts(rows):
        hb = heartbeats.get(r.attempt_id)
        first = getattr(hb, "first_step_at", None)
        if first is not None and first >= r.started_at:
            out.append(first - r.started_at)
    return out


def handoff_samples(rows: Sequence[Any], refused_at: Sequence[float] = ()) -> list[float]:
    """A preempted attempt's end to the next attempt's start, where no capacity refusal came in between."""
    ordered = sorted(rows, key=lambda r: r.started_at)
    out = []
    for prev, cur in zip(ordered, ordered[1:]):
        if prev.outcome not in PREEMPTION_OUTCOMES or cur.started_at < prev.ended_at:
            continue
        if any(prev.ended_at <= t <= cur.started_at for t in refused_at):
            continue
        out.append(cur.started_at - prev.ended_at)
    return out[-RESTART_SAMPLES:]


def restart_budget(rows: Sequence[Any], heartbeats: Mapping[str, Any], *, declared: float | None,
                   default: float, prior: Callable[[], Mapping[str, float]] | None = None,
                   refused_at: Sequence[float] = ()) -> RestartBudget:
    """The restart to budget: ``declared`` when the DAG set one, else measured (see the module's doc).

    :param heartbeats: attempt id -> :class:`~airflow_spot.storage.protocol.Heartbeat`, at least of
        :func:`fresh_starts`.
    :param prior: reads the deployment's overheads (``startup``, ``gap_after_preemption``); called only
        for a job that has measured no start or no hand-off of its own yet.
    :param refused_at: times of the job's capacity refusals.
    """
    if declared is not None:
        return RestartBudget(float(declared), "declared")
    starts = startup_samples(rows, heartbeats)
    handoffs = handoff_samples(rows, refused_at)
    deployment: dict[str, float] = {}
    if prior is not None and not (starts and handoffs):
        deployment = dict(prior())
    if starts:
        startup, source = statistics.median(starts), "measured"
    elif "startup" in deployment:
        startup, source = float(deployment["startup"]), "deployment"
    else:
        return RestartBudget(float(default), "default")
    if handoffs:
        handoff = statistics.median(handoffs)
    else:
        handoff = deployment.get("gap_after_preemption")
    seconds = startup + (handoff or 0.0)
    return RestartBudget(seconds, source, startup, None if handoff is None else float(handoff), len(starts))
