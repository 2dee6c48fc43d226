"""Faults of the Airflow stack itself, on the real PostgreSQL + Celery stack: the scheduler, a Celery worker
and the instance's agent each SIGKILLed mid-segment (a triggerer kill is in test_e2e_spot_training.py).

After each: the job finishes, every try of every segment has exactly one ledger row (no attempt lost to the
accounting, none run twice), no instance process is left, and the final weights are bit-identical to an
uninterrupted run of the same script.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dags"))

import e2e_fault_dags as fault_dags  # noqa: E402
from test_e2e_spot_training import (  # noqa: E402
    SEGMENT,
    assert_same_weights,
    attempt_id,
    job_dir,
    job_store,
    new_run_id,
    reference_weights,
    wait_heartbeat,
    wait_no_instance_processes,
)

from airflow_spot.storage.ledger_store import LedgerStore  # noqa: E402
from airflow_spot.storage.protocol import JobLayout  # noqa: E402

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

SEGMENTS = fault_dags.TOTAL_STEPS // fault_dags.STEPS_PER_SEGMENT


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_weights(tmp_path_factory.mktemp("reference"), fault_dags.TOTAL_STEPS)


def ledger(stack, dag_id: str, run_id: str) -> list[tuple[str, str]]:
    return sorted((r.attempt_id, r.outcome) for r in LedgerStore(job_store(stack, dag_id, run_id)).rows())


def try_states(stack, dag_id: str, run_id: str, segment: int) -> list[tuple[int, str]]:
    return [(t["try_number"], t["state"]) for t in stack.tries(dag_id, run_id, SEGMENT.format(segment))]


def job_instances(stack, dag_id: str, run_id: str) -> list[dict]:
    """Records of every instance the local backend launched for this job."""
    uri = "file://" + str(job_dir(stack, dag_id, run_id))
    records = [json.loads(p.read_text()) for p in stack.local_state_dir.glob("instances/*/record.json")]
    return [r for r in records if r["info"]["job_uri"] == uri]


def wait_status(stack, dag_id: str, run_id: str, attempt: str, timeout: float = 90.0):
    layout = JobLayout(job_store(stack, dag_id, run_id))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = layout.read_status(attempt)
        if status is not None:
            return status
        time.sleep(0.3)
    raise AssertionError(f"attempt {attempt} wrote no status within {timeout} s\n" + stack.log_tails())


def finish_checks(stack, dag_id: str, run_id: str, reference) -> None:
    assert_same_weights(job_dir(stack, dag_id, run_id) / "final_weights.pt", reference)
    assert wait_no_instance_processes(stack) == [], "instance processes left after the run"


def start_mid_segment(stack, dag, name: str, state: str, min_step: int) -> tuple[str, str]:
    """Trigger ``dag`` and return once its first segment is ``state`` and its first try trained ``min_step``."""
    stack.wait_dag(dag.dag_id)
    run_id = stack.trigger(dag.dag_id, run_id=new_run_id(name))
    stack.wait_task(dag.dag_id, run_id, SEGMENT.format(0), {state}, timeout=90)
    wait_heartbeat(stack, dag.dag_id, run_id, attempt_id(0, 1), min_step=min_step)
    return dag.dag_id, run_id


def test_scheduler_killed_mid_segment(airflow_stack, reference):
    stack = airflow_stack
    dag_id, run_id = start_mid_segment(stack, fault_dags.scheduler_dag, "sched", "deferred", min_step=5)
    stack.kill("scheduler")
    # the segment ends while no scheduler runs (the triggerer ends the task itself); then one comes back
    wait_status(stack, dag_id, run_id, attempt_id(0, 1))
    stack.restart("scheduler")
    assert stack.wait_run(dag_id, run_id, timeout=240) == "success", stack.task_instances(dag_id, run_id)
    for s in range(SEGMENTS):
        assert try_states(stack, dag_id, run_id, s) == [(1, "success")], s
    assert ledger(stack, dag_id, run_id) == [(attempt_id(s, 1), "completed") for s in range(SEGMENTS)]
    finish_checks(stack, dag_id, run_id, reference)


def test_worker_killed_while_a_segment_waits_in_it(airflow_stack, reference):
    stack = airflow_stack
    dag_id, run_id = start_mid_segment(stack, fault_dags.worker_dag, "worker", "running", min_step=5)
    killed = stack.kill("worker")
    assert killed, "the worker's session had no process to kill"
    stack.restart("worker")
    # The scheduler fails the silent try (task heartbeat timeout) and retries it; the new try must account
    # for the attempt the dead worker launched instead of starting another or skipping it unaccounted.
    assert stack.wait_run(dag_id, run_id, timeout=300) == "success", stack.task_instances(dag_id, run_id)
    tries = try_states(stack, dag_id, run_id, 0)
    assert tries[-1][1] == "success" and len(tries) >= 2, tries
    rows = ledger(stack, dag_id, run_id)
    assert rows == [(attempt_id(0, 1), "completed"), (attempt_id(1, 1), "completed")], rows
    assert JobLayout(job_store(stack, dag_id, run_id)).read_status(attempt_id(0, 2)) is None  # never requested
    assert len(job_instances(stack, dag_id, run_id)) == 1, "a second instance was launched for the job"
    finish_checks(stack, dag_id, run_id, reference)


def test_agent_killed_mid_segment(airflow_stack, reference):
    stack = airflow_stack
    dag_id, run_id = start_mid_segment(stack, fault_dags.agent_dag, "agent", "deferred", min_step=10)
    (record,) = job_instances(stack, dag_id, run_id)
    os.kill(record["agent"]["pid"], signal.SIGKILL)
    assert stack.wait_run(dag_id, run_id, timeout=240) == "success", stack.task_instances(dag_id, run_id)
    rows = ledger(stack, dag_id, run_id)
    # the killed attempt is accounted as lost, once; its retry resumed from the last checkpoint
    assert rows == [(attempt_id(0, 1), "lost"), (attempt_id(0, 2), "completed"), (attempt_id(1, 1), "completed")], rows
    assert try_states(stack, dag_id, run_id, 0)[-1] == (2, "success")
    finish_checks(stack, dag_id, run_id, reference)
