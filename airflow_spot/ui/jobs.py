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

The list's row of a finished job (its newest XCom is the summary: no attempt started after it) comes from
that summary, already read from the DB: a deployment's history costs the list page no store read, and a
job whose store was deleted keeps its final figures. The other jobs' stores are read a few at once
(:data:`LIST_CONCURRENCY`), since each is a few LISTs and GETs that mostly wait on the network, and every
read goes through :data:`PAGE_READS`: an object read by an earlier load and not written since is not
read again.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import String, case, cast, func, select
from sqlalchemy.orm import Session

from airflow_spot.links.attempt import LINK_XCOM_KEY
from airflow_spot.storage.job_view import JobView, final_figures
from airflow_spot.storage.object_store import ObjectStore
from airflow_spot.storage.read_cache import CachedReads, ReadCache

log = logging.getLogger(__name__)

SUMMARY_XCOM_KEY = "summary"

#: the list's columns besides DAG, run and store
ROW_FIELDS = ("state", "progress", "current_step", "total_steps", "cost", "on_demand_cost", "savings",
              "savings_fraction", "preemptions")
#: jobs the list shows by default (the newest); ``?limit=`` (up to :data:`LIST_MAX`) and ``?offset=`` page on
LIST_LIMIT = 200
#: the most jobs one list page shows
LIST_MAX = 1000
#: job stores the list page reads at once (each job's reads go several at once on S3 as well)
LIST_CONCURRENCY = 4
_HOOKS_LOCK = threading.Lock()
#: what the pages have read, kept while unchanged (``storage/read_cache.py``): a reload of a running job
#: reads its listings and the objects written since, not its whole history again
PAGE_READS = ReadCache(max_bytes=64 * 1024 * 1024)


@dataclass(frozen=True)
class JobRef:
    """A job as Airflow knows it: its DAG run and where its store is."""

    dag_id: str
    run_id: str
    job_uri: str
    aws_conn_id: str | None
    run_state: str | None
    backend: str = "local"
    #: the finish task's summary XCom, when it is the run's newest: the list's row comes from it
    summary: dict[str, Any] | None = field(default=None, compare=False, repr=False)


def _value(row: Any) -> Any:
    from airflow.models.xcom import XComModel

    try:
        return XComModel.deserialize_value(row)
    except Exception:  # noqa: BLE001 - a value this code cannot decode is simply not a job
        return row.value


def find_jobs(session: Session, dag_id: str | None = None, run_id: str | None = None, limit: int = LIST_LIMIT,
              offset: int = 0, dag_ids: set[str] | None = None) -> list[JobRef]:
    """Jobs known to Airflow, newest first (one per DAG run, the ``limit`` runs with the newest XComs after
    the ``offset`` newest).

    A job pushes one link XCom per segment task (a 48 h job of 15 min segments, about 200), so the runs are
    picked in SQL (the newest XCom of each run), not from a fixed number of XCom rows, which held only
    the newest few long jobs."""
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel

    # "summary" is a common key: only values that name a job's store are candidates (the text of the
    # JSON value, as both SQLite and PostgreSQL cast it)
    scope = [XComModel.key.in_((LINK_XCOM_KEY, SUMMARY_XCOM_KEY)), cast(XComModel.value, String).like("%job_uri%")]
    if dag_id is not None:
        scope.append(XComModel.dag_id == dag_id)
    if dag_ids is not None:  # the DAGs the user may read
        scope.append(XComModel.dag_id.in_(sorted(dag_ids)))
    if run_id is not None:
        scope.append(XComModel.run_id == run_id)
    newest = (
        select(XComModel.dag_id, XComModel.run_id, func.max(XComModel.timestamp).label("newest"))
        .where(*scope)
        .group_by(XComModel.dag_id, XComModel.run_id)
        .order_by(func.max(XComModel.timestamp).desc(), XComModel.dag_id, XComModel.run_id)
        .limit(limit)
        .offset(offset)
        .subquery()
    )
    rows = select(XComModel.dag_id, XComModel.run_id, XComModel.key, XComModel.value, XComModel.timestamp,
                  DagRun.state).join(DagRun, (DagRun.dag_id == XComModel.dag_id) & (DagRun.run_id == XComModel.run_id))
    runs = [(r.dag_id, r.run_id) for r in session.execute(select(newest.c.dag_id, newest.c.run_id)
                                                             .order_by(newest.c.newest.desc()))]
    jobs: dict[tuple[str, str], JobRef] = {}
    # each run's newest XCom (one row, or a few with the same time)
    on_newest = (newest.c.dag_id == XComModel.dag_id) & (newest.c.run_id == XComModel.run_id) & (
        newest.c.newest == XComModel.timestamp)
    # at equal times a link goes first: a run it leaves in doubt is read from its store, not from a summary
    newest_first = (XComModel.timestamp.desc(), case((XComModel.key == LINK_XCOM_KEY, 0), else_=1))
    _take(jobs, session.execute(rows.join(newest, on_newest).where(*scope).order_by(*newest_first)))
    for dag, run in runs:
        if (dag, run) not in jobs:  # its newest is not a job (another operator's "summary"): its older ones
            _take(jobs, session.execute(rows.where(*scope, XComModel.dag_id == dag, XComModel.run_id == run)
                                        .order_by(*newest_first)))
    return [jobs[r] for r in runs if r in jobs]


def _take(jobs: dict[tuple[str, str], JobRef], rows) -> None:
    """Add each run's first row (newest first) that is a job: a "summary" XCom of some other operator, or a
    link from before ``job_uri`` was kept, is not one."""
    for row in rows:
        if (row.dag_id, row.run_id) in jobs:
            continue
        value = _value(row)
        if not isinstance(value, dict) or not value.get("job_uri"):
            continue
        state = row.state.value if hasattr(row.state, "value") else row.state
        jobs[(row.dag_id, row.run_id)] = JobRef(
            row.dag_id, row.run_id, str(value["job_uri"]), value.get("aws_conn_id"), state,
            str(value.get("backend") or "local"), value if row.key == SUMMARY_XCOM_KEY else None,
        )


def open_view(job: JobRef, hooks: dict[tuple[str, str | None], Any] | None = None) -> JobView:
    """The job's store, opened as a task would (``s3://`` through the Amazon provider's hook), its reads
    kept in :data:`PAGE_READS`.

    :param hooks: hooks to reuse, by backend and connection (one S3 client for a list of jobs, not one each).
    """
    return JobView(CachedReads(_open_store(job, hooks), PAGE_READS))


def _open_store(job: JobRef, hooks: dict[tuple[str, str | None], Any] | None) -> ObjectStore:
    from airflow_spot.hooks.spot import SpotHook

    if hooks is None:
        return SpotHook(backend=job.backend, aws_conn_id=job.aws_conn_id).get_store(job.job_uri)
    with _HOOKS_LOCK:  # the list's threads share one hook, and so one S3 client, per connection
        key = (job.backend, job.aws_conn_id)
        if key not in hooks:
            hooks[key] = SpotHook(backend=job.backend, aws_conn_id=job.aws_conn_id)
        return hooks[key].get_store(job.job_uri)  # opening is cheap once the client is made


def job_row(job: JobRef, now: float | None = None, hooks: dict | None = None) -> dict[str, Any]:
    """The list's row of one job: DAG, run, state, progress, cost, savings (an ``error`` when unreadable)."""
    row: dict[str, Any] = {"dag_id": job.dag_id, "run_id": job.run_id, "job_uri": job.job_uri,
                           "run_state": job.run_state}
    final = final_figures(job.summary) if job.summary is not None else None
    if final is not None:
        return {**row, **final}
    try:
        snap = open_view(job, hooks).snapshot(time.time() if now is None else now, with_estimate=False,
                                              skip_unreadable=True)
    except Exception as exc:  # noqa: BLE001 - one unreadable store must not hide the other jobs
        log.warning("job %s/%s: store %s not readable: %s", job.dag_id, job.run_id, job.job_uri, exc)
        return {**row, "state": job.run_state, "error": f"store not readable: {exc}"}
    out = {**row, **{k: snap[k] for k in ROW_FIELDS}}
    if snap.get("unreadable"):  # the figures leave those objects out: the row says so
        bad = snap["unreadable"]
        out["error"] = (f"{len(bad)} object{'s' if len(bad) > 1 else ''} in the store not readable, left out "
                        f"of these figures: {', '.join(u['key'] for u in bad[:3])}{' …' if len(bad) > 3 else ''}")
    return out


def job_rows(jobs: list[JobRef], now: float | None = None) -> list[dict[str, Any]]:
    """The rows of ``jobs``, in their order; the stores that must be read, :data:`LIST_CONCURRENCY` at once."""
    now = time.time() if now is None else now
    hooks: dict = {}
    if len(jobs) < 2:
        return [job_row(job, now, hooks) for job in jobs]
    with ThreadPoolExecutor(min(LIST_CONCURRENCY, len(jobs)), thread_name_prefix="spot-ui-list") as ex:
        return list(ex.map(lambda job: job_row(job, now, hooks), jobs))
