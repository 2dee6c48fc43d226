"""A new DAG author's journey through SpotTraining (a helper's review, 2026-11-27): defects a real user hit,
one test each, failing on the code as reviewed and passing since.

The DAG runs use the real local backend and ``dag.test()`` (tests/airflow_fixtures.py), with the fast
protocol script as the training command; the parse-time tests build the DAG the way a DAG file does.
"""
from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timedelta

import pytest

from airflow_fixtures import airflow_db, airflow_threads_released, run_dag  # noqa: F401
from airflow_fixtures import FAST_SEGMENT_OPTIONS, backend_options, build_dag, protocol_command, ti_states


def _parse(tmp_path, dag_id: str, **kwargs):
    """Build the DAG as the DAG processor would (SpotTraining validates here)."""
    from airflow.sdk import DAG

    from airflow_spot.operators.training import SpotTraining

    args = dict(task_id="train", command=protocol_command(), total_steps=1000, steps_per_segment=100,
                gpus={"count": 1, "min_memory_gib": 16}, checkpoint_uri=f"file://{tmp_path}/jobs/{{{{ run_id }}}}",
                backend="local", backend_options={"state_dir": str(tmp_path / "instances")})
    args.update(kwargs)
    with DAG(dag_id, schedule=None, start_date=datetime(2024, 1, 1), catchup=False) as dag:
        SpotTraining(**args)
    return dag


def test_a_deadline_within_the_default_restart_does_not_crash_the_first_segment(airflow_db, tmp_path):  # noqa: F811
    """A job with ``deadline=timedelta(minutes=5)`` and no ``step_profile`` fails every try of its first
    segment with ``ZeroDivisionError``. Mechanism: before any heartbeat, ``operators/planning.plan`` takes
    the "unknown speed" branch (Uniform Progress line only) and ``policy/deadline.planned_progress``
    computes ``end = max(deadline_at - restart_overhead_seconds, started_at + 1e-9)``; with the default
    600 s restart past the deadline, ``end`` is ``started_at + 1e-9``, which a ~1.8e9 epoch float cannot
    hold, so ``end - started_at == 0.0`` and ``(now - started_at) / 0.0`` raises (Airflow retries it as an
    unknown error, then the run fails with nothing trained). The same happens with a declared
    ``restart_overhead_seconds`` at or past the deadline. Expected: a deadline the restart leaves no room
    for is behind the line from the start (fraction 1: go on-demand, saying so), and the job trains."""
    dag = build_dag(
        "review_short_deadline", tmp_path, command=protocol_command("--step-seconds", "0.02"),
        total_steps=20, steps_per_segment=10, max_preemptions=0, retries=0,
        deadline=timedelta(minutes=5), backend_options=backend_options(tmp_path),
        segment_options=dict(FAST_SEGMENT_OPTIONS),
    )
    started = time.monotonic()
    dr = run_dag(dag)
    states = ti_states(dr)
    assert time.monotonic() - started < 120
    assert states["train.segment_000"][0] == "success", states
    assert str(getattr(dr.state, "value", dr.state)) == "success", states
    # the summary says whether the deadline was met
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    summary = json.loads(open_store(f"file://{tmp_path}/jobs/{dr.run_id}").get_bytes(JobLayout.SUMMARY_KEY))
    assert summary["deadline_met"] is True and summary["elapsed_seconds"] <= 300, summary


def test_an_infinite_restart_overhead_is_refused_at_parse_time(tmp_path):
    """``segment_options={"restart_overhead_seconds": float("inf")}`` (e.g. a computed figure that
    overflowed, or "never restart" meant as infinity) passes ``_check_segment_numbers`` in
    ``operators/training.py``: its test ``not value > 0`` is False for ``inf`` (``nan`` is refused). At run
    time every try of the first segment with a deadline then fails with ``ZeroDivisionError`` in
    ``policy/deadline.planned_progress`` (``deadline_at - inf``). ``simulate`` refuses the same figure
    (``--restart-overhead-hours must be a finite number, got inf``, exit 2). Expected: a
    ``SpotTrainingConfigError`` at parse time naming the option (every ``_SECONDS_OPTIONS`` value should be
    finite, or inf documented as "no limit" where it means that)."""
    from airflow_spot.operators.validation import SpotTrainingConfigError

    with pytest.raises(SpotTrainingConfigError, match="restart_overhead_seconds"):
        _parse(tmp_path, "review_inf_restart", deadline=timedelta(hours=1),
               segment_options={"restart_overhead_seconds": float("inf")})


@pytest.mark.parametrize("bad, word", [
    ({"preemption": {"mode": "schedule", "after": [4, 4]}}, "after_seconds"),  # a key typo inside preemption
    ({"preemption": {"mode": "sometimes"}}, "mode"),
    ({"preemption": {"mode": "schedule", "after_seconds": "4,4"}}, "after_seconds"),
    ({"notice_window_seconds": "2"}, "notice_window_seconds"),
])
def test_a_wrong_local_backend_option_is_refused_at_parse_time(tmp_path, bad, word):
    """The README promises that an unknown key of ``backend_options`` is an error at parse time, and the
    local backend checks its options with clear messages (``PreemptionConfig.from_kwargs``, ``_number`` in
    ``backends/local.py``), but only when the backend is built on a worker: ``validate_option_names``
    (called by ``SpotSegmentOperator.__init__``) checks the top-level key names only, so a typo inside
    ``preemption`` (``after`` for ``after_seconds``), an unknown mode, or a string for a number parses
    fine. Run, the first segment's ``hook.get_backend()`` raises ``ValueError`` at every try; Airflow
    retries it ``max_preemptions + retries`` times (11 retries, ``retry_delay`` apart, by default) as an unknown error,
    then the finish task fails on the same ValueError. Expected: the backend's own check run on
    ``backend_options`` at parse time (e.g. a ``Backend.options_problem`` classmethod next to
    ``command_problem``), raised as ``SpotTrainingConfigError`` naming the key."""
    from airflow_spot.operators.validation import SpotTrainingConfigError

    options = {"state_dir": str(tmp_path / "instances"), **bad}
    with pytest.raises(SpotTrainingConfigError, match=word):
        _parse(tmp_path, "review_backend_options", backend_options=options)


def test_a_deadline_shorter_than_the_declared_work_is_flagged_at_parse_time(tmp_path, caplog):
    """A job that declares its pace (``step_profile``) and a deadline that pace cannot meet parses
    silently: 10,000 steps at a declared 1 s per step on T4 (0.2 s predicted on L40S, the fastest 1-GPU type
    the catalog offers: 2,000 s of work at best) cannot finish in one minute. ``SpotTraining`` checks only that ``deadline`` is a
    positive timedelta (``validate_deadline``); at run time the first plan logs
    ``on-demand (safety net: slack -NNNs <= ...)`` and the job runs on on-demand at full price past its
    deadline, and the finish summary says nothing of the deadline. ``simulate`` refuses the same job
    (``--deadline-hours ... cannot be met by any policy ... the smallest feasible deadline is ...``).
    Expected: at parse time, when ``step_profile`` is declared, compare ``total_steps`` x the profile's
    prediction on the fastest offer of the request (``planning.profile_step_seconds``, catalog only) with
    the deadline and raise ``SpotTrainingConfigError`` (or at least log a warning) naming the smallest
    feasible deadline."""
    from airflow_spot.operators.validation import SpotTrainingConfigError

    caplog.set_level(logging.WARNING)
    try:
        _parse(tmp_path, "review_infeasible_deadline", total_steps=10_000, steps_per_segment=1000,
               deadline=timedelta(minutes=1), segment_options={"step_profile": {"T4": 1.0}})
    except SpotTrainingConfigError as exc:
        assert "deadline" in str(exc)
        return
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "deadline" in r.getMessage()]
    assert warned, "a deadline the declared step_profile cannot meet parsed without an error or a warning"


def test_the_logged_job_summary_shows_the_gpu_hours_lost(tmp_path):
    """The README says the finish task writes the job summary — "cost, on-demand cost of the same work,
    savings, preemptions, steps and GPU hours lost" — to the store, the log and XCom. The store and XCom
    hold ``lost_gpu_hours`` (``policy/ledger.summarize``), but the log's rendering, ``format_summary`` in
    ``operators/training.py``, prints steps lost and never GPU hours lost: a preempted attempt's billed
    minute shows up only as a cost. Expected: ``format_summary`` prints a lost GPU hours line (the
    ``lost_gpu_hours`` field), as the README promises."""
    from airflow_spot.operators import accounting
    from airflow_spot.operators.training import format_summary
    from airflow_spot.policy.ledger import LedgerRow
    from airflow_spot.storage.ledger_store import LedgerStore
    from airflow_spot.storage.object_store import open_store

    store = open_store(f"file://{tmp_path}/job")
    now = time.time()
    LedgerStore(store).write(LedgerRow(
        attempt_id="train.segment_000.try1", instance_id="i-1", instance_type="g5.xlarge", zone="use1-az1",
        market="spot", price_per_hour=0.5, on_demand_price_per_hour=1.0, started_at=now - 3600, ended_at=now,
        steps_done=100, outcome="preempted", steps_lost=100, step_seconds=18.0, segment_index=0))
    summary = accounting.summarize(store, now=now)
    assert summary["lost_gpu_hours"] == pytest.approx(0.5, abs=1e-3)
    text = format_summary({**summary, "segments": 1, "latest_step": 100, "total_steps": 200})
    assert "gpu hours lost" in text.lower() or "lost gpu" in text.lower(), text


def test_the_summary_says_whether_the_deadline_was_met(tmp_path):
    """The finish task's summary (store, log, XCom) carries the deadline and whether the last step committed
    within it; a job neither done nor late says neither."""
    from airflow_spot.operators.training import deadline_figures, format_summary
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    store = open_store(f"file://{tmp_path}/job")
    t0 = 1_800_000_000.0
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": t0}).encode())
    rows = [{"outcome": "preempted", "ended_at": t0 + 3000}, {"outcome": "completed", "ended_at": t0 + 7000}]
    met = deadline_figures(store, {"completed": True, "rows": rows}, 7200.0, t0 + 9000)
    assert (met["deadline_met"], met["elapsed_seconds"]) == (True, 7000.0)
    assert "deadline            met" in format_summary(met)
    late = deadline_figures(store, {"completed": True, "rows": rows}, 6000.0, t0 + 9000)
    assert late["deadline_met"] is False and "MISSED" in format_summary(late)
    early_failure = deadline_figures(store, {"completed": False, "rows": rows[:1]}, 7200.0, t0 + 3600)
    assert early_failure["deadline_met"] is None and "not reached" in format_summary(early_failure)
    assert deadline_figures(store, {"completed": False, "rows": []}, 3600.0, t0 + 9000)["deadline_met"] is False
