"""The job's finish task compacts the deployment's availability log (real Airflow, dag.test, local backend):
the repeats older than a few hours go, what a decision reads stays, and the job's own events are kept."""
from __future__ import annotations

import time

import pytest

from airflow_fixtures import airflow_db, airflow_threads_released, run_dag  # noqa: F401
from airflow_fixtures import FAST_SEGMENT_OPTIONS, backend_options, build_dag, protocol_command, ti_states

from airflow_spot.policy.observations import PoolEvent
from airflow_spot.storage.availability import AvailabilityLog
from airflow_spot.storage.object_store import open_store

pytestmark = pytest.mark.timeout(240)

POOL = "g5.xlarge@us-east-1z"  # a pool the local market does not offer: the job's decisions ignore it


def test_the_finish_task_compacts_the_deployment_log(airflow_db, tmp_path):  # noqa: F811
    log = AvailabilityLog(open_store(str(tmp_path / "availability")))
    day = time.time() - 86400
    log.extend([PoolEvent(POOL, "probe-up", day + i * 900, "other") for i in range(20)])  # 20 sightings, 5 h
    dag = build_dag("compacts", tmp_path, command=protocol_command("--step-seconds", "0.02"), total_steps=10,
                    steps_per_segment=10, backend_options=backend_options(tmp_path), max_preemptions=1, retries=0,
                    segment_options={**FAST_SEGMENT_OPTIONS, "availability_uri": str(tmp_path / "availability")})
    dr = run_dag(dag)
    assert ti_states(dr)["train.finish"] == ("success", 1)
    events = log.read()
    others = [e.at for e in events if e.job == "other"]
    assert others == [day, day + 19 * 900]  # the first and the newest of the run
    assert any(e.job != "other" and e.kind == "launched" for e in events)  # the job's own launch, just now
