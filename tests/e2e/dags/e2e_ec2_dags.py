"""Spot training DAGs on the ``ec2`` backend for the end-to-end tests (tests/e2e/test_e2e_ec2.py).

EC2 is moto's server, started by the test module in the pytest process and reached through the Airflow
connection ``aws_default`` that the test creates over REST (with the server's ``endpoint_url``); the
instances are played by the test's data plane (:mod:`airflow_spot.testing.ec2_dataplane`), which also
decides when each one is reclaimed. So nothing here knows about moto: these are ordinary ec2 DAGs.

- ``e2e_ec2_demo``: the demo DAG (:func:`airflow_spot.demo.build_demo_dag`) on the ec2 backend, as
  ``airflow-spot demo --backend ec2 --moto`` builds it (its segments set to defer, as the others do); the
  test reclaims its first instances.
- ``e2e_ec2_fails``: the script raises at step 5 (exit 1) and the job allows no code retry.
- ``e2e_ec2_long``: one long segment, killed from outside (task or run marked failed over REST).
- ``e2e_ec2_worker``: two segments; the test SIGKILLs the Celery worker while ``RunInstances`` of the
  first try is in flight (the instance exists, the worker never hears of it). The agent's idle timeout
  outlasts the scheduler's heartbeat timeout, so the next try finds the instance still waiting.

Checkpoints live under ``$SPOT_E2E_ROOT/jobs/<dag>/<run>`` (``file://``: the played instances are local
processes), like the local-backend e2e DAGs, so the same test helpers read them.
"""
from __future__ import annotations

import os
import sys
import tempfile
from datetime import datetime, timedelta

from airflow.sdk import DAG

from airflow_spot.demo import NOTICE_WINDOW_SECONDS, SEGMENT_OPTIONS, build_demo_dag, train_command
from airflow_spot.operators.training import SpotTraining
from airflow_spot.policy.offers import GpuRequest

ROOT = os.environ.get("SPOT_E2E_ROOT") or os.path.join(tempfile.gettempdir(), "airflow-spot-e2e")
JOB_DIR = ROOT + "/jobs/{{ dag.dag_id }}/{{ run_id }}"
FINAL_WEIGHTS = JOB_DIR + "/final_weights.pt"
REGION = "us-east-1"
IMAGE_ID = "ami-12345678"

#: what ``airflow-spot demo --backend ec2 --moto`` passes (airflow_spot/demo_ec2.py)
BACKEND_OPTIONS = {"regions": [REGION], "image_id": IMAGE_ID, "python": sys.executable,
                   "term_grace_seconds": NOTICE_WINDOW_SECONDS}
MARKET_OPTIONS = {"regions": [REGION], "price_ttl_seconds": 0}

#: (dag_id, total_steps, steps_per_segment, step_sleep): the tests read these to build a reference run
#: 0.2 s steps: a segment trains 10 s, so a fresh instance reclaimed 8 s after its agent starts is always
#: reclaimed before its segment can end (a faster segment made the reclaim miss on a quiet machine)
DEMO = ("e2e_ec2_demo", 150, 50, 0.2)
FAILS = ("e2e_ec2_fails", 20, 20, 0.05)
LONG = ("e2e_ec2_long", 3000, 3000, 0.1)
WORKER = ("e2e_ec2_worker", 60, 30, 0.1)


def ec2_dag(dag_id: str, total_steps: int, steps_per_segment: int, step_sleep: float, *,
            extra_args: tuple[str, ...] = (), retries: int = 1, idle_timeout_seconds: float = 60.0) -> DAG:
    """One SpotTraining job of ``train_tiny`` with the demo's ec2 options and segment settings."""
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False, tags=["e2e", "ec2"]) as dag:
        SpotTraining(
            task_id="train",
            command=[*train_command(total_steps, step_sleep, FINAL_WEIGHTS), *extra_args],
            total_steps=total_steps,
            steps_per_segment=steps_per_segment,
            gpus=GpuRequest(count=1, min_memory_gib=16),
            checkpoint_uri="file://" + JOB_DIR,
            backend="ec2",
            backend_options=BACKEND_OPTIONS,
            market_options=MARKET_OPTIONS,
            max_preemptions=4,
            retries=retries,
            retry_delay=timedelta(seconds=1),
            segment_options={**SEGMENT_OPTIONS, "idle_timeout_seconds": idle_timeout_seconds, "deferrable": True},
        )
    return dag


demo_dag = build_demo_dag(
    dag_id=DEMO[0], root=ROOT, total_steps=DEMO[1], steps_per_segment=DEMO[2], step_sleep=DEMO[3],
    max_preemptions=8, backend="ec2", backend_options=BACKEND_OPTIONS, market_options=MARKET_OPTIONS,
)
for _task in demo_dag.tasks:  # wait in the triggerer whatever the deployment's [operators] default_deferrable
    if hasattr(_task, "deferrable"):
        _task.deferrable = True
fails_dag = ec2_dag(*FAILS, extra_args=("--fail-at-step", "5"), retries=0)
long_dag = ec2_dag(*LONG)
worker_dag = ec2_dag(*WORKER, idle_timeout_seconds=240.0)
