"""The restart the deadline rule budgets: what a preemption or a switch costs the job before it trains again.

The rule (:mod:`airflow_spot.policy.deadline`) keeps slack for restarts: its floor, the switch from
on-demand back to spot, the reserve for preemptions to come. ``simulate`` replays it with the job's true
restart (``--restart-overhead-hours``); the operators measure theirs, so a user need not know the figure:
a fresh instance's start-up, from its launch (its ledger row's start) to the end of its first training step
(its heartbeat's ``first_step_at``): boot, image, Python, restore, the first step. It is the median of the
job's most recent fresh starts, else the deployment's (the overhead history the finish tasks record,
:mod:`airflow_spot.storage.overhead_history`), else what the operator was told (600 s by default). A figure
the DAG sets in ``restart_overhead_seconds`` is used as given.

Not counted: the hand-off between a preempted attempt and its retry. Airflow retries a preemption at once
(``operators/retry.py``), so it is seconds; the gaps between ledger rows also hold what is no restart
(an outage waited out, a failed task cleared the next morning) and cannot tell them apart.

``simulate`` replays a job that knows its restart; the operators know it once the job's first fresh start
has trained (or an earlier job of the deployment has), so only the first segment of the first job of a
deployment that does not declare it decides on the default.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: the job's most recent fresh starts the budget is the median of: recent enough to follow a changed image
#: or region, enough to shrug off one slow boot
RESTART_SAMPLES = 8


@dataclass(frozen=True)
class RestartBudget:
    seconds: float
    #: ``declared`` (the DAG's figure), ``measured`` (this job's starts), ``deployment`` (other jobs'),
    #: ``default`` (nothing measured yet)
    source: str
    samples: int = 0

    def describe(self) -> str:
        if self.source == "measured":
            return f"restart {self.seconds:.0f} s (the median start-up of {self.samples} of this job's fresh starts)"
        if self.source == "deployment":
            return f"restart {self.seconds:.0f} s (the start-up the deployment's jobs measured)"
        return f"restart {self.seconds:.0f} s ({self.source})"


def fresh_starts(rows: Sequence[Any], limit: int = RESTART_SAMPLES) -> list[Any]:
    """The job's most recent ledger rows on a fresh instance, newest first: whose heartbeats to read."""
    fresh = [r for r in rows if r.new_instance]
    return sorted(fresh, key=lambda r: r.started_at, reverse=True)[:limit]


def read_fresh_start_beats(store: Any, rows: Sequence[Any]) -> dict[str, Any]:
    """The heartbeats of :func:`fresh_starts` (one ``get_many``); an unreadable one measures nothing."""
    from airflow_spot.storage.protocol import Heartbeat, JobLayout, SchemaError

    keys = [JobLayout.heartbeat_key(r.attempt_id) for r in fresh_starts(rows)]
    beats = {}
    for raw in store.get_many(keys).values() if keys else ():
        try:
            hb = Heartbeat.from_json(raw)
        except (KeyError, SchemaError):
            continue
        beats[hb.attempt_id] = hb
    return beats


def startup_samples(rows: Sequence[Any], heartbeats: Mapping[str, Any]) -> list[float]:
    """Launch to the end of the first training step, per fresh start whose heartbeat recorded it."""
    out = []
    for r in fresh_starts(rows):
        hb = heartbeats.get(r.attempt_id)
        first = getattr(hb, "first_step_at", None)
        if first is not None and first >= r.started_at:
            out.append(first - r.started_at)
    return out


def restart_budget(rows: Sequence[Any], heartbeats: Mapping[str, Any], *, declared: float | None,
                   default: float, prior: Callable[[], Mapping[str, float]] | None = None) -> RestartBudget:
    """The restart to budget: ``declared`` when the DAG set one, else measured (see the module's doc).

    :param heartbeats: attempt id -> :class:`~airflow_spot.storage.protocol.Heartbeat`, at least of
        :func:`fresh_starts`.
    :param prior: reads the deployment's overheads (its ``startup``); called only for a job that has
        measured no start of its own yet.
    """
    if declared is not None:
        return RestartBudget(float(declared), "declared")
    starts = startup_samples(rows, heartbeats)
    if starts:
        return RestartBudget(statistics.median(starts), "measured", len(starts))
    deployment = dict(prior()) if prior is not None else {}
    if deployment.get("startup") is not None:
        return RestartBudget(float(deployment["startup"]), "deployment")
    return RestartBudget(float(default), "default")
