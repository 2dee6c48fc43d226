"""The Spot Training FastAPI app, mounted under ``/spot`` in Airflow's API server.

Routes (every one requires Airflow authentication: ``requires_authenticated()`` on the whole app, so a
request without a valid token — ``Authorization: Bearer`` or the UI's ``_token`` cookie — gets 401):

* ``GET /spot/`` and ``GET /spot/jobs``: the list of jobs (HTML);
* ``GET /spot/jobs/{dag_id}/{run_id}``: one job's page (HTML);
* ``GET /spot/api/jobs``: the list as JSON (DAG, run, state, progress, cost, savings);
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

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import HTMLResponse, RedirectResponse

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


def job_detail(job: JobRef, session=None) -> dict[str, Any]:
    snap = open_view(job).snapshot(time.time())
    snap["state"] = _state(job, snap["state"])
    offers, why = cheapest_offers(job, snap)
    detail = {"dag_id": job.dag_id, "run_id": job.run_id, "run_state": job.run_state, **snap,
              "offers": offers, "offers_note": why, "ranking": None}
    if not snap["attempts"]:  # the job's store is still empty: the offline ranking, as before it starts
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
        "on_demand_cost": 0.0, "savings": 0.0, "savings_fraction": 0.0, "preemptions": 0, "steps_lost": 0,
        "attempts": [], "checkpoints": [], "series": [], "estimate": None, "summary": None,
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


def _rows(session) -> list[dict[str, Any]]:
    jobs = find_jobs(session)
    rows = job_rows(jobs)
    for job, row in zip(jobs, rows):
        row["state"] = _state(job, str(row.get("state")))
    return rows


def create_app() -> FastAPI:
    # no /docs, /redoc or /openapi.json: FastAPI serves those without the app's dependencies
    app = FastAPI(title="Spot Training", dependencies=[Depends(_auth())], docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.get("/api/jobs")
    def list_jobs(session: SessionDep) -> list[dict[str, Any]]:
        return _rows(session)

    @app.get("/api/jobs/{dag_id}/{run_id}")
    def get_job(dag_id: str, run_id: str, session: SessionDep) -> dict[str, Any]:
        return _detail(session, dag_id, run_id)

    @app.get("/", response_class=HTMLResponse)
    def index(session: SessionDep) -> str:
        return page.jobs_page(_rows(session))

    @app.get("/jobs", include_in_schema=False)
    def jobs_redirect() -> RedirectResponse:
        return RedirectResponse("/spot/")

    @app.get("/jobs/{dag_id}/{run_id}", response_class=HTMLResponse)
    def job_html(dag_id: str, run_id: str, session: SessionDep) -> str:
        try:
            detail = _detail(session, dag_id, run_id)
        except HTTPException as exc:
            return HTMLResponse(page.jobs_page([]).replace("No spot training job has started yet.", exc.detail),
                                status_code=exc.status_code)
        return page.job_page(dag_id, run_id, detail, detail["offers"], detail["offers_note"], detail.get("ranking"))

    return app


app = create_app()
