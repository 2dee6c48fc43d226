"""How long a spot pool has been up, estimated from the job's own observations only.

``slack-budget`` leaves on-demand only for a pool that has been up ``min_spot_up_seconds``
(:mod:`airflow_spot.policy.deadline`). The simulator knows each pool's true up-since time from the traces;
a real job does not. What it does know is when it saw a pool *fail*:

* a spot attempt of this job in that pool ended ``preempted`` or ``lost`` (its ledger row's
  ``ended_at``), or
* a launch in that pool was refused for lack of capacity (when the caller records such errors).

The estimate: **seconds since the job last saw the pool fail**; for a pool the job never saw fail,
**seconds since the job started** (the job has watched it that long without a failure; the earlier past
is unknown, so it is not credited). For a pool seen to fail the estimate is never younger than the truth
(the pool came back some time after the failure) and can be much older: it may go down and come back
unseen while the job runs elsewhere — the price of seeing only what the job itself touched.

Causal and pure: observations after ``now`` are ignored, time is passed in, no I/O.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from airflow_spot.policy.ledger import PREEMPTION_OUTCOMES
from airflow_spot.policy.offers import Market


def row_pool(row: Any) -> str:
    """The pool (``Offer.pool``: ``instance_type@zone``) a ledger row ran in."""
    return f"{row.instance_type}@{row.zone}"


def observed_failures(
    rows: Iterable[Any], now: float, capacity_errors: Iterable[tuple[str, float]] = ()
) -> dict[str, float]:
    """Pool -> the last time (<= ``now``) the job saw it fail.

    :param rows: the job's ledger rows (:class:`airflow_spot.policy.ledger.LedgerRow` or alike: need
        ``instance_type``, ``zone``, ``market``, ``ended_at``, ``outcome``).
    :param now: the current time; later observations are ignored (the estimate only uses the past).
    :param capacity_errors: ``(pool, time)`` of launches refused for lack of capacity.
    """
    out: dict[str, float] = {}

    def seen(pool: str, at: float) -> None:
        if at <= now and at > out.get(pool, float("-inf")):
            out[pool] = at

    for r in rows:
        # an on-demand attempt shares the pool name with the spot pool of its type but says nothing
        # about spot capacity; a "completed" or "failed" attempt ended for other reasons
        if r.outcome in PREEMPTION_OUTCOMES and Market(r.market) is Market.SPOT:
            seen(row_pool(r), float(r.ended_at))
    for pool, at in capacity_errors:
        seen(pool, float(at))
    return out


def observed_pool_age(pool: str, failures: Mapping[str, float], now: float, job_started_at: float) -> float:
    """Seconds ``pool`` has been up as far as the job saw: since its last seen failure, else since the
    job started (never negative).

    :param failures: from :func:`observed_failures`.
    """
    last = failures.get(pool)
    since = job_started_at if last is None else max(last, job_started_at)
    return max(0.0, now - since)


def observed_spot_up_seconds(
    pools: Iterable[str], failures: Mapping[str, float], now: float, job_started_at: float
) -> float | None:
    """The estimated age of the longest-up of ``pools`` (the candidates the job could launch in), or
    None when there is no candidate."""
    ages = [observed_pool_age(p, failures, now, job_started_at) for p in pools]
    return max(ages) if ages else None
