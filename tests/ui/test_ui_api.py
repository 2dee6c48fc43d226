"""The Spot Training plugin inside Airflow's real API app: every route with and without a token, and what
the JSON says about a job whose store holds real protocol objects (launch records, ledger rows, a
heartbeat, committed checkpoints) and whose DAG run pushed the XComs a segment and the finish task push."""
from __future__ import annotations

import io
import json
import math
import os
import time
from datetime import datetime

import pytest
from airflow_fixtures import airflow_db, run_dag  # noqa: F401

from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.policy.offers import GpuRequest
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import Heartbeat, JobLayout

DAG_ID = "ui_api_job"
T0 = 1_800_000_000.0
OFFER = {
    "instance_type": "g4dn.xlarge", "region": "us-east-1", "zone": "us-east-1a", "market": "spot",
    "price_per_hour": 0.2, "on_demand_price_per_hour": 0.526, "gpu_name": "T4", "gpu_count": 1,
    "gpu_memory_gib": 16.0, "relative_throughput": 0.4, "preemption_rate_per_hour": 0.1,
}


def seed_store(root) -> str:
    """A job of 300 steps: segment 0 preempted at step 60 then done, segment 1 running at step 150."""
    uri = f"file://{root}"
    store = open_store(uri)
    layout = JobLayout(store)
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({
        "started_at": T0, "deadline_committed": False, "gpus": GpuRequest(count=1, min_memory_gib=16).to_dict(),
        "total_steps": 300, "backend": "local",
    }).encode())
    attempts = [  # id, segment, resume, end, start, end time, outcome, kept, lost
        ("train.segment_000.try1", 0, 0, 100, T0, T0 + 400, "preempted", 60, 7),
        ("train.segment_000.try2", 0, 60, 100, T0 + 420, T0 + 700, "completed", 40, 0),
        ("train.segment_001.try1", 1, 100, 200, T0 + 700, None, None, None, None),
    ]
    for aid, seg, resume, end, start, stop, outcome, kept, lost in attempts:
        AttemptLaunch(aid, seg, seg * 100, end, f"i-{aid[-4:]}", OFFER, start, start, False, 1, aid.rsplit(".", 1)[0],
                      resume_step=resume).write(store)
        if outcome:
            LedgerStore(store).write(LedgerRow(
                attempt_id=aid, instance_id=f"i-{aid[-4:]}", instance_type="g4dn.xlarge", zone="us-east-1a",
                market="spot", price_per_hour=0.2, on_demand_price_per_hour=0.526, started_at=start, ended_at=stop,
                steps_done=kept, outcome=outcome, segment_index=seg, steps_lost=lost, step_seconds=5.0,
            ))
    layout.write_heartbeat(Heartbeat(attempt_id="train.segment_001.try1", step=150, time=time.time(),
                                     step_time_ewma=5.0, last_committed_step=140))
    cps = layout.checkpoint_store(writer="train.segment_001.try1")
    for step in (60, 100, 140):
        cps.save(step, lambda f, s=step: f.write(io.BytesIO(b"x" * (1000 + s)).getvalue()))
    return uri


@pytest.fixture(scope="module")
def client(airflow_db, tmp_path_factory):  # noqa: F811
    from airflow.sdk import DAG, task
    from fastapi.testclient import TestClient

    uri = seed_store(tmp_path_factory.mktemp("job"))
    with DAG(DAG_ID, schedule=None, start_date=datetime(2024, 1, 1)) as dag:
        @task(task_id="train.segment_001")
        def segment(**context):  # pushes what SpotAttemptLink.persist pushes when an attempt starts
            from airflow_spot.links.attempt import SpotAttemptLink

            SpotAttemptLink.persist(context, uri, "train.segment_001.try1", None)

        segment()
    dag_run = run_dag(dag)
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success"

    from airflow.api_fastapi.app import create_app, get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    app = create_app("core")
    c = TestClient(app)
    c.token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="tester", role="admin"))
    c.run_id = dag_run.run_id
    c.uri = uri
    return c


def routes(run_id: str) -> list[str]:
    return ["/spot/", "/spot/api/jobs", f"/spot/api/jobs/{DAG_ID}/{run_id}", f"/spot/jobs/{DAG_ID}/{run_id}"]


def test_every_route_refuses_a_request_without_a_token(client):
    for route in routes(client.run_id) + ["/spot/jobs", "/spot/api/jobs/nope/nope"]:
        assert client.get(route).status_code == 401, route
        # Airflow answers a malformed token with 403 (it was read, and refused)
        assert client.get(route, headers={"Authorization": "Bearer not-a-token"}).status_code in (401, 403), route


def test_no_unauthenticated_schema_or_docs_are_served(client):
    for route in ("/spot/docs", "/spot/redoc", "/spot/openapi.json"):
        assert client.get(route).status_code in (401, 404), route


def test_every_route_answers_with_a_token(client):
    auth = {"Authorization": f"Bearer {client.token}"}
    for route in routes(client.run_id):
        r = client.get(route, headers=auth)
        assert r.status_code == 200, (route, r.text[:300])
    assert client.get("/spot/api/jobs/nope/nope", headers=auth).status_code == 404


def test_the_job_list_finds_the_job_through_its_xcom(client):
    jobs = client.get("/spot/api/jobs", headers={"Authorization": f"Bearer {client.token}"}).json()
    job = next(j for j in jobs if j["dag_id"] == DAG_ID)
    assert job["run_id"] == client.run_id and job["job_uri"] == client.uri
    # the store still shows a running attempt, but Airflow says the run is over: Airflow's word wins
    assert job["state"] == "success"
    assert job["progress"] == pytest.approx(150 / 300)
    assert job["preemptions"] == 1
    assert job["cost"] > 0


def test_one_job_has_timeline_checkpoints_totals_estimate_and_offers(client):
    auth = {"Authorization": f"Bearer {client.token}"}
    j = client.get(f"/spot/api/jobs/{DAG_ID}/{client.run_id}", headers=auth).json()
    outcomes = [(a["attempt_id"], a["outcome"], a["preemption"]) for a in j["attempts"]]
    assert outcomes == [
        ("train.segment_000.try1", "preempted", True),
        ("train.segment_000.try2", "completed", False),
        ("train.segment_001.try1", "running", False),
    ]
    assert j["attempts"][0]["steps_lost"] == 7 and j["attempts"][0]["steps_done"] == 60
    assert j["attempts"][2]["steps_done"] == 50  # heartbeat at 150, resumed at 100
    # billed seconds: the ledger rows' (400 s, 280 s), and the running attempt's so far (since T0 + 700)
    assert [a["billed_seconds"] for a in j["attempts"][:2]] == [400, 280]
    assert j["attempts"][2]["billed_seconds"] >= time.time() - (T0 + 700) - 60
    assert j["unreadable"] == [] and j["broken_checkpoints"] == [] and j["store_note"] is None
    assert [c["step"] for c in j["checkpoints"]] == [60, 100, 140]
    assert all(c["size"] > 1000 for c in j["checkpoints"])
    # ledger: 400 s + 280 s at $0.2/h, plus the running attempt billed from T0+700 until now
    finished = (400 + 280) / 3600 * 0.2
    assert j["cost"] > finished
    assert j["on_demand_cost"] > 0 and j["savings"] == pytest.approx(j["on_demand_cost"] - j["cost"])
    est = j["estimate"]
    assert est["remaining_steps"] == 150 and est["step_seconds"] == pytest.approx(5.0)
    assert est["remaining_seconds"] >= 150 * 5.0 and est["remaining_cost"] > 0
    assert j["series"] and j["series"][-1]["step"] == 140
    assert j["offers"], j["offers_note"]
    costs = [o["expected_cost"] for o in j["offers"]]
    assert costs == sorted(costs) and all(o["gpu_memory_gib"] >= 16 for o in j["offers"])


def test_the_page_shows_segments_preemptions_and_savings(client):
    html = client.get(f"/spot/jobs/{DAG_ID}/{client.run_id}", headers={"Authorization": f"Bearer {client.token}"}).text
    assert html.count('class="attempt ') == 3
    assert "preemption" in html and "savings" in html and "<svg" in html
    assert 'http-equiv="refresh"' not in html  # the run is over: no reloading


def test_a_running_job_page_reloads_itself_and_a_finished_one_does_not():
    from airflow_spot.ui.page import job_page

    snap = {"state": "running", "attempts": [], "checkpoints": [], "series": []}
    assert 'http-equiv="refresh"' in job_page("d", "r", snap, [])
    assert 'http-equiv="refresh"' not in job_page("d", "r", {**snap, "state": "finished"}, [])


def test_the_cost_card_shows_the_checkpoint_transfers_in_it():
    from airflow_spot.ui.page import job_page

    snap = {"state": "finished", "attempts": [], "checkpoints": [], "series": [], "cost": 12.5}
    assert 'id=transfers' not in job_page("d", "r", snap, [])
    assert "of which checkpoint transfers $1.2500" in job_page("d", "r", {**snap, "transfer_dollars": 1.25}, [])
    assert 'id=idle' not in job_page("d", "r", snap, [])
    assert "of which warm instances idle after their last attempt $0.0300" in job_page(
        "d", "r", {**snap, "idle_dollars": 0.03}, [])


def test_each_attempt_shows_the_price_it_paid():
    """A finished attempt's row carries the price in effect over its run (the ledger's), which may differ
    from the price it was launched at; the page shows it beside the cost."""
    from airflow_spot.ui.page import job_page

    attempts = [{"attempt_id": "a.try1", "outcome": "completed", "market": "spot", "price_per_hour": 0.3125,
                 "cost": 0.3125}, {"attempt_id": "a.try2", "outcome": "running", "market": "spot"}]
    html = job_page("d", "r", {"state": "running", "attempts": attempts, "checkpoints": [], "series": []}, [])
    assert "<th title='a finished spot attempt: the price in effect over its run'>price</th>" in html
    assert "<td class=n>$0.3125/h</td>" in html and "<td class=n>–</td><td>" in html


# ------------------------------------------------------------------ before the job's first attempt
PRESTART_DAG = "ui_api_not_started"
PROFILE = {"T4": 0.5}  # seconds per step the job declares it measured on a T4
PRESTART_STEPS = 36_000


@pytest.fixture(scope="module")
def queued_run(client, tmp_path_factory):
    """A DAG with a SpotTraining job, serialized into the DB, and a run of it triggered through Airflow's
    REST API: queued (the DAG is paused, no scheduler), so no task has run and the job has no XCom and
    no store."""
    from airflow_fixtures import build_dag
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    from airflow_spot.policy.offers import GpuRequest

    root = tmp_path_factory.mktemp("prestart")
    dag = build_dag(PRESTART_DAG, root, command=["python", "train.py"], total_steps=PRESTART_STEPS,
                    steps_per_segment=12_000, gpus=GpuRequest(count=1, min_memory_gib=16),
                    segment_options={"step_profile": PROFILE, "poll_interval": 0.2})
    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(dag_folder=os.devnull)
    bag.bag_dag(dag)
    sync_bag_to_db(bag, "dags-folder", None)
    r = client.post(f"/api/v2/dags/{PRESTART_DAG}/dagRuns", json={"logical_date": None},
                    headers={"Authorization": f"Bearer {client.token}"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "queued"
    return r.json()["dag_run_id"]


def test_a_queued_job_shows_the_offline_ranking_for_its_gpu_request(client, queued_run):
    from airflow_spot.market import get_market
    from airflow_spot.market.throughput import instance_throughput
    from airflow_spot.policy.estimate import PRIOR_RELATIVE_ERROR

    auth = {"Authorization": f"Bearer {client.token}"}
    assert client.get(f"/spot/api/jobs/{PRESTART_DAG}/{queued_run}").status_code == 401
    j = client.get(f"/spot/api/jobs/{PRESTART_DAG}/{queued_run}", headers=auth).json()
    assert j["state"] == "not started" and j["run_state"] == "queued" and j["attempts"] == []
    assert j["total_steps"] == PRESTART_STEPS and j["gpus"]["min_memory_gib"] == 16
    ranking = j["ranking"]
    assert ranking["steps"] == PRESTART_STEPS and ranking["step_profile"] == PROFILE
    rows = ranking["offers"]
    assert rows and all(o["gpu_memory_gib"] >= 16 for o in rows)
    costs = [o["expected_cost"] for o in rows]
    assert costs == sorted(costs) and rows[0]["relative_cost"] == 1.0
    assert ranking["top_uncertain"] == (rows[1]["relative_cost"] - 1 < max(rows[0]["uncertainty"],
                                                                          rows[1]["uncertainty"]))
    # hand-computed from the market the page asks: the declared T4 step time scaled by throughput, priced
    # with the preemption overhead; T4 offers carry only the profile's noise, others the catalog's too
    market = get_market("local")
    for o in rows:
        x = instance_throughput(o["gpu_name"], o["gpu_count"])
        assert o["step_seconds"] == pytest.approx(0.5 * instance_throughput("T4", 1) / x, rel=1e-4)
        assert o["hours"] == pytest.approx(PRESTART_STEPS * o["step_seconds"] / 3600, rel=1e-4)
        expected = o["hours"] * o["price_per_hour"] * (1 + o["preemption_rate_per_hour"] * 600 / 3600)
        assert o["expected_cost"] == pytest.approx(expected, rel=1e-3)
        on_t4 = abs(x - instance_throughput("T4", 1)) < 1e-9
        assert o["uncertainty"] == pytest.approx(0.05 if on_t4 else math.hypot(0.05, PRIOR_RELATIVE_ERROR), abs=1e-4)
    # the first offer is the cheapest of every offer the market has for the request (not only the shown ones)
    from airflow_spot.policy.offers import GpuRequest

    everything = market.offers(GpuRequest(count=1, min_memory_gib=16))
    cheapest = min(0.5 * instance_throughput("T4", 1) / o.relative_throughput * PRESTART_STEPS / 3600
                   * o.price_per_hour * (1 + o.preemption_rate_per_hour * 600 / 3600) for o in everything)
    assert rows[0]["expected_cost"] == pytest.approx(cheapest, rel=1e-3)


def test_the_queued_jobs_page_shows_the_ranking_with_its_uncertainty(client, queued_run):
    auth = {"Authorization": f"Bearer {client.token}"}
    html = client.get(f"/spot/jobs/{PRESTART_DAG}/{queued_run}", headers=auth).text
    rows = client.get(f"/spot/api/jobs/{PRESTART_DAG}/{queued_run}", headers=auth).json()["ranking"]["offers"]
    assert "Ranking of instance types before the job starts" in html
    assert html.count("<tr class=ranked>") == len(rows) >= 2
    for o in rows:  # each row's instance type and its stated uncertainty band
        assert o["instance_type"] in html and f"±{100 * o['uncertainty']:.0f} %" in html
    # the page says so when the first two are closer than their stated uncertainty
    close = rows[1]["relative_cost"] - 1 < max(rows[0]["uncertainty"], rows[1]["uncertainty"])
    assert ("id=ranking-close" in html) == close
    assert "declared step time T4 0.5 s" in html
    assert 'http-equiv="refresh"' in html  # queued: the page reloads until the job starts


def test_a_job_without_a_declared_profile_is_ranked_by_cost_per_unit_of_work():
    from airflow_spot.market import get_market
    from airflow_spot.policy.estimate import PRIOR_RELATIVE_ERROR
    from airflow_spot.ui.prestart import ranking

    r = ranking({"gpus": GpuRequest(count=1, min_memory_gib=16).to_dict(), "total_steps": 1000}, get_market("local"))
    rows = r["offers"]
    assert rows and all(o["expected_cost"] is None and o["hours"] is None for o in rows)
    rel = [o["relative_cost"] for o in rows]
    assert rel[0] == 1.0 and rel == sorted(rel)
    assert all(o["uncertainty"] == pytest.approx(PRIOR_RELATIVE_ERROR) for o in rows)
    # the order is by price per unit of catalog throughput, preemption overhead included
    per_work = [o["price_per_hour"] / o["relative_throughput"] * (1 + o["preemption_rate_per_hour"] / 6)
                for o in rows]
    assert [p / per_work[0] for p in per_work] == pytest.approx(rel, rel=1e-3)


def test_a_run_of_a_dag_without_a_spot_job_is_not_found(client):
    auth = {"Authorization": f"Bearer {client.token}"}
    # the DAG of the started job exists, but this run does not
    assert client.get(f"/spot/api/jobs/{DAG_ID}/no-such-run", headers=auth).status_code == 404


@pytest.mark.parametrize("profile, message", [
    ({"TPU": 0.4}, "unknown GPU 'TPU'"), ({"T4": 0}, "must be seconds per step > 0"), ([0.4], "must be a dict"),
])
def test_a_bad_step_profile_fails_when_the_dag_is_parsed(tmp_path, profile, message):
    from airflow_fixtures import build_dag

    from airflow_spot.operators.validation import SpotTrainingConfigError

    with pytest.raises(SpotTrainingConfigError, match=message):
        build_dag("bad_profile", tmp_path, command=["python", "train.py"], total_steps=10, steps_per_segment=5,
                  segment_options={"step_profile": profile})


# ------------------------------------------------------------------ a finished job: its row from the summary XCom
FINISHED_DAG = "ui_api_finished"


def test_a_finished_jobs_row_comes_from_its_summary_xcom_even_with_its_store_gone(client, tmp_path):
    """A DAG run whose segment pushed its link and whose finish task then pushed the summary (as
    ``SpotTrainingFinishOperator`` does): ``find_jobs`` carries that summary, the list's row equals the
    row the store gives, and it stays when the store is deleted. A run whose newest XCom is a link (an
    attempt started after the summary: the run was cleared and goes on) is read from its store."""
    import shutil
    from dataclasses import replace

    from airflow.sdk import DAG, task
    from test_job_rows import finished_job

    from airflow_spot.ui.jobs import ROW_FIELDS, find_jobs, job_row

    uri, summary = finished_job(tmp_path / "job")
    summary["idle_dollars"] = 0.0125  # a warm instance billed after its last attempt: shown with the store gone
    with DAG(FINISHED_DAG, schedule=None, start_date=datetime(2024, 1, 1)) as dag:
        @task(task_id="train.segment_001")
        def segment(**context):
            from airflow_spot.links.attempt import SpotAttemptLink

            SpotAttemptLink.persist(context, uri, "train.segment_001.try1", None)

        @task(task_id="train.finish")
        def finish(**context):
            context["ti"].xcom_push(key="summary", value=summary)

        segment() >> finish()
    run = run_dag(dag)
    assert str(getattr(run.state, "value", run.state)) == "success"

    from airflow.utils.session import create_session

    with create_session() as session:
        ref = next(j for j in find_jobs(session, dag_id=FINISHED_DAG))
    assert ref.summary is not None and ref.summary["total_steps"] == 200
    from_store = {k: job_row(replace(ref, summary=None))[k] for k in ROW_FIELDS}

    auth = {"Authorization": f"Bearer {client.token}"}
    jobs = client.get("/spot/api/jobs", headers=auth).json()
    row = next(j for j in jobs if j["dag_id"] == FINISHED_DAG)
    assert {k: row[k] for k in ROW_FIELDS} == from_store and row["state"] == "finished"
    shutil.rmtree(tmp_path / "job")
    again = next(j for j in client.get("/spot/api/jobs", headers=auth).json() if j["dag_id"] == FINISHED_DAG)
    assert again == row and "error" not in again
    assert "ui_api_finished" in client.get("/spot/", headers=auth).text
    # the job's page too: the summary's figures (as the list's), and it says the store is gone
    j = client.get(f"/spot/api/jobs/{FINISHED_DAG}/{run.run_id}", headers=auth).json()
    assert {k: j[k] for k in ROW_FIELDS} == {k: row[k] for k in ROW_FIELDS}
    assert j["total_steps"] == 200 and j["cost"] > 0 and "gone or empty" in j["store_note"]
    html = client.get(f"/spot/jobs/{FINISHED_DAG}/{run.run_id}", headers=auth).text
    assert "id=store-note" in html and "200 / 200 steps" in html
    assert j["idle_dollars"] == 0.0125 and "of which warm instances idle" in html
    assert "has not recorded its GPU request yet" not in html

    # the run cleared and going on: a new attempt's link is newer than the summary, so the store is read
    with DAG(FINISHED_DAG + "_again", schedule=None, start_date=datetime(2024, 1, 1)) as dag2:
        @task(task_id="train.finish")
        def old_finish(**context):
            context["ti"].xcom_push(key="summary", value=summary)

        @task(task_id="train.segment_002")
        def later(**context):
            from airflow_spot.links.attempt import SpotAttemptLink

            SpotAttemptLink.persist(context, uri, "train.segment_002.try1", None)

        old_finish() >> later()
    run_dag(dag2)
    with create_session() as session:
        ref2 = next(j for j in find_jobs(session, dag_id=FINISHED_DAG + "_again"))
    assert ref2.summary is None


# ------------------------------------------------------------------ many segments per run
MANY_DAG = "ui_api_many_segments"


def test_runs_of_long_jobs_are_all_found_and_other_summaries_are_not_jobs(client, tmp_path):
    """Each segment task pushes its own link XCom (a 48 h job of 15 min segments has about 200), and a
    task of another operator may push a "summary" of its own after them: every run is still found, up to
    ``limit`` runs, each with its job's newest link."""
    from airflow.sdk import DAG, task
    from airflow.utils.session import create_session

    from airflow_spot.ui.jobs import find_jobs

    segments = 45  # more XComs per run than the 20 rows per run the list used to read
    with DAG(MANY_DAG, schedule=None, start_date=datetime(2024, 1, 1)) as dag:
        @task(task_id="train.segment")
        def segment(i: int, **context):
            from airflow_spot.links.attempt import SpotAttemptLink

            SpotAttemptLink.persist(context, f"file://{tmp_path}/{context['run_id']}", f"seg{i:03d}.try1", None)

        @task(task_id="evaluate")
        def evaluate(**context):  # another operator's "summary": not a job
            context["ti"].xcom_push(key="summary", value={"accuracy": 0.9})

        segment.expand(i=list(range(segments))) >> evaluate()
    run_ids = [run_dag(dag).run_id for _ in range(3)]
    with create_session() as session:
        found = find_jobs(session, dag_id=MANY_DAG, limit=3)
        assert [j.run_id for j in found] == run_ids[::-1]  # newest first
        assert all(j.job_uri == f"file://{tmp_path}/{j.run_id}" and j.summary is None for j in found)
        assert [j.run_id for j in find_jobs(session, dag_id=MANY_DAG, limit=2)] == run_ids[:0:-1]
        assert [j.run_id for j in find_jobs(session, dag_id=MANY_DAG, run_id=run_ids[0])] == run_ids[:1]


# ------------------------------------------------------------------ what QA found
def test_the_not_found_page_does_not_echo_the_request_as_markup(client):
    auth = {"Authorization": f"Bearer {client.token}"}
    r = client.get("/spot/jobs/%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E/r1", headers=auth)
    assert r.status_code == 404
    assert "<img" not in r.text and "&lt;img src=x onerror=alert(1)&gt;" in r.text


DAMAGED_DAG = "ui_api_damaged"


def test_a_malformed_ledger_row_and_a_broken_checkpoint_do_not_take_the_job_page_down(client, tmp_path):
    """One ledger row that does not decode and one checkpoint whose manifest is cut short: the page and
    the JSON answer 200 with what can be read, name the unreadable row and show the broken checkpoint."""
    from airflow.sdk import DAG, task
    from test_job_rows import finished_job

    uri, _ = finished_job(tmp_path / "job")
    store = open_store(uri)
    bad = "control/ledger/train.segment_001.try0.json"
    store.put_bytes(bad, b"{not json")
    JobLayout(store).checkpoint_store(writer="train").save(400, lambda f: f.write(b"x" * 500))
    manifest = next(k for k in store.list("checkpoints/") if k.startswith("checkpoints/000000000400-")
                    and k.endswith("/MANIFEST.json"))
    store.put_bytes(manifest, store.get_bytes(manifest)[:30])
    with DAG(DAMAGED_DAG, schedule=None, start_date=datetime(2024, 1, 1)) as dag:
        @task(task_id="train.segment_001")
        def segment(**context):
            from airflow_spot.links.attempt import SpotAttemptLink

            SpotAttemptLink.persist(context, uri, "train.segment_001.try1", None)

        segment()
    run = run_dag(dag)
    auth = {"Authorization": f"Bearer {client.token}"}
    r = client.get(f"/spot/api/jobs/{DAMAGED_DAG}/{run.run_id}", headers=auth)
    assert r.status_code == 200, r.text[:500]
    j = r.json()
    assert [u["key"] for u in j["unreadable"]] == [bad]
    assert len(j["attempts"]) == 3 and [c["step"] for c in j["checkpoints"]] == [60, 100, 200]
    assert [b["step"] for b in j["broken_checkpoints"]] == [400]
    html = client.get(f"/spot/jobs/{DAMAGED_DAG}/{run.run_id}", headers=auth)
    assert html.status_code == 200
    assert "id=unreadable" in html.text and bad in html.text and "<tr class=broken>" in html.text
    row = next(x for x in client.get("/spot/api/jobs", headers=auth).json() if x["dag_id"] == DAMAGED_DAG)
    assert bad in row["error"] and row["preemptions"] == 1


CAPPED_DAG = "ui_api_capped"


def test_the_list_says_older_jobs_are_not_shown_and_pages_to_them(client, tmp_path, monkeypatch):
    from airflow.sdk import DAG, task

    from airflow_spot.ui import jobs as ui_jobs

    with DAG(CAPPED_DAG, schedule=None, start_date=datetime(2024, 1, 1)) as dag:
        @task(task_id="train.segment_000")
        def segment(**context):
            from airflow_spot.links.attempt import SpotAttemptLink

            SpotAttemptLink.persist(context, f"file://{tmp_path}/{context['run_id']}", "s.try1", None)

        segment()
    runs = [run_dag(dag).run_id for _ in range(2)]
    auth = {"Authorization": f"Bearer {client.token}"}
    assert ui_jobs.LIST_LIMIT == 200
    r = client.get("/spot/api/jobs", headers=auth)
    assert r.headers["X-Spot-Jobs-Limit"] == "200" and r.headers["X-Spot-Jobs-More"] == "false"
    assert "id=jobs-more" not in client.get("/spot/", headers=auth).text

    monkeypatch.setattr(ui_jobs, "LIST_LIMIT", 1)
    r = client.get("/spot/api/jobs", params={"dag_id": CAPPED_DAG}, headers=auth)
    assert [j["run_id"] for j in r.json()] == runs[1:]
    assert r.headers["X-Spot-Jobs-More"] == "true" and r.headers["X-Spot-Jobs-Limit"] == "1"
    assert "offset=1" in r.headers["Link"] and 'rel="next"' in r.headers["Link"]
    older = client.get("/spot/api/jobs", params={"dag_id": CAPPED_DAG, "offset": 1}, headers=auth)
    assert [j["run_id"] for j in older.json()] == runs[:1] and older.headers["X-Spot-Jobs-More"] == "false"
    both = client.get("/spot/api/jobs", params={"dag_id": CAPPED_DAG, "limit": 5}, headers=auth)
    assert [j["run_id"] for j in both.json()] == runs[::-1]
    html = client.get("/spot/", headers=auth).text
    assert "Only the 1 newest jobs are shown: older jobs are not." in html and "offset=1" in html
    assert client.get("/spot/api/jobs", params={"limit": 100_000}, headers=auth).status_code == 422
