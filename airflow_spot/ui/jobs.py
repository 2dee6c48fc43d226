"""How the UI plugin finds spot training jobs: from Airflow's own metadata DB, then reads them from the store.

A job is found through the XComs its tasks push, read with the API server's DB session (no call to the
backend, no write anywhere):

* ``spot_attempt`` — pushed by every segment when its attempt starts (the "Spot attempt" link's fields:
  ``job_uri``, ``attempt_id``, ``aws_conn_id``): a job is visible from its first launch, while it runs;
* ``summary`` — pushed by the job's finish task (carries ``job_uri`` too): the final figures.

The newest XCom of either key per DAG run gives the job's store; everything else (attempts, ledger,
checkpoints, heartbeats, estimate) comes from the store through
:class:`~airflow_spot.storage.job_view.JobView`. A DAG run can hold only one spot job this way (the
newest wins); a DAG with two ``SpotTraining`` groups shows the one that ran last.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from airflow_spot.links.attempt import LINK_XCOM_KEY
from airflow_spot.storage.job_view import JobView

log = logging.getLogger(__name__)

SUMMARY_XCOM_KEY = "summary"


@dataclass(frozen=True)
class JobRef:
    """A job as Airflow knows it: its DAG run and where its store is."""

    dag_id: str
    run_id: str
    job_uri: str
    aws_conn_id: str | None
    run_state: str | None
    backend: str = "local"


def _value(row: Any) -> Any:
    from airflow.models.xcom import XComModel

    try:
        return XComModel.deserialize_value(row)
    except Exception:  # noqa: BLE001 - a value this code cannot decode is simply not a job
        return row.value


def find_jobs(session: Session, dag_id: str | None = None, run_id: str | None = None, limit: int = 200) -> list[JobRef]:
    """Jobs known to Airflow, newest first (one per DAG run)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel

    q = (
        select(XComModel.dag_id, XComModel.run_id, XComModel.key, XComModel.value, XComModel.timestamp, DagRun.state)
        .join(DagRun, (DagRun.dag_id == XComModel.dag_id) & (DagRun.run_id == XComModel.run_id))
        .where(XComModel.key.in_((LINK_XCOM_KEY, SUMMARY_XCOM_KEY)))
        .order_by(XComModel.timestamp.desc())
    )
    if dag_id is not None:
        q = q.where(XComModel.dag_id == dag_id)
    if run_id is not None:
        q = q.where(XComModel.run_id == run_id)
    jobs: dict[tuple[str, str], JobRef] = {}
    for row in session.execute(q.limit(limit * 20)):
        if (row.dag_id, row.run_id) in jobs:
            continue
        value = _value(row)
        if not isinstance(value, dict) or not value.get("job_uri"):
            continue  # a "summary" XCom of some other operator, or a link from before job_uri was kept
        state = row.state.value if hasattr(row.state, "value") else row.state
        jobs[(row.dag_id, row.run_id)] = JobRef(
            row.dag_id, row.run_id, str(value["job_uri"]), value.get("aws_conn_id"), state,
            str(value.get("backend") or "local"),
        )
        if len(jobs) >= limit:
            break
    return list(jobs.values())


def open_view(job: JobRef) -> JobView:
    """The job's store, opened as a task would (``s3://`` through the Amazon provider's hook)."""
    from airflow_spot.hooks.spot import SpotHook

    return JobView(SpotHook(backend=job.backend, aws_conn_id=job.aws_conn_id).get_store(job.job_uri))


def job_row(job: JobRef, now: float | None = None) -> dict[str, Any]:
    """The list's row of one job: DAG, run, state, progress, cost, savings (an ``error`` when unreadable)."""
    row: dict[str, Any] = {"dag_id": job.dag_id, "run_id": job.run_id, "job_uri": job.job_uri,
                           "run_state": job.run_state}
    try:
        snap = open_view(job).snapshot(time.time() if now is None else now, with_estimate=False)
    except Exception as exc:  # noqa: BLE001 - one unreadable store must not hide the other jobs
        log.warning("job %s/%s: store %s not readable: %s", job.dag_id, job.run_id, job.job_uri, exc)
        return {**row, "state": job.run_state, "error": f"store not readable: {exc}"}
    return {**row, **{k: snap[k] for k in ("state", "progress", "current_step", "total_steps", "cost",
                                            "on_demand_cost", "savings", "savings_fraction", "preemptions")}}
