"""Airflow 3.3's own mechanisms under real Airflow (dag.test) on the real local backend.

- ``retry_policy``: a preempted segment retries at once although the task's ``retry_delay`` is ten
  minutes, and the try records why (Airflow's retry reason); a user's own policy is composed, not replaced.
- ``task_state_store``: a worker that dies between launch and defer leaves its instance running the
  attempt; the next try reattaches to that attempt instead of starting another one on the job.
"""
from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from airflow_fixtures import airflow_db, airflow_threads_released, run_dag  # noqa: F401
from airflow_fixtures import (
    FAST_SEGMENT_OPTIONS,
    backend_options,
    build_dag,
    instance_count,
    job_store,
    leftover_processes,
    protocol_command,
    ti_states,
)

from airflow_spot.operators.retry import PREEMPTED_REASON, SegmentRetryPolicy, UserFirstRetryPolicy
from airflow_spot.operators.segment import SegmentCodeFailure, SegmentPreempted, SpotSegmentOperator
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.protocol import JobLayout

pytestmark = pytest.mark.timeout(240)


def _history(dag_run, task_id: str) -> list:
    """Every finished try of a task instance of ``dag_run`` (Airflow's task instance history)."""
    from sqlalchemy import select

    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(
            select(TaskInstanceHistory).where(
                TaskInstanceHistory.dag_id == dag_run.dag_id,
                TaskInstanceHistory.run_id == dag_run.run_id,
                TaskInstanceHistory.task_id == task_id,
            ).order_by(TaskInstanceHistory.try_number)
        ).all()
        for r in rows:
            session.expunge(r)
        return rows


# ------------------------------------------------------------------------------------------ retry_policy
def test_policy_decisions_per_exception():
    policy = SegmentRetryPolicy(SegmentPreempted, SegmentCodeFailure)
    pre = policy.evaluate(SegmentPreempted("segment 0 attempt a preempted on i-1; resumes from step 40"), 1, 5)
    assert pre.action.value == "retry" and pre.retry_delay == timedelta(0)
    assert pre.reason.startswith(PREEMPTED_REASON) and "resumes from step 40" in pre.reason
    code = policy.evaluate(SegmentCodeFailure("the training command failed (exit code 3)\n--- tail ---"), 1, 5)
    assert code.action.value == "retry" and code.retry_delay is None  # the task's (user's) retry_delay
    assert "exit code 3" in code.reason and "tail" not in code.reason
    assert policy.evaluate(KeyError("x"), 1, 5).action.value == "default"
    long = policy.evaluate(SegmentPreempted("x" * 5000), 1, 5)
    assert len(long.reason) <= 500  # Airflow's retry_reason column


def test_a_users_policy_is_asked_first_and_kept():
    from airflow.sdk import ExceptionRetryPolicy, RetryAction, RetryRule

    user = ExceptionRetryPolicy(rules=[
        RetryRule(exception=SegmentCodeFailure, action=RetryAction.FAIL, reason="no code retries in prod"),
    ])
    op = SpotSegmentOperator(task_id="s", command=["true"], checkpoint_uri="file:///tmp/x", start_step=0,
                             end_step=1, total_steps=1, retry_policy=user)
    assert isinstance(op.retry_policy, UserFirstRetryPolicy) and op.retry_policy.user is user
    assert op.retry_policy.evaluate(SegmentCodeFailure("boom"), 1, 3).action is RetryAction.FAIL
    assert op.retry_policy.evaluate(SegmentPreempted("gone"), 1, 3).retry_delay == timedelta(0)
    with pytest.raises(TypeError, match="retry_policy must be an airflow.sdk RetryPolicy"):
        SpotSegmentOperator(task_id="s2", command=["true"], checkpoint_uri="file:///tmp/x", start_step=0,
                            end_step=1, total_steps=1, retry_policy={"preempted": 0})


def test_preemption_retries_at_once_with_its_reason(airflow_db, tmp_path):  # noqa: F811
    # retry_delay is ten minutes: without the policy the preempted try would wait that long (the test's
    # timeout is four); with it the retry starts at once.
    dag = build_dag(
        "policy_preempt_now",
        tmp_path,
        command=protocol_command("--step-seconds", "0.05"),
        total_steps=200,
        steps_per_segment=200,
        backend_options=backend_options(tmp_path, [1.5, None]),
        max_preemptions=3,
        retries=1,
        retry_delay=timedelta(minutes=10),
    )
    dr = run_dag(dag)
    states = ti_states(dr)
    assert states["train.segment_000"] == ("success", 2), states
    first = _history(dr, "train.segment_000")[0]
    assert first.try_number == 1
    assert first.retry_reason and first.retry_reason.startswith(PREEMPTED_REASON), first.retry_reason
    assert "the next try resumes from step" in first.retry_reason
    assert not leftover_processes(tmp_path)


# ------------------------------------------------------------------------------------------ task_state_store
class WorkerDiesAfterLaunch(SpotSegmentOperator):
    """The first try's worker goes away right after the launch was recorded, before it could defer."""

    def _remember_attempt(self, context, launch):
        super()._remember_attempt(context, launch)
        if context["ti"].try_number == 1:
            raise RuntimeError("worker lost after launching the instance (simulated crash)")


def test_next_try_reattaches_to_the_attempt_a_dead_worker_left_running(airflow_db, tmp_path):  # noqa: F811
    from airflow.sdk import DAG

    with DAG("reattach_after_crash", schedule=None, start_date=datetime(2024, 1, 1), catchup=False) as dag:
        WorkerDiesAfterLaunch(
            task_id="segment",
            command=protocol_command("--step-seconds", "0.05"),
            checkpoint_uri=f"file://{tmp_path}/jobs/{{{{ run_id }}}}",
            start_step=0, end_step=60, total_steps=60,
            backend="local", backend_options=backend_options(tmp_path),
            retries=2, retry_delay=timedelta(seconds=0.5), deferrable=True,
            **FAST_SEGMENT_OPTIONS,
        )
    dr = run_dag(dag)
    assert ti_states(dr)["segment"] == ("success", 2), ti_states(dr)
    store = job_store(tmp_path, dr.run_id)
    rows = LedgerStore(store).rows()
    # one attempt, run once and accounted once: the one try 1 launched, finished under try 2
    assert [(r.attempt_id, r.outcome) for r in rows] == [("segment.try1", "completed")], rows
    assert instance_count(tmp_path) == 1
    layout = JobLayout(store)
    assert layout.read_status("segment.try2") is None  # no second attempt was ever requested
    # no finish task here: release the warm instance as SpotTraining's finish would
    from airflow_spot.backends.base import get_backend

    backend = get_backend("local", **backend_options(tmp_path))
    backend.terminate([i.instance_id for i in backend.list_instances()])
    assert not leftover_processes(tmp_path)
