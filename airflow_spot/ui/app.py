"""The Spot Training FastAPI app, mounted under ``/spot`` in Airflow's API server.

Routes (every one requires Airflow authentication: ``requires_authenticated()`` on the whole app, so a
request without a valid token — ``Authorization: Bearer`` or the UI's ``_token`` cookie — gets 401):

* ``GET /spot/`` and ``GET /spot/jobs``: the list of jobs (HTML);
* ``GET /spot/jobs/{dag_id}/{run_id}``: one job's page (HTML);
* ``GET /spot/api/jobs``: the list as JSON (DAG, run, state, progress, cost, savings).

  The list holds the :data:`~airflow_spot.ui.jobs.LIST_LIMIT` newest jobs; ``?limit=N`` (up to
  :data:`~airflow_spot.ui.jobs.LIST_MAX`), ``?offset=N`` (skip the N newest) and ``?dag_id=`` show others.
  The page says when older jobs are left out; the JSON (a list, as before) says it in its headers
  ``X-Spot-Jobs-Limit``, ``X-Spot-Jobs-Offset`` and ``X-Spot-Jobs-More`` (``true``: older jobs not shown)
  and, when there are, a ``Link: <...>; rel="next"`` to the next page;
* ``GET /spot/api/jobs/{dag_id}/{run_id}``: one job as JSON (everything the page shows); before the job's
  first attempt (its DAG run queued, or its store still empty) it holds the offline ranking of instance
  types for the job's GPU request (``ranking``, :mod:`airflow_spot.ui.prestart`).

It reads Airflow's DB (to find jobs, :mod:`airflow_spot.ui.jobs`), the job's store and the market's
offers (catalog prices for ``local``); it never launches or terminates anything.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, HTTPException, Query, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from airflow_spot.storage.job_view import final_figures, finished_state
from airflow_spot.ui import jobs as ui_jobs
from airflow_spot.ui import page, prestart
from airflow_spot.ui.jobs import JobRef, find_jobs, job_rows, open_view

log = logging.getLogger(__name__)

#: offers shown on a job's page
OFFERS_SHOWN = 8


def _session():
    from airflow.api_fastapi.common.db.common import _get_session

    yield from _get_session()


SessionDep = Annotated[Any, Depends(_session)]


def _auth():
    from airflow.api_fastapi.core_api.security import requires_authenticated

    return requires_authenticated()


def _readable_dags():
    """The DAG ids the user may read, as Airflow's own API lists them (``ReadableDagsFilterDep``; the
    global auth manager, as a plugin's app holds none in its state)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.core_api.security import get_user

    def readable(user: Any = Depends(get_user)) -> set[str]:
        return get_auth_manager().get_authorized_dag_ids(user=user, method="GET")

    return readable


def _may_read_dag():
    """The user may read the DAG named in the path (Airflow's ``requires_access_dag``: 403 otherwise)."""
    from airflow.api_fastapi.core_api.security import requires_access_dag

    return requires_access_dag("GET")


def _state(job: JobRef, snap_state: str) -> str:
    """The store knows a job's progress, Airflow whether its run is still going."""
    if snap_state == "finished" or job.run_state in (None, "running", "queued"):
        return snap_state
    return str(job.run_state)


def cheapest_offers(job: JobRef, snap: dict[str, Any], limit: int = OFFERS_SHOWN) -> tuple[list[dict], str | None]:
    """Offers for the job's GPU request now, ranked by the expected cost of its remaining steps."""
    from airflow_spot.hooks.spot import SpotHook
    from airflow_spot.policy.estimate import StepTimeModel, rank_offers_for_job
    from airflow_spot.policy.offers import GpuRequest

    gpus = snap.get("gpus")
    if not gpus:
        return [], "The job has not recorded its GPU request yet (it does at its first segment)."
    try:
        market = SpotHook(backend=snap.get("backend") or job.backend, aws_conn_id=job.aws_conn_id).get_market()
        offers = market.offers(GpuRequest.from_dict(gpus))
    except Exception as exc:  # noqa: BLE001 - the page shows the job even when the market is unreachable
        return [], f"Offers are not available now: {exc}"
    est = snap.get("estimate") or {}
    step = est.get("step_seconds")
    running = [a for a in snap.get("attempts") or [] if a.get("instance_type")]
    current = next((o for o in offers if running and o.instance_type == running[-1]["instance_type"]), None)
    # the steps left; for a finished job, the whole job again (what a rerun would cost)
    remaining = est.get("remaining_steps") or snap.get("total_steps") or 0
    if not step or current is None or remaining <= 0:
        ranked = sorted(offers, key=lambda o: o.price_per_hour / max(o.relative_throughput, 1e-9))[:limit]
        return [{**o.to_dict(), "hours": None, "expected_cost": None, "steps": remaining} for o in ranked], None
    # the measured step time on the current GPU, scaled to the others by the catalog's relative throughput
    model = StepTimeModel(a=math.log(step * current.relative_throughput), b=1.0)
    ranked = rank_offers_for_job(offers, remaining, model, [current.relative_throughput])
    return [{**e.to_dict(), "steps": remaining} for e in ranked[:limit]], None


def _store_is_empty(snap: dict[str, Any]) -> bool:
    """Nothing of the job in its store: no attempt, ledger row, checkpoint (good or broken) or summary."""
    return not (snap["attempts"] or snap["checkpoints"] or snap.get("broken_checkpoints") or snap["summary"]
                or snap.get("unreadable") or snap.get("gpus"))


def _unreadable_snapshot(job: JobRef, exc: Exception) -> dict[str, Any]:
    """What the page shows of a job whose store could not be read at all: nothing but why."""
    return {
        "job_uri": job.job_uri, "state": job.run_state or "unknown", "total_steps": None, "committed_step": None,
        "current_step": None, "progress": None, "cost": None, "on_demand_cost": None, "savings": None,
        "savings_fraction": None, "transfer_dollars": 0.0, "probes": 0, "probe_dollars": 0.0, "preemptions": None, "steps_lost": None,
        "attempts": [], "checkpoints": [], "broken_checkpoints": [],
        "unreadable": [{"key": job.job_uri, "error": f"store not readable: {type(exc).__name__}: {exc}"}],
        "series": [], "estimate": None, "summary": None, "gpus": None, "backend": job.backend,
    }


def _from_summary(job: JobRef, snap: dict[str, Any], session) -> str:
    """A finished job whose store is gone (or emptied): its headline from the finish task's summary XCom,
    as the list shows it; returns the note the page shows."""
    summary = job.summary or {}
    final = final_figures(summary)
    snap["summary"] = summary
    note = (f"The job's store {job.job_uri} is gone or empty: attempts, checkpoints and the chart are not "
            "available")
    if final is None:
        snap["state"] = finished_state(summary)
        return note + "; its finish task's summary lacks the final figures, so none are shown."
    snap.update(final)
    for key in ("steps_lost", "transfer_dollars", "probes", "probe_dollars", "idle_dollars"):
        if isinstance(summary.get(key), (int, float)) and not isinstance(summary.get(key), bool):
            snap[key] = summary[key]
    # its GPU request (for the offers now) from the DAG, since the store's job record is gone
    spec = prestart.job_spec(session, job.dag_id) if session is not None else None
    if spec and not snap.get("gpus"):
        snap["gpus"] = spec.get("gpus")
    return note + "; the figures are its finish task's summary."


def job_detail(job: JobRef, session=None) -> dict[str, Any]:
    # the view's display read: a ledger row or object that does not decode is left out and named, not a 500
    try:
        snap = open_view(job).snapshot(time.time(), skip_unreadable=True)
        failed = False
    except Exception as exc:  # noqa: BLE001 - the page still shows the job, and says why it shows no more
        log.warning("job %s/%s: store %s not readable: %s", job.dag_id, job.run_id, job.job_uri, exc)
        snap, failed = _unreadable_snapshot(job, exc), True
    store_note = None
    if job.summary is not None and (failed or _store_is_empty(snap)):
        store_note = _from_summary(job, snap, session)
        if failed:
            store_note = store_note.replace("is gone or empty", "could not be read")
    snap["state"] = _state(job, snap["state"])
    offers, why = cheapest_offers(job, snap)
    if (store_note or failed) and not snap.get("gpus"):
        why = "The job's store is not available and its DAG does not say its GPU request: no offers to show."
    detail = {"dag_id": job.dag_id, "run_id": job.run_id, "run_state": job.run_state, **snap,
              "offers": offers, "offers_note": why, "ranking": None, "store_note": store_note}
    if not snap["attempts"] and store_note is None and not failed:  # the store is still empty: the offline ranking, as before it starts
        spec = (prestart.job_spec(session, job.dag_id) if session is not None else None) or (
            {"gpus": snap["gpus"], "total_steps": snap["total_steps"], "backend": snap.get("backend") or job.backend,
             "aws_conn_id": job.aws_conn_id} if snap.get("gpus") and snap.get("total_steps") else None)
        detail["ranking"] = prestart.ranking(spec) if spec else None
    return detail


def not_started_detail(session, dag_id: str, run_id: str) -> dict[str, Any] | None:
    """A DAG run of a spot training DAG whose job has no attempt yet (queued, or before its first launch):
    the job's request from the serialized DAG and the offline ranking of instance types for it."""
    from airflow.models.dagrun import DagRun
    from sqlalchemy import select

    run = session.execute(select(DagRun.state).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)).first()
    if run is None:
        return None
    spec = prestart.job_spec(session, dag_id)
    if spec is None:
        return None
    state = run.state.value if hasattr(run.state, "value") else run.state
    total = int(spec["total_steps"])
    return {
        "dag_id": dag_id, "run_id": run_id, "run_state": state, "job_uri": None, "state": "not started",
        "total_steps": total, "committed_step": None, "current_step": 0, "progress": 0.0, "cost": 0.0,
        "on_demand_cost": 0.0, "savings": 0.0, "savings_fraction": None, "preemptions": 0, "steps_lost": 0,
        "attempts": [], "checkpoints": [], "broken_checkpoints": [], "unreadable": [], "series": [],
        "estimate": None, "summary": None, "store_note": None,
        "gpus": spec["gpus"], "backend": spec.get("backend"), "offers": [],
        "offers_note": "The job has not started: its ranking of instance types is above.",
        "ranking": prestart.ranking(spec),
    }


def _detail(session, dag_id: str, run_id: str) -> dict[str, Any]:
    jobs = find_jobs(session, dag_id=dag_id, run_id=run_id, limit=1)
    if jobs:
        return job_detail(jobs[0], session)
    detail = not_started_detail(session, dag_id, run_id)
    if detail is None:
        raise HTTPException(404, f"no spot training job in DAG {dag_id!r} run {run_id!r}")
    return detail


def _rows(session, limit: int | None = None, offset: int = 0, dag_id: str | None = None,
          readable: set[str] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The list's rows (of the DAGs in ``readable``, when given), and what it left out: ``{"limit", "offset",
    "more", "dag_id"}`` (``more``: older jobs than these exist)."""
    limit = ui_jobs.LIST_LIMIT if limit is None else limit
    # one more: are there older ones?
    jobs = find_jobs(session, dag_id=dag_id, limit=limit + 1, offset=offset, dag_ids=readable)
    more = len(jobs) > limit
    jobs = jobs[:limit]
    rows = job_rows(jobs)
    for job, row in zip(jobs, rows):
        row["state"] = _state(job, str(row.get("state")))
    return rows, {"limit": limit, "offset": offset, "more": more, "dag_id": dag_id, "max": ui_jobs.LIST_MAX}


def _list_query(limit: int, offset: int, dag_id: str | None) -> str:
    return urlencode({k: v for k, v in (("dag_id", dag_id), ("limit", limit), ("offset", offset)) if v is not None})


_LIMIT = Query(None, ge=1, le=ui_jobs.LIST_MAX, description="jobs to show (default: LIST_LIMIT, the newest)")
_OFFSET = Query(0, ge=0, description="skip this many of the newest jobs")


def create_app() -> FastAPI:
    # no /docs, /redoc or /openapi.json: FastAPI serves those without the app's dependencies
    app = FastAPI(title="Spot Training", dependencies=[Depends(_auth())], docs_url=None, redoc_url=None,
                  openapi_url=None)
    # what Airflow lets the user read: the list holds those DAGs' jobs, a job's page needs its DAG readable
    readable_dags = Depends(_readable_dags())
    may_read = [Depends(_may_read_dag())]

    @app.get("/api/jobs")
    def list_jobs(session: SessionDep, response: Response, limit: int | None = _LIMIT, offset: int = _OFFSET,
                  dag_id: str | None = None, readable: Any = readable_dags) -> list[dict[str, Any]]:
        rows, shown = _rows(session, limit, offset, dag_id, readable)
        response.headers["X-Spot-Jobs-Limit"] = str(shown["limit"])
        response.headers["X-Spot-Jobs-Offset"] = str(shown["offset"])
        response.headers["X-Spot-Jobs-More"] = "true" if shown["more"] else "false"
        if shown["more"]:
            nxt = _list_query(shown["limit"], shown["offset"] + shown["limit"], dag_id)
            response.headers["Link"] = f'</spot/api/jobs?{nxt}>; rel="next"'
        return rows

    @app.get("/api/jobs/{dag_id}/{run_id}", dependencies=may_read)
    def get_job(dag_id: str, run_id: str, session: SessionDep) -> dict[str, Any]:
        return _detail(session, dag_id, run_id)

    @app.get("/", response_class=HTMLResponse)
    def index(session: SessionDep, limit: int | None = _LIMIT, offset: int = _OFFSET, dag_id: str | None = None,
              readable: Any = readable_dags) -> str:
        rows, shown = _rows(session, limit, offset, dag_id, readable)
        return page.jobs_page(rows, shown=shown)

    @app.get("/jobs", include_in_schema=False)
    def jobs_redirect() -> RedirectResponse:
        return RedirectResponse("/spot/")

    @app.get("/jobs/{dag_id}/{run_id}", response_class=HTMLResponse, dependencies=may_read)
    def job_html(dag_id: str, run_id: str, session: SessionDep) -> str:
        try:
            detail = _detail(session, dag_id, run_id)
        except HTTPException as exc:  # the detail names the DAG and run of the request: escaped by the page
            return HTMLResponse(page.message_page(str(exc.detail)), status_code=exc.status_code)
        return page.job_page(dag_id, run_id, detail, detail["offers"], detail["offers_note"], detail.get("ranking"))

    return app


app = create_app()
