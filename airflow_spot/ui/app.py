"""The Spot Training FastAPI app, mounted under ``/spot`` in Airflow's API server.

Routes (every one requires Airflow authentication: ``requires_authenticated()`` on the whole app, so a
request without a valid token — ``Authorization: Bearer`` or the UI's ``_token`` cookie — gets 401):

* ``GET /spot/`` and ``GET /spot/jobs``: the list of jobs (HTML);
* ``GET /spot/jobs/{dag_id}/{run_id}``: one job's page (HTML);
* ``GET /spot/api/jobs``: the list as JSON (DAG, run, state, progress, cost, savings);
* ``GET /spot/api/jobs/{dag_id}/{run_id}``: one job as JSON (everything the page shows).

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

from airflow_spot.ui import page
from airflow_spot.ui.jobs import JobRef, find_jobs, job_row, open_view

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


def job_detail(job: JobRef) -> dict[str, Any]:
    snap = open_view(job).snapshot(time.time())
    snap["state"] = _state(job, snap["state"])
    offers, why = cheapest_offers(job, snap)
    return {"dag_id": job.dag_id, "run_id": job.run_id, "run_state": job.run_state, **snap,
            "offers": offers, "offers_note": why}


def _one(session, dag_id: str, run_id: str) -> JobRef:
    jobs = find_jobs(session, dag_id=dag_id, run_id=run_id, limit=1)
    if not jobs:
        raise HTTPException(404, f"no spot training job in DAG {dag_id!r} run {run_id!r} (none has started yet?)")
    return jobs[0]


def _rows(session) -> list[dict[str, Any]]:
    rows = []
    for job in find_jobs(session):
        row = job_row(job)
        row["state"] = _state(job, str(row.get("state")))
        rows.append(row)
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
        return job_detail(_one(session, dag_id, run_id))

    @app.get("/", response_class=HTMLResponse)
    def index(session: SessionDep) -> str:
        return page.jobs_page(_rows(session))

    @app.get("/jobs", include_in_schema=False)
    def jobs_redirect() -> RedirectResponse:
        return RedirectResponse("/spot/")

    @app.get("/jobs/{dag_id}/{run_id}", response_class=HTMLResponse)
    def job_html(dag_id: str, run_id: str, session: SessionDep) -> str:
        try:
            detail = job_detail(_one(session, dag_id, run_id))
        except HTTPException as exc:
            return HTMLResponse(page.jobs_page([]).replace("No spot training job has started yet.", exc.detail),
                                status_code=exc.status_code)
        return page.job_page(dag_id, run_id, detail, detail["offers"], detail["offers_note"])

    return app


app = create_app()
