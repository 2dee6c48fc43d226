"""Airflow DAGs of the stack-fault end-to-end tests (tests/e2e/test_e2e_stack_faults.py).

The same job as ``e2e_spot_steady`` (two segments of ``train_tiny``, slow steps, no preemption), once per
fault so each test has a DAG of its own:

- ``e2e_fault_scheduler``: the scheduler is SIGKILLed while a segment is deferred;
- ``e2e_fault_worker``: the segments wait in the worker (``deferrable=False``) and the Celery worker is
  SIGKILLed mid-segment, so the scheduler fails that try and the next try must find the attempt again;
- ``e2e_fault_agent``: the instance's agent is SIGKILLed mid-segment.
"""
from __future__ import annotations

from e2e_spot_dags import STEADY, spot_dag

_, TOTAL_STEPS, STEPS_PER_SEGMENT, STEP_SLEEP = STEADY

scheduler_dag = spot_dag("e2e_fault_scheduler", TOTAL_STEPS, STEPS_PER_SEGMENT, STEP_SLEEP)
worker_dag = spot_dag("e2e_fault_worker", TOTAL_STEPS, STEPS_PER_SEGMENT, STEP_SLEEP, deferrable=False)
agent_dag = spot_dag("e2e_fault_agent", TOTAL_STEPS, STEPS_PER_SEGMENT, STEP_SLEEP)
