"""``airflow-spot reap --backend ec2``: terminates tagged instances whose DAG run is finished or gone (states
read from a real Airflow metadata DB), leaves those of a running DAG run, and lists only on ``--dry-run``."""
from __future__ import annotations

import json
from datetime import datetime

import pytest
from airflow_fixtures import airflow_db, run_dag  # noqa: F401

from airflow_spot.backends.base import InstanceState, LaunchSpec, launch_token
from airflow_spot.cli import main
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.testing import moto_ec2

OPTIONS = json.dumps({"regions": ["us-east-1"], "image_id": "ami-12345678"})


@pytest.fixture(scope="module")
def endpoint():
    with moto_ec2.moto_ec2() as url:
        yield url


@pytest.fixture
def runs(airflow_db):  # noqa: F811
    """A finished DAG run (run by dag.test) and a running one (a row in the same DB)."""
    from airflow.models.dagrun import DagRun
    from airflow.sdk import DAG
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunType

    with DAG("reap_dag", schedule=None, start_date=datetime(2024, 1, 1), catchup=False) as dag:
        from airflow.providers.standard.operators.empty import EmptyOperator

        EmptyOperator(task_id="noop")
    finished = run_dag(dag)
    with create_session() as session:
        template = session.get(DagRun, finished.id)
        running = DagRun(dag_id="reap_dag", run_id="still_running", run_type=DagRunType.MANUAL,
                         state=DagRunState.RUNNING, logical_date=None, run_after=template.run_after)
        running.dag_version_id = getattr(template, "dag_version_id", None)
        running.bundle_version = getattr(template, "bundle_version", None)
        session.add(running)
    return finished.run_id, "still_running"


def launch(hook, run_id: str):
    o = Offer("g5.xlarge", "us-east-1", "us-east-1a", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
    return hook.get_backend().launch(LaunchSpec(
        offer=o, job_uri=f"s3://b/{run_id}", idempotency_token=launch_token(run_id),
        tags={"airflow-spot:dag": "reap_dag", "airflow-spot:run": run_id, "airflow-spot:job": "train"}))


def test_reap_terminates_instances_of_finished_or_deleted_runs_only(endpoint, runs, capsys):
    from airflow_spot.hooks.spot import SpotHook

    finished_run, running_run = runs
    moto_ec2.reset(endpoint)  # moto's state is per process: no instances of other test modules
    hook = SpotHook(backend="ec2", backend_options=json.loads(OPTIONS))
    done, live, orphan = launch(hook, finished_run), launch(hook, running_run), launch(hook, "deleted_run")

    assert main(["reap", "--backend", "ec2", "--backend-options", OPTIONS, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert done.instance_id in out and orphan.instance_id in out and live.instance_id not in out
    assert "dry run: 2 instance(s) would be terminated" in out

    assert main(["reap", "--backend", "ec2", "--backend-options", OPTIONS]) == 0
    assert "terminated 2 instance(s)" in capsys.readouterr().out
    seen = hook.get_backend().describe([done.instance_id, live.instance_id, orphan.instance_id])
    assert seen[live.instance_id].state is InstanceState.RUNNING
    assert seen[done.instance_id].state is seen[orphan.instance_id].state is InstanceState.TERMINATED

    # --runs any reaps the running run's instance too
    assert main(["reap", "--backend", "ec2", "--backend-options", OPTIONS, "--runs", "any"]) == 0
    assert "terminated 1 instance(s)" in capsys.readouterr().out


def test_reap_with_a_missing_connection_says_so(endpoint, capsys):
    argv = ["reap", "--backend", "ec2", "--backend-options", OPTIONS, "--aws-conn-id", "nope", "--runs", "any"]
    assert main(argv) == 2
    assert "'nope' is not defined" in capsys.readouterr().err
