"""The end-to-end harness itself: a real deferral, a retry and a triggerer SIGKILL under real Airflow."""
from __future__ import annotations

from datetime import datetime

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_deferred_task_resumes_through_the_triggerer(airflow_stack):
    stack = airflow_stack
    stack.wait_dag("e2e_defer")
    run_id = stack.trigger("e2e_defer", conf={"wait_seconds": 3})
    # The task really leaves the worker: it is seen in the deferred state before it succeeds.
    stack.wait_task("e2e_defer", run_id, "wait", {"deferred"}, timeout=60)
    assert stack.wait_run("e2e_defer", run_id, timeout=60) == "success"
    result = stack.xcom("e2e_defer", run_id, "wait")
    assert datetime.fromisoformat(result["resumed"]) >= datetime.fromisoformat(result["planned"])
    assert [t["try_number"] for t in stack.tries("e2e_defer", run_id, "wait")] == [1]


def test_failed_try_is_retried(airflow_stack):
    stack = airflow_stack
    stack.wait_dag("e2e_retry")
    run_id = stack.trigger("e2e_retry")
    assert stack.wait_run("e2e_retry", run_id, timeout=90) == "success"
    tries = stack.tries("e2e_retry", run_id, "flaky")
    assert [(t["try_number"], t["state"]) for t in tries] == [(1, "failed"), (2, "success")]
    assert stack.xcom("e2e_retry", run_id, "flaky") == 2
    assert "first try fails on purpose" in stack.task_log("e2e_retry", run_id, "flaky", 1)


def test_trigger_survives_a_triggerer_sigkill(airflow_stack):
    stack = airflow_stack
    run_id = stack.trigger("e2e_defer", conf={"wait_seconds": 8})
    stack.wait_task("e2e_defer", run_id, "wait", {"deferred"}, timeout=60)
    stack.kill_triggerer()
    stack.start_triggerer()
    # The new triggerer adopts the orphaned trigger once the old one's heartbeat is stale.
    assert stack.wait_run("e2e_defer", run_id, timeout=90) == "success"
    tries = stack.tries("e2e_defer", run_id, "wait")
    assert [(t["try_number"], t["state"]) for t in tries] == [(1, "success")]
