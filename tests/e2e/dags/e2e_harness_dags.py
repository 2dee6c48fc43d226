"""Small DAGs that prove the end-to-end harness itself (tests/e2e/test_e2e_harness.py).

- ``e2e_defer``: one task that defers to a :class:`DateTimeTrigger` for ``conf["wait_seconds"]`` seconds
  (default 2) and returns when it fires: a real deferral through the triggerer and back to a worker.
- ``e2e_retry``: a task that fails on its first try and succeeds on its second (``retries=1``).
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.providers.standard.triggers.temporal import DateTimeTrigger
from airflow.sdk import DAG, BaseOperator, task, timezone
from airflow.sdk.exceptions import AirflowException


class WaitInTriggerer(BaseOperator):
    """Defer for ``conf["wait_seconds"]`` seconds, then return when and where it resumed."""

    def execute(self, context: Any) -> None:
        seconds = float(context["dag_run"].conf.get("wait_seconds", 2))
        moment = timezone.utcnow() + timedelta(seconds=seconds)
        self.defer(trigger=DateTimeTrigger(moment=moment), method_name="execute_complete",
                   kwargs={"planned": moment.isoformat()})

    def execute_complete(self, context: Any, event: Any = None, planned: str = "") -> dict:
        return {"planned": planned, "resumed": timezone.utcnow().isoformat(), "try": context["ti"].try_number}


with DAG("e2e_defer", schedule=None, start_date=datetime(2026, 1, 1), catchup=False, tags=["e2e"]):
    WaitInTriggerer(task_id="wait")


with DAG("e2e_retry", schedule=None, start_date=datetime(2026, 1, 1), catchup=False, tags=["e2e"]):

    @task(retries=1, retry_delay=timedelta(seconds=1))
    def flaky(**context: Any) -> int:
        try_number = context["ti"].try_number
        if try_number == 1:
            raise AirflowException("first try fails on purpose")
        return try_number

    flaky()
