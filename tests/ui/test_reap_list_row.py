"""The Spot Training list's row of a finished job follows what ``airflow-spot reap`` billed after the run.

The row comes from the finish task's summary XCom (no store read per finished job). Reap bills attempts
nobody accounted for on the instances of finished runs and refreshes the summary in the job's store; it
now rewrites that XCom too, so the list and the job's page show one cost.

Real pieces: a DAG run in Airflow's metadata DB (its finish task pushed the summary XCom), the segment
operator launching on the local backend (an instance is a process group running the agent, the
preemption injector reclaims it), the ``reap`` command reading the run's state from the DB. Faked only:
the task instance a worker would hand the operator.
"""
from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow_fixtures import airflow_db, run_dag  # noqa: F401

from airflow_spot.backends.base import InstanceState, get_backend
from airflow_spot.operators import accounting
from airflow_spot.storage.job_view import JobView
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout

pytestmark = pytest.mark.timeout(180)

PROTOCOL_SCRIPT = str(Path(__file__).resolve().parents[1] / "operators" / "protocol_script.py")
DAG_ID = "reap_list_row"


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_reaps_bills_reach_the_list_row_of_a_finished_job(airflow_db, tmp_path, capsys):  # noqa: F811
    """A run finished (its summary pushed and stored) while one attempt of it was nobody's to bill (its
    task died after the launch). Its spot instance is then reclaimed; ``reap`` (the run is over) bills that
    attempt and refreshes the stored summary. The list's row (``find_jobs`` + ``job_row``, from the XCom)
    must show the cost the job's page shows, not the cost before reap's bill."""
    from airflow.sdk import DAG, task
    from airflow.sdk.exceptions import TaskDeferred
    from airflow.utils.session import create_session

    from airflow_spot.cli import main
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.ui.jobs import ROW_FIELDS, find_jobs, job_row

    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": time.time() - 5, "total_steps": 1000}).encode())
    summary = {**accounting.summarize(store, now=time.time()), "job_uri": uri, "total_steps": 1000}
    store.put_bytes(JobLayout.SUMMARY_KEY, json.dumps(summary).encode())
    with DAG(DAG_ID, schedule=None, start_date=datetime(2024, 1, 1)) as dag:
        @task(task_id="train.finish")
        def finish(**context):
            context["ti"].xcom_push(key="summary", value=summary)

        finish()
    dag_run = run_dag(dag)
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success"

    options = {"state_dir": str(tmp_path / "instances"), "notice_window_seconds": 1.0,
               "terminate_grace_seconds": 3.0, "preemption": {"mode": "schedule", "after_seconds": [3.0]}}
    with DAG(DAG_ID, schedule=None, start_date=datetime(2024, 1, 1)):  # the run's segment, as its worker has it
        op = SpotSegmentOperator(
            task_id="segment_000", command=[sys.executable, PROTOCOL_SCRIPT, "--step-seconds", "0.1"],
            checkpoint_uri=uri, start_step=0, end_step=1000, total_steps=1000, job_name="train",
            backend="local", backend_options=options, deferrable=True)
    now = time.time()
    ti = SimpleNamespace(try_number=1, id=None, max_tries=op.retries, dag_id=DAG_ID, run_id=dag_run.run_id,
                         xcom_push=lambda key, value: None)
    context = {"ti": ti, "run_id": dag_run.run_id,
               "dag_run": SimpleNamespace(start_date=datetime.fromtimestamp(now - 5, timezone.utc))}
    backend = get_backend("local", **options)
    try:
        with pytest.raises(TaskDeferred) as deferred:  # the try launches, defers, and its worker dies
            op.execute(context)
        attempt_id, instance_id = deferred.value.trigger.attempt_id, deferred.value.trigger.instance_id
        _wait(lambda: InstanceState(backend.describe([instance_id])[instance_id].state).is_terminal(), 60,
              "the instance's reclaim")
        assert LedgerStore(store).read(attempt_id) is None

        capsys.readouterr()
        assert main(["reap", "--backend-options", json.dumps(options), "--runs", "finished"]) == 0
        out = capsys.readouterr().out
        assert LedgerStore(store).read(attempt_id) is not None, out
        assert f"list's row of {DAG_ID} / {dag_run.run_id} now shows them" in out, out
    finally:
        backend.terminate([i.instance_id for i in backend.list_instances({})
                           if not InstanceState(i.state).is_terminal()])

    ledger_cost = JobView(store).totals(time.time())["cost"]
    assert ledger_cost > summary["cost"]
    with create_session() as session:
        ref = next(j for j in find_jobs(session, dag_id=DAG_ID))
    assert ref.summary is not None, "the run's row should still come from its summary XCom"
    row = job_row(ref)
    assert row["cost"] == pytest.approx(ledger_cost, abs=1e-6), (
        f"the list's row says ${row['cost']:.4f}, the job's ledger ${ledger_cost:.4f}")
    assert set(ROW_FIELDS) <= set(row)
    assert json.loads(store.get_bytes(JobLayout.SUMMARY_KEY))["cost"] == pytest.approx(row["cost"], abs=1e-6)
