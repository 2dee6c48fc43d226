"""Spot training DAGs for the end-to-end tests (tests/e2e/test_e2e_spot_training.py).

Each is one :func:`SpotTraining` job of ``airflow_spot.examples.train_tiny`` on the ``local`` backend, with
checkpoints under ``$SPOT_E2E_ROOT/jobs/<dag>/<run>`` (``file://``) and the final weights written next to
them. The local backend's state directory comes from ``$AIRFLOW_SPOT_LOCAL_DIR`` (set by the harness).

- ``e2e_spot_preemptions``: 3 segments; the injector preempts the job's first two launched instances
  ``PREEMPT_AFTER`` seconds after they start (schedule mode), so the job survives exactly two preemptions.
- ``e2e_spot_steady``: 2 segments, no preemption, slow steps (time to kill the triggerer mid-segment).
- ``e2e_spot_fails``: the script raises at step 5 (exit 1) and the job allows no code retry.
- ``e2e_spot_long``: one long segment, to be killed from outside (task marked failed over REST).
- ``e2e_spot_default``: one short segment that does not choose ``deferrable``: the operator's default
  under a deployment's configuration must be to defer.
- ``e2e_spot_capacity``: spot only, and no spot capacity for the job's first 20 s (a trace replayed with
  ``capacity``): the segment waits for it on a timer through the triggerer, within its first try.

All but ``e2e_spot_default`` pass ``deferrable=True`` so that they test deferral whatever the default.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from datetime import datetime, timedelta

from airflow.sdk import DAG

from airflow_spot.operators.training import SpotTraining

ROOT = os.environ.get("SPOT_E2E_ROOT") or os.path.join(tempfile.gettempdir(), "airflow-spot-e2e")
JOB_DIR = ROOT + "/jobs/{{ dag.dag_id }}/{{ run_id }}"
FINAL_WEIGHTS = JOB_DIR + "/final_weights.pt"

#: (dag_id, total_steps, steps_per_segment, step_sleep): the tests read these to build a reference run
# 0.2 s steps: the first instance gets through at most 20 of segment 0's 40 steps in its 4 s, so the
# retry has at least 4 s of steps left and is preempted too, however fast the processes start (with 0.1 s
# steps a quick start let the retry finish inside its 4 s, and the job saw one preemption)
PREEMPT = ("e2e_spot_preemptions", 120, 40, 0.2)
PREEMPT_AFTER = [4.0, 4.0, None]
STEADY = ("e2e_spot_steady", 100, 50, 0.15)
FAILS = ("e2e_spot_fails", 20, 20, 0.05)
LONG = ("e2e_spot_long", 600, 600, 0.1)
DEFAULT = ("e2e_spot_default", 30, 30, 0.1)
CAPACITY = ("e2e_spot_capacity", 30, 30, 0.1)
#: no spot capacity for the job's first CAPACITY_DOWN_SECONDS (its clock starts at its first launch try)
CAPACITY_DOWN_SECONDS = 20
CAPACITY_TRACE = ROOT + "/capacity_trace.json"


def spot_dag(dag_id: str, total_steps: int, steps_per_segment: int, step_sleep: float, *,
             preempt_after: list | None = None, extra_args: tuple[str, ...] = (), retries: int = 1,
             deferrable: bool | None = True, command: list[str] | None = None,
             preemption: dict | None = None, notice_window_seconds: float = 5.0,
             max_preemptions: int = 4, poll_interval: float = 0.5, warm_process: bool = True,
             segment_options: dict | None = None) -> DAG:
    """One SpotTraining job; ``command``/``preemption`` override the train_tiny command and the schedule."""
    choice = {} if deferrable is None else {"deferrable": deferrable}
    if preemption is None:
        preemption = {"mode": "schedule", "after_seconds": preempt_after} if preempt_after else {"mode": "none"}
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False, tags=["e2e", "spot"]) as dag:
        SpotTraining(
            task_id="train",
            command=command or [
                sys.executable, "-m", "airflow_spot.examples.train_tiny",
                "--total-steps", str(total_steps), "--step-sleep", str(step_sleep),
                "--final-weights", FINAL_WEIGHTS, *extra_args,
            ],
            total_steps=total_steps,
            steps_per_segment=steps_per_segment,
            checkpoint_uri="file://" + JOB_DIR,
            backend="local",
            backend_options={"preemption": preemption, "notice_window_seconds": notice_window_seconds},
            max_preemptions=max_preemptions,
            retries=retries,
            retry_delay=timedelta(seconds=2),
            segment_options={
                "poll_interval": poll_interval,
                "startup_timeout": 60.0,
                "heartbeat_timeout": 30.0,
                "checkpoint_min_interval": 1.0,
                "notice_window_seconds": notice_window_seconds,
                "idle_timeout_seconds": 60.0,
                "warm_process": warm_process,
                **choice,
                **(segment_options or {}),
            },
        )
    return dag


preemptions_dag = spot_dag(*PREEMPT, preempt_after=PREEMPT_AFTER)
steady_dag = spot_dag(*STEADY)
fails_dag = spot_dag(*FAILS, extra_args=("--fail-at-step", "5"), retries=0)
long_dag = spot_dag(*LONG)
default_dag = spot_dag(*DEFAULT, deferrable=None)


def _capacity_trace() -> str:
    """Down, then up for an hour (a trace needs a preemption somewhere: it ends down)."""
    if not os.path.exists(CAPACITY_TRACE):
        os.makedirs(ROOT, exist_ok=True)
        with open(CAPACITY_TRACE, "w") as f:
            json.dump({"metadata": {"gap_seconds": 1},
                       "data": [0] * CAPACITY_DOWN_SECONDS + [1] * 3600 + [0] * 10}, f)
    return CAPACITY_TRACE


# spot only (no deadline) and one try: the outage must be waited out on a timer, not in tries
capacity_dag = spot_dag(
    *CAPACITY, max_preemptions=1, retries=0,
    preemption={"mode": "trace", "path": _capacity_trace(), "capacity": True, "start_offset_seconds": 0},
    segment_options={"capacity_recheck_seconds": 2.0},
)
