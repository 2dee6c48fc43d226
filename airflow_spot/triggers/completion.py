"""Accounting of a completed attempt, shared by ``SpotSegmentOperator.execute_complete`` and the trigger.

A completed segment needs no decision a worker must take (no retry, no budget): its ledger row and its
XCom summary follow from the store. So :class:`~airflow_spot.triggers.segment.SegmentTrigger` can end
the task itself (Airflow's ``TaskSuccessEvent``), which saves the round trip of resuming the task on a
worker (scheduler -> executor -> worker start -> DAG parse) at every segment boundary. Both paths call
:func:`complete_attempt`, so the row and the summary are the same whichever ran it; the row is keyed by
attempt id, so running it twice (a triggerer restart, a fallback) writes the same object again.
"""
from __future__ import annotations

from typing import Any

from airflow_spot.operators import accounting
from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.storage.object_store import ObjectStore
from airflow_spot.storage.protocol import JobLayout, Outcome


def reached_end(store: ObjectStore, end_step: int) -> tuple[bool, int | None]:
    """Whether the job's newest committed checkpoint is at or past ``end_step``, and that step."""
    latest = JobLayout(store).latest_step()
    return latest is not None and latest >= end_step, latest


def summarize(
    store: ObjectStore,
    launch: AttemptLaunch,
    outcome: Outcome,
    event: dict[str, Any],
    *,
    segment_index: int,
    latest: int | None,
    now: float,
    market=None,
) -> dict[str, Any]:
    """Write the attempt's ledger row and return the summary pushed to XCom (key ``attempt``); ``market``
    prices the run (see :func:`airflow_spot.operators.accounting.billed_price`)."""
    row = accounting.record_attempt(store, launch, outcome, event, steps_after=latest, now=now, market=market)
    totals = accounting.job_totals(store)
    return {
        "segment": segment_index,
        "attempt_id": launch.attempt_id,
        "outcome": outcome.value,
        "instance_id": launch.instance_id,
        "instance_type": launch.offer["instance_type"],
        "zone": launch.offer["zone"],
        "market": launch.offer["market"],
        "price_per_hour": row.get("price_per_hour"),
        "latest_step": latest,
        "steps_done": row.get("steps_done"),
        "steps_lost": row.get("steps_lost"),
        "notice_at": row.get("notice_at"),
        "billed_seconds": row.get("billed_seconds"),
        "attempt_cost": row.get("cost"),
        "job_cost_so_far": totals.get("cost"),
        "job_savings_so_far": totals.get("savings"),
    }


def complete_attempt(
    store: ObjectStore, attempt_id: str, event: dict[str, Any], *, segment_index: int, end_step: int, now: float,
    market=None,
) -> dict[str, Any] | None:
    """The summary of a cleanly completed attempt (ledger row written), or None when the worker must
    decide: the event is not ``completed``, the attempt has no launch record, or the store's newest
    checkpoint is short of ``end_step`` (``execute_complete`` then fails the attempt with an explanation)."""
    if event.get("status") != Outcome.COMPLETED.value:
        return None
    launch = AttemptLaunch.read(store, attempt_id)
    if launch is None:
        return None
    done, latest = reached_end(store, end_step)
    if not done:
        return None
    return summarize(store, launch, Outcome.COMPLETED, event, segment_index=segment_index, latest=latest, now=now,
                     market=market)
