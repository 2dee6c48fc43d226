"""The list page's rows (``airflow_spot.ui.jobs.job_rows``): a finished job's row from its summary XCom
is the row its store gives, without reading the store; the others are read a few at once, in order, and
one unreadable store costs only its own row."""
from __future__ import annotations

import io
import json
import shutil
import threading

import pytest

from airflow_spot.operators import accounting
from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.operators.segment import newest_usable_step
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout
from airflow_spot.ui import jobs as ui_jobs
from airflow_spot.storage.job_view import final_figures
from airflow_spot.ui.jobs import ROW_FIELDS, JobRef, job_row, job_rows

T0 = 1_800_000_000.0
OFFER = {"instance_type": "g4dn.xlarge", "region": "us-east-1", "zone": "us-east-1a", "market": "spot",
         "price_per_hour": 0.2, "on_demand_price_per_hour": 0.526, "gpu_name": "T4", "gpu_count": 1,
         "gpu_memory_gib": 16.0, "relative_throughput": 0.4, "preemption_rate_per_hour": 0.1}


def finished_job(root, last_step: int = 200) -> tuple[str, dict]:
    """A 200-step job: segment 0 preempted at step 60 then done, segment 1 done; checkpoints up to
    ``last_step``. Returns its URI and the summary the finish task pushes (its fields the UI reads)."""
    uri = f"file://{root}"
    store = open_store(uri)
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": T0, "total_steps": 200}).encode())
    for aid, seg, resume, end, start, stop, outcome, kept, lost in (
        ("train.segment_000.try1", 0, 0, 100, T0, T0 + 400, "preempted", 60, 7),
        ("train.segment_000.try2", 0, 60, 100, T0 + 420, T0 + 700, "completed", 40, 0),
        ("train.segment_001.try1", 1, 100, 200, T0 + 700, T0 + 1200, "completed", 100, 0),
    ):
        AttemptLaunch(aid, seg, seg * 100, end, f"i-{aid[-4:]}", OFFER, start, start, False, 1,
                      aid.rsplit(".", 1)[0], resume_step=resume).write(store)
        LedgerStore(store).write(LedgerRow(
            attempt_id=aid, instance_id=f"i-{aid[-4:]}", instance_type="g4dn.xlarge", zone="us-east-1a",
            market="spot", price_per_hour=0.2, on_demand_price_per_hour=0.526, started_at=start, ended_at=stop,
            steps_done=kept, outcome=outcome, segment_index=seg, steps_lost=lost, step_seconds=5.0,
        ))
    cps = JobLayout(store).checkpoint_store(writer="train")
    for step in (60, 100, last_step):
        cps.save(step, lambda f, s=step: f.write(io.BytesIO(b"x" * (100 + s)).getvalue()))
    latest = newest_usable_step(store)
    summary = {**accounting.summarize(store, now=T0 + 2000), "job_uri": uri, "total_steps": 200,
               "latest_step": latest, "completed": latest is not None and latest >= 200}
    store.put_bytes(JobLayout.SUMMARY_KEY, json.dumps(summary).encode())
    return uri, summary


def ref(uri: str, summary: dict | None = None, run_state: str = "success", run_id: str = "r") -> JobRef:
    return JobRef("dag", run_id, uri, None, run_state, "local", summary)


def test_a_finished_jobs_row_from_its_summary_is_the_row_its_store_gives(tmp_path):
    uri, summary = finished_job(tmp_path / "job")
    from_store = job_row(ref(uri), now=T0 + 3000)
    from_summary = job_row(ref(uri, summary), now=T0 + 3000)
    assert from_summary == from_store
    assert from_summary["state"] == "finished" and from_summary["progress"] == 1.0
    assert from_summary["preemptions"] == 1 and from_summary["current_step"] == 200
    # hand-computed: 400 + 280 + 500 s billed at $0.2/h
    assert from_summary["cost"] == pytest.approx(1180 / 3600 * 0.2, abs=1e-6)


def test_a_finished_jobs_row_needs_no_store(tmp_path):
    uri, summary = finished_job(tmp_path / "job")
    shutil.rmtree(tmp_path / "job")
    row = job_row(ref(uri, summary))
    assert "error" not in row and row["state"] == "finished" and row["total_steps"] == 200
    # read from the store, as every row used to be, the deleted job looks as if it never started
    assert job_row(ref(uri))["state"] == "not started" and job_row(ref(uri))["cost"] == 0


def test_a_job_that_stopped_short_is_incomplete_not_finished(tmp_path):
    uri, summary = finished_job(tmp_path / "job", last_step=150)
    assert summary["completed"] is False
    from_summary = job_row(ref(uri, summary, run_state="failed"))
    assert from_summary == job_row(ref(uri, run_state="failed"))
    assert from_summary["state"] == "incomplete" and from_summary["progress"] == 0.75

    from airflow_spot.ui.app import _state

    # the list then shows Airflow's word for the run, not "finished"
    assert _state(ref(uri, summary, run_state="failed"), from_summary["state"]) == "failed"


def test_a_summary_of_an_older_version_without_the_figures_reads_the_store(tmp_path):
    uri, summary = finished_job(tmp_path / "job")
    old = {k: v for k, v in summary.items() if k != "latest_step"}
    assert final_figures(old) is None
    assert job_row(ref(uri, old), now=T0 + 3000) == job_row(ref(uri, summary), now=T0 + 3000)


@pytest.mark.parametrize("bad", [{"cost": None}, {"preemptions": None}, {"total_steps": "200"},
                                 {"latest_step": "200"}, {"on_demand_cost": "1.0"}, {"preemptions": True}])
def test_a_malformed_summary_costs_only_the_store_read_it_was_to_save(tmp_path, bad):
    uri, summary = finished_job(tmp_path / "job")
    rows = job_rows([ref(uri, {**summary, **bad}, run_id="bad"), ref(uri, summary, run_id="good")], now=T0 + 3000)
    assert "error" not in rows[0] and rows[0]["state"] == "finished" and rows[0]["progress"] == 1.0
    assert {k: rows[0][k] for k in ROW_FIELDS} == {k: rows[1][k] for k in ROW_FIELDS}


def test_the_list_and_the_jobs_page_agree_when_the_store_holds_less_than_a_clean_finish(tmp_path):
    """The finish task's summary counts progress to the newest *usable* checkpoint and the ledger's rows;
    the store may also hold a newest checkpoint whose payload is gone and an attempt that only launched
    (its task was marked failed; finish terminated its instance). The page's headline is the summary's,
    as the list's row is: it does not bill the launched attempt on and on as if it still ran."""
    from airflow_spot.storage.job_view import JobView

    root = tmp_path / "job"
    uri, _ = finished_job(root, last_step=200)
    store = open_store(uri)
    payload = next(k for k in store.list("checkpoints/") if k.startswith("checkpoints/000000000200")
                   and not k.endswith("MANIFEST.json"))
    store.delete([payload])
    AttemptLaunch("train.segment_002.try1", 2, 200, 300, "i-late", OFFER, T0 + 1300, T0 + 1300, False, 1,
                  "train.segment_002", resume_step=200).write(store)
    latest = newest_usable_step(store)
    summary = {**accounting.summarize(store, now=T0 + 2000), "total_steps": 200, "latest_step": latest,
               "completed": False}
    store.put_bytes(JobLayout.SUMMARY_KEY, json.dumps(summary).encode())
    assert latest == 100
    for now in (T0 + 3000, T0 + 90_000):
        page = JobView(store).snapshot(now)
        row = job_row(ref(uri, summary, run_state="failed"), now=now)
        assert {k: page[k] for k in ROW_FIELDS} == {k: row[k] for k in ROW_FIELDS}
        assert row["current_step"] == 100 and row["progress"] == 0.5 and row["state"] == "incomplete"
        assert row["cost"] == pytest.approx(1180 / 3600 * 0.2, abs=1e-6)


def test_rows_come_in_the_jobs_order_and_an_unreadable_store_costs_only_its_row(tmp_path, monkeypatch):
    refs = []
    for i in range(7):
        uri, summary = finished_job(tmp_path / f"job{i}")
        refs.append(ref(uri, None if i % 2 else summary, run_id=f"r{i}"))
    refs.insert(3, ref("nope://bucket/job", run_id="gone"))  # a scheme no store has
    readers: set[str] = set()
    opened = ui_jobs.open_view

    def counting(job, hooks=None):
        readers.add(threading.current_thread().name)
        return opened(job, hooks)

    monkeypatch.setattr(ui_jobs, "open_view", counting)
    rows = job_rows(refs, now=T0 + 3000)
    assert [r["run_id"] for r in rows] == [j.run_id for j in refs]
    assert "store not readable" in rows[3]["error"]
    assert all("error" not in r for i, r in enumerate(rows) if i != 3)
    assert [r["state"] for i, r in enumerate(rows) if i != 3] == ["finished"] * 7
    # only the jobs without a summary were read, and not one after another on the caller's thread
    assert len(readers) > 1 and all(n.startswith("spot-ui-list") for n in readers)
    assert {k: rows[0][k] for k in ROW_FIELDS} == {k: rows[1][k] for k in ROW_FIELDS}


def test_the_list_reuses_one_hook_per_connection(tmp_path, monkeypatch):
    from airflow_spot.hooks import spot

    made = []
    real = spot.SpotHook

    class Counting(real):
        def __init__(self, *a, **kw):
            made.append(kw.get("aws_conn_id"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(spot, "SpotHook", Counting)
    refs = [ref(finished_job(tmp_path / f"job{i}")[0], run_id=f"r{i}") for i in range(6)]
    job_rows(refs, now=T0 + 3000)
    assert made == [None]
