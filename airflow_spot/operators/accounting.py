"""The Airflow layer's view of the cost ledger: one row per attempt, kept in the job's store.

Rows are written by ``execute_complete`` (every outcome) and read back to count the job's preemptions and
a segment's user-code failures (the retry budgets) and to sum the job (the final task). The billing and
totals maths live in :mod:`airflow_spot.policy.ledger`; this module only moves rows in and out of the store.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.storage.object_store import ObjectStore
from airflow_spot.storage.protocol import Outcome

LEDGER_PREFIX = "control/ledger/"


def record_attempt(
    store: ObjectStore,
    launch: AttemptLaunch,
    outcome: Outcome,
    event: dict[str, Any],
    *,
    steps_after: int | None,
    now: float,
) -> dict[str, Any]:
    """Write (idempotently: one key per attempt) and return the ledger row of one finished attempt."""
    from airflow_spot.policy.ledger import LedgerRow
    from airflow_spot.storage.ledger_store import LedgerStore

    offer = launch.offer_obj
    ended = float(event.get("ended_at") or now)
    steps_before = launch.start_step
    last_step = event.get("last_step")
    committed = steps_after if steps_after is not None else steps_before
    row = LedgerRow(
        attempt_id=launch.attempt_id,
        segment_index=launch.segment_index,
        instance_id=launch.instance_id,
        instance_type=offer.instance_type,
        zone=offer.zone,
        market=offer.market,
        price_per_hour=offer.price_per_hour,
        on_demand_price_per_hour=offer.on_demand_price_per_hour,
        started_at=launch.billed_from,
        ended_at=max(ended, launch.billed_from),
        new_instance=not launch.reused_instance,
        steps_done=max(0, committed - steps_before),
        steps_lost=max(0, (last_step or committed) - committed),
        outcome=outcome.value,
    )
    LedgerStore(store).write(row)
    return row.to_dict()


def read_rows(store: ObjectStore) -> list[Any]:
    from airflow_spot.storage.ledger_store import LedgerStore

    return LedgerStore(store).rows()


def count(store: ObjectStore, outcomes: Iterable[Outcome], segment_index: int | None = None) -> int:
    wanted = {Outcome(o).value for o in outcomes}
    return sum(
        1
        for r in read_rows(store)
        if r.outcome in wanted and (segment_index is None or r.segment_index == segment_index)
    )


def job_totals(store: ObjectStore) -> dict[str, Any]:
    from airflow_spot.policy.ledger import totals

    return totals(read_rows(store)).to_dict()


def summarize(store: ObjectStore, now: float) -> dict[str, Any]:
    """Totals plus the counts the demo and the final task print."""
    rows = read_rows(store)
    out = job_totals(store)
    started = min((r.started_at for r in rows), default=now)
    out.update(
        attempts=len(rows),
        preemptions=sum(r.outcome in (Outcome.PREEMPTED.value, Outcome.LOST.value) for r in rows),
        lost=sum(r.outcome == Outcome.LOST.value for r in rows),
        failures=sum(r.outcome == Outcome.FAILED.value for r in rows),
        steps_lost=sum(r.steps_lost for r in rows),
        wall_seconds=max(0.0, max((r.ended_at for r in rows), default=now) - started),
    )
    return out
