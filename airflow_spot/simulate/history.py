"""The deployment's availability log as a new job finds it: what an earlier job of the deployment logged.

A job that the operators start in a deployment that has run before reads, through the market, every
launch, refusal, preemption and probe the deployment's earlier jobs logged
(:mod:`airflow_spot.storage.availability`). A replay of one job alone starts with an empty log, the
harder case. :func:`deployment_history` builds the log of the simplest deployment that has run before:
one job of the same policy that started ``hours`` before the replayed job (or at the traces' start, when
that is later) and ran until the replayed job starts. That earlier job itself started with an empty
log, and it saw the traces only as a job sees them (its own tries and probes), so the history holds
nothing a real log could not.
"""
from __future__ import annotations

from dataclasses import replace

from airflow_spot.policy.observations import LOGGED_KINDS, PoolEvent
from airflow_spot.policy.offers import Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import HOUR, JobSpec, SimPool, simulate

#: the name the earlier job's events carry in the replayed job's log (``PoolEvent.job``)
PREVIOUS_JOB = "previous-job"


def deployment_history(
    spec: JobSpec, pools: list[SimPool], on_demand: Offer, name: str, offset_ticks: int, hours: float
) -> list[PoolEvent]:
    """The events an earlier job of policy ``name`` logged in the ``hours`` before tick ``offset_ticks``, on
    the clock of a job that starts there (at or before 0), named :data:`PREVIOUS_JOB`. Empty when the
    policy reads no log (it reads the traces) or the replay starts at the traces' start.

    :raises ValueError: ``hours`` is negative or not a number.
    """
    if not hours >= 0:  # also NaN
        raise ValueError(f"the history's length must be >= 0 hours, got {hours!r}")
    gap = pools[0].trace.gap_seconds if pools else 60.0
    start = max(0, offset_ticks - int(round(hours * HOUR / gap)))
    earlier = controllers.get(name)()
    if start >= offset_ticks or not hasattr(earlier, "events"):
        return []
    shift = (offset_ticks - start) * gap
    simulate(spec, pools, on_demand, earlier, offset_ticks=start, max_hours=shift / HOUR)
    # the replay runs to the end of the tick it stops in: what came after the new job's start is its future
    # and of it only what the deployment's log holds (never its ``running`` rows)
    return [replace(e, at=e.at - shift, job=PREVIOUS_JOB) for e in earlier.events
            if e.at <= shift and e.kind in LOGGED_KINDS]
