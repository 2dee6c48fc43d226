"""Airflow fixtures for tests that run DAGs with ``dag.test()``: a migrated sqlite metadata DB, and
helpers to build small spot training DAGs on the real local backend and inspect what they left behind.

Use: ``from airflow_fixtures import airflow_db, run_dag  # noqa: F401`` (tests/ is on sys.path through its conftest).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import datetime, timedelta
from pathlib import Path

import psutil
import pytest


@pytest.fixture(scope="session")
def airflow_db():
    """A fresh metadata DB in this session's AIRFLOW_HOME (about 3 s)."""
    home = os.environ["AIRFLOW_HOME"]
    os.makedirs(os.path.join(home, "dags"), exist_ok=True)
    from airflow.utils import db

    db.resetdb()
    yield home
    if f"airflow-spot-tests-{os.getpid()}" in home:  # only the home conftest made for us
        shutil.rmtree(home, ignore_errors=True)


def release_airflow_threads(timeout: float = 10.0) -> list[str]:
    """Stop the threads ``dag.test()`` leaves behind (the in-process execution API's event loop, task
    comms), so later tests that fork (tests/storage) get a thread-free process. Returns what is left."""
    import gc
    import threading
    import time

    from airflow.sdk.execution_time import supervisor

    supervisor.in_process_api_server.cache_clear()  # its transport's finalizer stops the loop thread
    deadline = time.monotonic() + timeout
    while threading.active_count() > 1 and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    return [t.name for t in threading.enumerate() if t is not threading.main_thread()]


@pytest.fixture(scope="module", autouse=True)
def airflow_threads_released():
    """Module teardown for modules that run DAGs (import it with ``airflow_db``)."""
    yield
    if "airflow.sdk.execution_time.supervisor" in sys.modules:
        release_airflow_threads()


def run_dag(dag, **kwargs):
    """Serialise a DAG built in a test into the DB (NOTES.md) and run it with ``dag.test()``."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(dag_folder=os.devnull)
    bag.bag_dag(dag)
    sync_bag_to_db(bag, "dags-folder", None)
    return dag.test(**kwargs)


PROTOCOL_SCRIPT = str(Path(__file__).parent / "operators" / "protocol_script.py")


def protocol_command(*extra: str) -> list[str]:
    return [sys.executable, PROTOCOL_SCRIPT, *extra]


def backend_options(root: Path, schedule: list[float | None] | None = None) -> dict:
    opts: dict = {"state_dir": str(root / "instances"), "notice_window_seconds": 1.0, "terminate_grace_seconds": 3.0}
    if schedule:
        opts["preemption"] = {"mode": "schedule", "after_seconds": schedule}
    return opts


FAST_SEGMENT_OPTIONS = {"poll_interval": 0.2, "startup_timeout": 60.0, "heartbeat_timeout": 30.0}


def build_dag(dag_id: str, root: Path, **training_kwargs):
    from airflow.sdk import DAG

    from airflow_spot.operators.training import SpotTraining

    kwargs = dict(
        task_id="train",
        checkpoint_uri=f"file://{root}/jobs/{{{{ run_id }}}}",
        backend="local",
        retry_delay=timedelta(seconds=0.5),
        segment_options=FAST_SEGMENT_OPTIONS,
    )
    kwargs.update(training_kwargs)
    with DAG(dag_id, schedule=None, start_date=datetime(2024, 1, 1), catchup=False) as dag:
        SpotTraining(**kwargs)
    return dag


def job_store(root: Path, run_id: str):
    from airflow_spot.storage.object_store import open_store

    return open_store(f"file://{root}/jobs/{run_id}")


def summary(root: Path, run_id: str) -> dict:
    from airflow_spot.operators.training import SUMMARY_KEY

    return json.loads(job_store(root, run_id).get_bytes(SUMMARY_KEY))


def ti_states(dag_run) -> dict[str, tuple[str, int]]:
    """task id -> (state, try_number) of the run's task instances."""
    return {
        ti.task_id: (str(getattr(ti.state, "value", ti.state)), ti.try_number) for ti in dag_run.get_task_instances()
    }


def leftover_processes(root: Path) -> list[str]:
    """Instances of the local backend that are not terminated, or whose processes still exist."""
    from airflow_spot.backends.base import InstanceState, get_backend
    from airflow_spot.backends.local_state import group_alive

    backend = get_backend("local", state_dir=str(root / "instances"))
    problems = []
    for info in backend.list_instances():
        record = backend.record(info.instance_id)
        if not InstanceState(record.info.state).is_terminal():
            problems.append(f"{info.instance_id} is {record.info.state}")
        if group_alive(record.pgid):
            problems.append(f"{info.instance_id}: process group {record.pgid} still has processes")
        if record.supervisor is not None and psutil.pid_exists(record.supervisor.pid):
            try:
                if psutil.Process(record.supervisor.pid).status() != psutil.STATUS_ZOMBIE:
                    problems.append(f"{info.instance_id}: preemption supervisor {record.supervisor.pid} alive")
            except psutil.NoSuchProcess:
                pass
    return problems


def instance_count(root: Path) -> int:
    base = root / "instances" / "instances"
    return len(os.listdir(base)) if base.is_dir() else 0


def xcom_value(dag_run, task_id: str, key: str = "return_value"):
    """The XCom a task of ``dag_run`` pushed under ``key`` (None when absent)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    query = XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids=task_id, key=key, limit=1)
    with create_session() as session:
        row = session.scalars(query).first()
        return None if row is None else XComModel.deserialize_value(row)
