"""A real spot training job under a real Airflow (PostgreSQL, CeleryExecutor on Redis, separate triggerer).

``dag.test()`` runs triggers inline and hides deferral bugs (NOTES.md), so these run the DAGs of
``tests/e2e/dags/e2e_spot_dags.py`` through the scheduler, Celery worker and triggerer of the session's
stack, with the ``local`` backend's instances as process groups and its injector preempting on a schedule:

- the job completes through two preemptions, with the same final weights as an uninterrupted run;
- a triggerer SIGKILLed while a segment is deferred loses and duplicates no attempt;
- no instance process is left after a successful run, a failed run and a task killed over REST.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dags"))

import e2e_spot_dags as spot_dags  # noqa: E402

from airflow_spot.storage.ledger_store import LedgerStore  # noqa: E402
from airflow_spot.storage.object_store import open_store  # noqa: E402
from airflow_spot.storage.protocol import JobLayout, safe_id  # noqa: E402

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

SEGMENT = "train.segment_{:03d}"
FINISH = "train.finish"


# ---------------------------------------------------------------------------------------------- helpers
def job_dir(stack, dag_id: str, run_id: str) -> Path:
    return stack.work_dir / "jobs" / dag_id / run_id


def job_store(stack, dag_id: str, run_id: str):
    return open_store("file://" + str(job_dir(stack, dag_id, run_id)))


def attempt_id(segment: int, try_number: int) -> str:
    return safe_id(SEGMENT.format(segment), f"try{try_number}")


def reference_weights(tmp: Path, total_steps: int) -> dict:
    """Final weights of the same script trained uninterrupted, outside Airflow."""
    out = tmp / f"reference-{total_steps}.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOT_", "AIRFLOW"))}
    subprocess.run(
        [sys.executable, "-m", "airflow_spot.examples.train_tiny", "--total-steps", str(total_steps),
         "--job-uri", str(tmp / f"reference-job-{total_steps}"), "--final-weights", str(out)],
        env=env, check=True, timeout=180, capture_output=True,
    )
    return torch.load(out)


def assert_same_weights(actual_path: Path, expected: dict) -> None:
    actual = torch.load(actual_path)
    assert actual.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not different, f"weights differ from the uninterrupted run in {different}"


def wait_no_instance_processes(stack, timeout: float = 30.0) -> list[tuple[int, str]]:
    """Instance-side processes still alive after ``timeout`` seconds (empty: all gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = stack.instance_processes()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def wait_heartbeat(stack, dag_id: str, run_id: str, attempt: str, min_step: int, timeout: float = 90.0):
    """Wait until the attempt's training process has reported step >= ``min_step``."""
    layout = JobLayout(job_store(stack, dag_id, run_id))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hb = layout.read_heartbeat(attempt)
        if hb is not None and hb.step >= min_step:
            return hb
        time.sleep(0.3)
    raise AssertionError(f"no heartbeat at step >= {min_step} for attempt {attempt} within {timeout} s\n"
                         + stack.log_tails())


def attempt_logs(stack, dag_id: str, run_id: str, attempt: str) -> list[Path]:
    """The agent's output files of one attempt of one job, over every instance the job launched."""
    job_uri = "file://" + str(job_dir(stack, dag_id, run_id))
    logs = []
    for record_path in stack.local_state_dir.glob("instances/*/record.json"):
        if json.loads(record_path.read_text())["info"]["job_uri"] == job_uri:
            logs += record_path.parent.glob(f"attempts/{attempt}.log")
    return sorted(logs)


def new_run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    return {n: reference_weights(tmp, n) for n in (spot_dags.PREEMPT[1], spot_dags.STEADY[1])}


# ---------------------------------------------------------------------------------------------- tests
def test_job_completes_through_two_preemptions_with_uninterrupted_weights(airflow_stack, references):
    stack = airflow_stack
    dag_id, total_steps, steps_per_segment, _ = spot_dags.PREEMPT
    stack.wait_dag(dag_id)
    run_id = stack.trigger(dag_id, run_id=new_run_id("preempt"))
    assert stack.wait_run(dag_id, run_id, timeout=300) == "success", stack.task_instances(dag_id, run_id)

    rows = LedgerStore(job_store(stack, dag_id, run_id)).rows()
    outcomes = [r.outcome for r in rows]
    interrupted = [r for r in rows if r.outcome in ("preempted", "lost")]
    assert len(interrupted) == 2, outcomes  # the schedule preempts exactly the first two launches
    assert all(r.outcome in ("preempted", "lost", "completed") for r in rows), outcomes

    segments = total_steps // steps_per_segment
    tries = {s: stack.tries(dag_id, run_id, SEGMENT.format(s)) for s in range(segments)}
    # Every interrupted attempt is one failed Airflow try that was retried; every segment ends in success.
    failed_tries = sum(1 for ts in tries.values() for t in ts if t["state"] != "success")
    assert failed_tries == len(interrupted), {s: [(t["try_number"], t["state"]) for t in ts] for s, ts in tries.items()}
    assert all(ts[-1]["state"] == "success" for ts in tries.values())
    assert sorted(r.attempt_id for r in rows) == sorted(
        attempt_id(s, t["try_number"]) for s, ts in tries.items() for t in ts
    )

    summary = stack.xcom(dag_id, run_id, FINISH, key="summary")
    assert summary["completed"] is True and summary["latest_step"] == total_steps
    assert summary["preemptions"] + summary.get("lost", 0) >= 2, summary

    assert_same_weights(job_dir(stack, dag_id, run_id) / "final_weights.pt", references[total_steps])
    assert wait_no_instance_processes(stack) == [], "instance processes left after a successful run"


def test_triggerer_restart_neither_loses_nor_duplicates_an_attempt(airflow_stack, references):
    stack = airflow_stack
    dag_id, total_steps, steps_per_segment, _ = spot_dags.STEADY
    stack.wait_dag(dag_id)
    run_id = stack.trigger(dag_id, run_id=new_run_id("restart"))
    first = attempt_id(0, 1)
    stack.wait_task(dag_id, run_id, SEGMENT.format(0), {"deferred"}, timeout=90)
    hb = wait_heartbeat(stack, dag_id, run_id, first, min_step=5)
    assert hb.step < steps_per_segment, "the segment ended before the triggerer could be killed"
    stack.kill_triggerer()
    stack.start_triggerer()
    assert stack.wait_run(dag_id, run_id, timeout=240) == "success", stack.task_instances(dag_id, run_id)

    segments = total_steps // steps_per_segment
    for s in range(segments):
        tries = stack.tries(dag_id, run_id, SEGMENT.format(s))
        assert [(t["try_number"], t["state"]) for t in tries] == [(1, "success")], (s, tries)
    rows = LedgerStore(job_store(stack, dag_id, run_id)).rows()
    assert sorted((r.attempt_id, r.outcome) for r in rows) == [(attempt_id(s, 1), "completed") for s in range(segments)]
    for s in range(segments):  # each attempt ran exactly once: a new command, or in the warm process
        logs = attempt_logs(stack, dag_id, run_id, attempt_id(s, 1))
        assert len(logs) == 1, logs
        text = logs[0].read_text()
        started = text.count("resuming at step") + text.count("continues in the warm training process")
        assert started == 1, text[-2000:]
    assert_same_weights(job_dir(stack, dag_id, run_id) / "final_weights.pt", references[total_steps])
    assert wait_no_instance_processes(stack) == [], "instance processes left after the run"


def test_failed_script_fails_the_run_and_leaves_no_instance(airflow_stack):
    stack = airflow_stack
    dag_id = spot_dags.FAILS[0]
    stack.wait_dag(dag_id)
    run_id = stack.trigger(dag_id, run_id=new_run_id("fails"))
    assert stack.wait_run(dag_id, run_id, timeout=180) == "failed"
    tries = stack.tries(dag_id, run_id, SEGMENT.format(0))
    assert [(t["try_number"], t["state"]) for t in tries] == [(1, "failed")]
    assert "injected failure at step 5" in stack.task_log(dag_id, run_id, SEGMENT.format(0), 1)
    assert stack.task_instance(dag_id, run_id, FINISH)["state"] == "failed"  # ran, and told the truth
    rows = LedgerStore(job_store(stack, dag_id, run_id)).rows()
    assert [(r.attempt_id, r.outcome) for r in rows] == [(attempt_id(0, 1), "failed")]
    assert wait_no_instance_processes(stack) == [], "instance processes left after a failed run"


def test_task_killed_over_rest_leaves_no_instance(airflow_stack):
    stack = airflow_stack
    dag_id = spot_dags.LONG[0]
    stack.wait_dag(dag_id)
    run_id = stack.trigger(dag_id, run_id=new_run_id("killed"))
    stack.wait_task(dag_id, run_id, SEGMENT.format(0), {"deferred"}, timeout=90)
    wait_heartbeat(stack, dag_id, run_id, attempt_id(0, 1), min_step=3)
    assert stack.instance_processes(), "the segment's instance should be running now"
    assert stack.task_instance(dag_id, run_id, SEGMENT.format(0))["state"] == "deferred"
    stack.set_task_state(dag_id, run_id, SEGMENT.format(0), "failed")
    assert stack.wait_run(dag_id, run_id, timeout=120) == "failed"
    left = wait_no_instance_processes(stack, timeout=30)
    assert left == [], f"instance processes left 30 s after the task was marked failed: {left}"
    # The try ended because of the REST call, not because its trigger broke on its own.
    assert "Trigger failed" not in stack.task_log(dag_id, run_id, SEGMENT.format(0), 1)
    assert stack.task_instance(dag_id, run_id, FINISH)["state"] == "failed"  # ran (ALL_DONE), job incomplete


def test_segments_defer_by_default(airflow_stack):
    """The issue asks for a deferrable operator by default; under a deployment's config it must defer."""
    stack = airflow_stack
    dag_id = spot_dags.DEFAULT[0]
    stack.wait_dag(dag_id)
    run_id = stack.trigger(dag_id, run_id=new_run_id("default"))
    assert stack.wait_run(dag_id, run_id, timeout=180) == "success"
    ti_id = stack.task_instance(dag_id, run_id, SEGMENT.format(0))["id"]
    # every worker's log: a test before this one may have killed the first worker and started another
    finished = [line for log in sorted(stack.logs.glob("worker*.log")) for line in log.read_text().splitlines()
                if "Workload finished" in line and ti_id in line]
    assert any("final_state=deferred" in line for line in finished), (
        "the segment waited in the worker instead of deferring: " + "; ".join(finished)
    )
    assert wait_no_instance_processes(stack) == []


def test_no_capacity_is_waited_out_on_a_timer_within_one_try(airflow_stack):
    """No spot capacity anywhere for 20 s, and the job may not use on-demand: the segment defers on a timer
    and decides again every 2 s through the triggerer, within its one try, then launches."""
    stack = airflow_stack
    dag_id = spot_dags.CAPACITY[0]
    stack.wait_dag(dag_id)
    run_id = stack.trigger(dag_id, run_id=new_run_id("capacity"))
    assert stack.wait_run(dag_id, run_id, timeout=240) == "success", stack.task_instances(dag_id, run_id)
    tries = stack.tries(dag_id, run_id, SEGMENT.format(0))
    assert [t["state"] for t in tries] == ["success"], tries
    from airflow_spot.operators.planning import AvailabilityRecorder

    store = job_store(stack, dag_id, run_id)
    kinds = [e.kind for e in AvailabilityRecorder(store, None, "j").job_events()]
    assert kinds.count("refused") >= 2 and kinds[-1] == "launched", kinds
    assert [(r.market, r.outcome) for r in LedgerStore(store).rows()] == [("spot", "completed")]
    log = stack.task_log(dag_id, run_id, SEGMENT.format(0), 1)
    assert "the plan is to wait for capacity" in log
    # the waits went through the triggerer (a worker that slept would never resume here)
    assert "back from waiting for capacity on a timer in the triggerer" in log
    assert wait_no_instance_processes(stack) == []
