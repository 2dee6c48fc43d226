"""The ``ec2`` backend under a real Airflow (PostgreSQL, CeleryExecutor on Redis, separate triggerer).

EC2 is moto's server on 127.0.0.1, started in this process for the module and reached by every Airflow
process through the ``aws_default`` connection (created over REST with its ``endpoint_url``). moto keeps
records only; the data plane of :mod:`airflow_spot.testing.ec2_dataplane` plays each instance the DAGs
launch (its agent started from the instance's own user data, an IMDSv2 on 127.0.0.1) and reclaims
instances on a schedule (notice through IMDS, then ``Server.SpotInstanceTermination``). Spot prices are
the bundled catalog's; a reclaimed pool's price triples at its notice, as ``airflow-spot demo --backend
ec2 --moto`` does, so each retry must go to another pool.

Checked, on the DAGs of ``tests/e2e/dags/e2e_ec2_dags.py``:

- the demo DAG completes through three reclaims, bit-identical to an uninterrupted run, each retry on
  another pool;
- no instance of the run is left running in moto after: that success; a failure (the command exits 1);
  the deferred task marked failed over REST (the trigger's ``on_kill``); the DAG run marked failed over
  REST (the ``finish`` task is skipped then, so only ``on_kill`` can release it); and a Celery worker
  SIGKILLed while its ``RunInstances`` call is in flight (the instance exists, the worker never heard of
  it: the next try must find it again or release it).
"""
from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dags"))

import e2e_ec2_dags as ec2_dags  # noqa: E402
from test_e2e_spot_training import (  # noqa: E402
    FINISH,
    SEGMENT,
    assert_same_weights,
    attempt_id,
    job_dir,
    job_store,
    new_run_id,
    reference_weights,
    wait_heartbeat,
)

from airflow_spot.demo_ec2 import RECLAIM_PRICE_FACTOR, catalog_spot_prices  # noqa: E402
from airflow_spot.operators.attempt_record import AttemptLaunch  # noqa: E402
from airflow_spot.operators.segment import TAG_DAG, TAG_RUN  # noqa: E402
from airflow_spot.storage.ledger_store import LedgerStore  # noqa: E402
from airflow_spot.testing.ec2_dataplane import Ec2DataPlane, set_spot_prices, spot_prices  # noqa: E402
from airflow_spot.testing.moto_ec2 import after_run_instances, reset  # noqa: E402
from airflow_spot.testing.moto_s3 import moto_server  # noqa: E402

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

CONN_ID = "aws_default"
REGION = ec2_dags.REGION
#: the agent on a played instance polls IMDS for the notice this often (AWS suggests 5 s for a 120 s window)
PLANE_ENV = {"SPOT_NOTICE_POLL_SECONDS": "0.5"}


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ec2(airflow_stack):
    """moto's server in this process, the ``aws_default`` connection of the stack pointing at it, and the
    ec2 DAGs parsed. Yields the stack."""
    stack = airflow_stack
    with moto_server() as endpoint:
        reset(endpoint)
        conn = {"connection_id": CONN_ID, "conn_type": "aws", "login": "testing", "password": "testing",
                "extra": json.dumps({"region_name": REGION, "endpoint_url": endpoint})}
        stack.api("DELETE", f"/connections/{CONN_ID}", ok=(204, 404))
        stack.api("POST", "/connections", json=conn, ok=(200, 201))
        try:
            for dag in (ec2_dags.DEMO, ec2_dags.FAILS, ec2_dags.LONG, ec2_dags.WORKER):
                stack.wait_dag(dag[0])
            yield stack
        finally:  # the other e2e modules must not find a connection to a server that is gone
            with contextlib.suppress(Exception):
                stack.api("DELETE", f"/connections/{CONN_ID}", ok=(204, 404))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    return {n: reference_weights(tmp, n) for n in (ec2_dags.DEMO[1], ec2_dags.WORKER[1])}


@contextlib.contextmanager
def data_plane(stack, name: str, **kwargs):
    """A data plane for one test (instances seen from now on; the n-th is reclaimed ``after_seconds[n]``
    after its agent starts), with the catalog's spot prices; every agent it started is gone on exit."""
    set_spot_prices(catalog_spot_prices(REGION))
    plane = Ec2DataPlane(stack.root / "ec2-plane" / name, region=REGION,
                         notice_window_seconds=ec2_dags.NOTICE_WINDOW_SECONDS, env=PLANE_ENV, **kwargs)
    with plane:
        yield plane
    assert not plane.errors, plane.errors


# ---------------------------------------------------------------------------------------------- helpers
def run_tags(dag_id: str, run_id: str) -> dict[str, str]:
    return {TAG_DAG: dag_id, TAG_RUN: run_id}


def wait_none_running(plane: Ec2DataPlane, dag_id: str, run_id: str, timeout: float = 60.0) -> list[str]:
    """Instances of the run moto still shows as pending or running after ``timeout`` s (empty: none)."""
    deadline = time.monotonic() + timeout
    while True:
        left = plane.running_instances(run_tags(dag_id, run_id))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def instance_summary(plane: Ec2DataPlane, dag_id: str, run_id: str) -> list[tuple[str, str, str]]:
    return [(i.id, i._state.name, i.state_reason.code or "") for i in plane.instances(run_tags(dag_id, run_id))]


def ledger(stack, dag_id: str, run_id: str):
    return LedgerStore(job_store(stack, dag_id, run_id)).rows()


def wait_billed(stack, dag_id: str, run_id: str, attempt: str, timeout: float = 60.0):
    """The attempt's ledger row once written (a killed attempt's is written after its instance's end)."""
    deadline = time.monotonic() + timeout
    while True:
        row = LedgerStore(job_store(stack, dag_id, run_id)).read(attempt)
        if row is not None or time.monotonic() > deadline:
            return row
        time.sleep(0.5)


def try_states(stack, dag_id: str, run_id: str, segment: int) -> list[tuple[int, str]]:
    return [(t["try_number"], t["state"]) for t in stack.tries(dag_id, run_id, SEGMENT.format(segment))]


# ---------------------------------------------------------------------------------------------- tests
def test_demo_dag_on_ec2_completes_through_three_reclaims_with_uninterrupted_weights(ec2, references):
    stack = ec2
    dag_id, total_steps, _, _ = ec2_dags.DEMO
    moves: list[tuple[str, str]] = []

    def noticed(instance_id: str, instance_type: str, zone: str) -> None:  # demand rose in that pool
        prices = spot_prices()
        prices[(instance_type, zone)] = round(prices[(instance_type, zone)] * RECLAIM_PRICE_FACTOR, 5)
        set_spot_prices(prices)
        moves.append((instance_type, zone))

    with data_plane(stack, "demo", after_seconds=[8.0, 8.0, 8.0], on_notice=noticed) as plane:
        run_id = stack.trigger(dag_id, run_id=new_run_id("demo"))
        assert stack.wait_run(dag_id, run_id, timeout=420) == "success", stack.task_instances(dag_id, run_id)
        assert wait_none_running(plane, dag_id, run_id) == [], instance_summary(plane, dag_id, run_id)
        reclaimed = list(plane.notices)

    rows = ledger(stack, dag_id, run_id)
    outcomes = [(r.attempt_id, r.outcome, r.instance_id) for r in rows]
    assert len(reclaimed) == 3, (reclaimed, outcomes)
    interrupted = [r for r in rows if r.outcome in ("preempted", "lost")]
    assert {r.instance_id for r in interrupted} <= set(reclaimed), outcomes
    assert interrupted, outcomes
    # A notice that reaches an instance as its segment completes (within the 8 s) leaves no interrupted
    # attempt on it: the instance is reclaimed before the next segment starts, or that segment lets it go
    # because the notice tripled its pool's price (at or above on-demand of its type: leave_running). Its
    # attempts all completed, and the job still went through three reclaims.
    for instance_id in set(reclaimed) - {r.instance_id for r in interrupted}:
        on_it = [r for r in rows if r.instance_id == instance_id]
        assert on_it and all(r.outcome == "completed" for r in on_it), (instance_id, outcomes)
    assert all(r.outcome in ("preempted", "lost", "completed") for r in rows), outcomes

    # every retry after a reclaim launched in another pool (the reclaimed one had become 3x dearer)
    store = job_store(stack, dag_id, run_id)
    launches = sorted((AttemptLaunch.read(store, r.attempt_id) for r in rows), key=lambda a: a.requested_at)
    reclaimed_attempts = {r.attempt_id for r in interrupted}
    for before, after in zip(launches, launches[1:]):
        # (an attempt that completed on an instance reclaimed later hands that instance on warm: not a retry)
        if before.attempt_id in reclaimed_attempts:
            pool = (before.offer["instance_type"], before.offer["zone"])
            assert pool in moves, (pool, moves)
            assert (after.offer["instance_type"], after.offer["zone"]) != pool, (before, after)
            assert after.instance_id != before.instance_id and not after.reused_instance

    summary = stack.xcom(dag_id, run_id, FINISH, key="summary")
    assert summary["completed"] is True and summary["latest_step"] == total_steps
    assert_same_weights(job_dir(stack, dag_id, run_id) / "final_weights.pt", references[total_steps])


def test_failed_command_fails_the_run_and_leaves_no_instance(ec2):
    stack = ec2
    dag_id = ec2_dags.FAILS[0]
    with data_plane(stack, "fails") as plane:
        run_id = stack.trigger(dag_id, run_id=new_run_id("fails"))
        assert stack.wait_run(dag_id, run_id, timeout=240) == "failed"
        assert wait_none_running(plane, dag_id, run_id) == [], instance_summary(plane, dag_id, run_id)
        launched = plane.instances(run_tags(dag_id, run_id))
    assert len(launched) == 1, instance_summary(plane, dag_id, run_id)
    assert try_states(stack, dag_id, run_id, 0) == [(1, "failed")]
    assert "injected failure at step 5" in stack.task_log(dag_id, run_id, SEGMENT.format(0), 1)
    assert [(r.attempt_id, r.outcome) for r in ledger(stack, dag_id, run_id)] == [(attempt_id(0, 1), "failed")]


def wait_trigger_polling(stack, dag_id: str, run_id: str, task_id: str, timeout: float = 180.0) -> None:
    """Wait until the deferred try's trigger logs progress: its describes of the instance go round.

    The first connection read in a triggerer makes Airflow build its in-process Execution API (Cadwyn
    routes), which took 30-40 s of CPU on a loaded 2-core machine, and the triggerer handles nothing
    else meanwhile (it logs "event loop appears deadlocked"): a task killed then has its trigger
    cancelled only after that, and its on_kill has to wait for the same read."""
    wait_in_log(stack, dag_id, run_id, task_id, "progress: step", timeout)


def wait_in_log(stack, dag_id: str, run_id: str, task_id: str, text: str | tuple[str, ...], timeout: float) -> str:
    """The first try's log once it holds ``text`` (or one of several); fails with the stack's log tails
    after ``timeout`` s."""
    texts = (text,) if isinstance(text, str) else text
    deadline = time.monotonic() + timeout
    while not any(t in (log := stack.task_log(dag_id, run_id, task_id, 1)) for t in texts):
        if time.monotonic() > deadline:
            raise AssertionError(f"{task_id} logged none of {texts!r} within {timeout} s\n{log[-3000:]}\n"
                                 + stack.log_tails())
        time.sleep(1.0)
    return log


def _start_long_run(stack, plane: Ec2DataPlane, prefix: str) -> tuple[str, str, str]:
    """Trigger the long job and wait until its segment is deferred, training and watched by its trigger;
    returns its instance."""
    dag_id = ec2_dags.LONG[0]
    run_id = stack.trigger(dag_id, run_id=new_run_id(prefix))
    stack.wait_task(dag_id, run_id, SEGMENT.format(0), {"deferred"}, timeout=120)
    wait_heartbeat(stack, dag_id, run_id, attempt_id(0, 1), min_step=3, timeout=120)
    wait_trigger_polling(stack, dag_id, run_id, SEGMENT.format(0))
    (instance_id,) = plane.running_instances(run_tags(dag_id, run_id))
    assert stack.task_instance(dag_id, run_id, SEGMENT.format(0))["state"] == "deferred"
    return dag_id, run_id, instance_id


def test_deferred_task_marked_failed_terminates_its_instance(ec2):
    stack = ec2
    segment = SEGMENT.format(0)
    with data_plane(stack, "task-failed") as plane:
        dag_id, run_id, instance_id = _start_long_run(stack, plane, "task-failed")
        stack.set_task_state(dag_id, run_id, segment, "failed")
        assert stack.wait_run(dag_id, run_id, timeout=180) == "failed"
        left = wait_none_running(plane, dag_id, run_id)
        assert left == [], (instance_summary(plane, dag_id, run_id),
                            stack.task_log(dag_id, run_id, segment, 1)[-3000:],
                            stack.task_log(dag_id, run_id, FINISH, 1)[-3000:])
        assert instance_summary(plane, dag_id, run_id) == [(instance_id, "terminated", "Client.UserInitiatedShutdown")]
    # Two parts release it and neither waits for the other: the trigger's on_kill (the triggerer cancels the
    # trigger at its next sync) and the ``finish`` task (ALL_DONE, scheduled as soon as the segment is
    # failed). Which comes first is Airflow's scheduling; on_kill alone is checked by the next test, where
    # marking the run failed skips ``finish``. Either the trigger was killed, or ``finish`` terminated the
    # instance before the triggerer's sync and the still-running trigger saw it go and ended on its own
    # (CI saw both). (The triggerer repeats the cancellation while on_kill runs, so its closing log line
    # may be cut.)
    killed = f"was killed: terminating its instance {instance_id}"
    gone = "instance terminated (reason: user) without a status for this attempt"
    log = wait_in_log(stack, dag_id, run_id, segment, (killed, gone), 60)
    assert "instances failed" not in log, log[-3000:]
    summary = stack.xcom(dag_id, run_id, FINISH, key="summary")
    if killed in log:
        assert summary["terminated_at_end"] in ([], [instance_id])
    else:  # finish released it first
        assert summary["terminated_at_end"] == [instance_id], (summary, log[-3000:])
    # whichever released it billed it: no execute_complete follows a kill
    row = wait_billed(stack, dag_id, run_id, attempt_id(0, 1))
    assert row is not None and row.outcome == "abandoned" and row.cost > 0, (row, log[-3000:])


def test_run_marked_failed_terminates_the_deferred_segments_instance(ec2):
    stack = ec2
    with data_plane(stack, "run-failed") as plane:
        dag_id, run_id, instance_id = _start_long_run(stack, plane, "run-failed")
        stack.api("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed"})
        assert stack.wait_run(dag_id, run_id, timeout=60) == "failed"
        # Marking the run failed skips the pending ``finish`` task: only the trigger's on_kill can release it.
        left = wait_none_running(plane, dag_id, run_id)
        finish = stack.task_instance(dag_id, run_id, FINISH)["state"]
        assert left == [], (instance_summary(plane, dag_id, run_id), finish)
        assert instance_summary(plane, dag_id, run_id) == [(instance_id, "terminated", "Client.UserInitiatedShutdown")]
    assert finish in ("skipped", None), finish
    log = stack.task_log(dag_id, run_id, SEGMENT.format(0), 1)
    assert f"was killed: terminating its instance {instance_id}" in log, log[-3000:]
    row = wait_billed(stack, dag_id, run_id, attempt_id(0, 1))  # by on_kill alone: finish was skipped
    assert row is not None and row.outcome == "abandoned" and row.instance_id == instance_id, (row, log[-3000:])


def test_worker_killed_during_launch_leaves_one_instance_that_the_next_try_uses(ec2, references):
    stack = ec2
    dag_id, total_steps, _, _ = ec2_dags.WORKER
    run_id = new_run_id("worker")
    launched, killed = threading.Event(), threading.Event()

    def on_launch(tags: dict[str, str]) -> None:
        # moto's server thread, after the instance exists and before the worker gets the reply
        if tags.get(TAG_DAG) == dag_id and tags.get(TAG_RUN) == run_id and not launched.is_set():
            launched.set()
            killed.wait(120)  # the reply goes out to a dead worker

    with data_plane(stack, "worker") as plane, after_run_instances(on_launch):
        stack.trigger(dag_id, run_id=run_id)
        assert launched.wait(180), "the first try never called RunInstances\n" + stack.log_tails()
        (orphan,) = plane.instances(run_tags(dag_id, run_id))
        assert stack.kill("worker"), "the worker's session had no process to kill"
        stack.restart("worker")
        killed.set()
        assert AttemptLaunch.read(job_store(stack, dag_id, run_id), attempt_id(0, 1)) is None, (
            "the first try recorded its launch: the worker was not killed before RunInstances answered")
        # The scheduler fails the silent try (task heartbeat timeout) and retries it; the new try must use the
        # instance the dead worker launched, or release it, and never leave it running.
        assert stack.wait_run(dag_id, run_id, timeout=360) == "success", stack.task_instances(dag_id, run_id)
        assert wait_none_running(plane, dag_id, run_id) == [], instance_summary(plane, dag_id, run_id)
        instances = instance_summary(plane, dag_id, run_id)

    tries = try_states(stack, dag_id, run_id, 0)
    assert tries[0] == (1, "failed") and tries[-1][1] == "success", tries
    rows = ledger(stack, dag_id, run_id)
    store = job_store(stack, dag_id, run_id)
    used = {AttemptLaunch.read(store, r.attempt_id).instance_id for r in rows}
    # the orphan served the next try (found again as the job's warm instance): no second instance
    assert [i for i, _, _ in instances] == [orphan.id] and used == {orphan.id}, (instances, used)
    assert [(r.attempt_id, r.outcome) for r in rows] == [
        (attempt_id(0, tries[-1][0]), "completed"), (attempt_id(1, 1), "completed")], rows
    assert_same_weights(job_dir(stack, dag_id, run_id) / "final_weights.pt", references[total_steps])
