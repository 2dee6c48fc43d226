"""A scheduled-retraining team's review of SpotTraining (a helper's review, 2026-11-27): the ordinary Airflow
operations such a team does on an ``@daily`` training DAG -- catchup of several logical dates, clearing a
finished or failed run, marking a segment success by hand, two models trained by one DAG, a templated
command and store -- and what they do to the job's store, its figures and its errors. One test per defect
found, each failing on the code as reviewed.

The DAG runs use the real local backend and ``dag.test()`` (tests/airflow_fixtures.py), with the fast
protocol script as the training command, except where the resume itself matters (the real
``SpotSession`` through ``airflow_spot.examples.train_tiny``). A run's logical date and ``run_after`` are
passed as the scheduler sets them for a catchup run of ``@daily`` (``run_after`` = the interval's end,
long past). ``_clear_and_rerun`` is what a user's "Clear" and the scheduler then do, in this process: the
same task instances, their tries going on, the run's ``start_date`` reset (``dag.test()`` on the same date
would delete the run and make it again instead).
"""
from __future__ import annotations

import os
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from airflow_fixtures import airflow_db, airflow_threads_released, run_dag  # noqa: F401
from airflow_fixtures import FAST_SEGMENT_OPTIONS, backend_options, protocol_command, ti_states, xcom_value

pytestmark = pytest.mark.timeout(180)

DAY1 = datetime(2024, 1, 1, tzinfo=timezone.utc)


def _daily_dag(dag_id: str, root, **kwargs):
    """An ``@daily`` retraining DAG with one SpotTraining job of two 20-step segments (one job root per run)."""
    from airflow.sdk import DAG

    from airflow_spot.operators.training import SpotTraining

    args = dict(task_id="train", command=protocol_command("--step-seconds", "0.01"), total_steps=40,
                steps_per_segment=20, checkpoint_uri=f"file://{root}/jobs/{{{{ run_id }}}}", backend="local",
                backend_options=backend_options(root), retry_delay=timedelta(seconds=0.5),
                segment_options=dict(FAST_SEGMENT_OPTIONS))
    args.update(kwargs)
    with DAG(dag_id, schedule="@daily", start_date=DAY1, catchup=True, max_active_runs=1) as dag:
        SpotTraining(**args)
    return dag


def _run_day(dag, day: datetime, **kwargs):
    """The run of ``day`` as catchup makes it: due at the end of its interval (``run_after``), run now."""
    return run_dag(dag, logical_date=day, run_after=day + timedelta(days=1), **kwargs)


def _clear_and_rerun(dag, dr, task_ids: set[str], timeout: float = 120.0):
    """Clear ``task_ids`` of the finished run ``dr`` (as the UI's Clear does: ``clear_task_instances``, the run
    queued again with its start reset) and run what becomes schedulable, as ``dag.test()``'s loop does."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import clear_task_instances
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils import timezone as tz
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from sqlalchemy import select

    def the_run(session):
        return session.scalar(select(DagRun).where(DagRun.dag_id == dr.dag_id, DagRun.run_id == dr.run_id))

    with create_session() as session:
        run = the_run(session)
        clear_task_instances([ti for ti in run.get_task_instances(session=session) if ti.task_id in task_ids],
                             session, dag_run_state=DagRunState.QUEUED)
    with create_session() as session:  # the scheduler starts the queued run
        run = the_run(session)
        run.state, run.start_date = DagRunState.RUNNING, tz.utcnow()
    scheduler_dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with create_session() as session:
            run = the_run(session)
            run.dag = scheduler_dag
            if run.state != DagRunState.RUNNING:
                return run
            schedulable, _ = run.update_state(session=session)
            for ti in schedulable:
                if ti.state != TaskInstanceState.UP_FOR_RESCHEDULE:
                    ti.try_number += 1
                ti.state = TaskInstanceState.SCHEDULED
            session.commit()
            scheduled = [ti for ti in run.get_task_instances(session=session) if ti.state == TaskInstanceState.SCHEDULED]
        for ti in scheduled:
            try:
                _run_task(ti=ti, task=dag.task_dict[ti.task_id], run_triggerer=True)
            except Exception:  # noqa: BLE001 - a failed task is the run's state, as in dag.test()
                pass
        if not scheduled:
            time.sleep(0.5)
    raise AssertionError(f"the cleared run did not finish within {timeout:.0f} s")


# ---------------------------------------------------------------------------------------------------------
def test_a_string_command_with_a_jinja_expression_renders_as_written(tmp_path):
    """``command`` is documented as "templated" and "a string is shell-split". A retraining DAG written as
    ``command="python train.py --date {{ ds }} --run {{ run_id }}"`` never trains: ``normalize_command``
    (``operators/validation.py``, called by ``SpotTraining`` at parse time) ``shlex.split``s the string
    *before* Airflow renders it, so the Jinja expressions are cut at their spaces into the argv items
    ``'{{'``, ``'ds'``, ``'}}'``; Airflow renders each item of the list on its own, and ``'{{'`` alone is a
    ``TemplateSyntaxError`` ("unexpected 'end of template'"). Every try of every segment then fails while
    its templates are rendered, before anything is launched, with an error that names neither the command
    nor the fix (only ``{{ds}}`` without spaces, or a quoted expression, survives the split). Expected:
    the command renders as written -- ``[python, train.py, --date, 2024-01-01, --run, <run id>]`` -- i.e.
    the string is split after rendering (or the template spans are kept whole when splitting); or, at the
    least, a parse-time ``SpotTrainingConfigError`` that says to pass a list."""
    from airflow.sdk import DAG

    from airflow_spot.operators.training import SpotTraining
    from airflow_spot.operators.validation import SpotTrainingConfigError

    try:
        with DAG("review_string_command", schedule="@daily", start_date=DAY1, catchup=False) as dag:
            SpotTraining(task_id="train", command=f"{sys.executable} train.py --date {{{{ ds }}}} --run {{{{ run_id }}}}",
                         total_steps=40, steps_per_segment=20, checkpoint_uri=f"file://{tmp_path}/jobs/{{{{ run_id }}}}",
                         backend="local", backend_options=backend_options(tmp_path))
    except SpotTrainingConfigError as exc:  # a fix that refuses it must say how to write it
        assert "command" in str(exc) and "list" in str(exc), exc
        return
    segment = dag.task_dict["train.segment_000"]
    segment.render_template_fields({"ds": "2024-01-01", "run_id": "scheduled__2024-01-01T00:00:00+00:00", "dag": dag})
    assert segment.command == [sys.executable, "train.py", "--date", "2024-01-01",
                               "--run", "scheduled__2024-01-01T00:00:00+00:00"], segment.command


def test_two_training_jobs_of_one_dag_do_not_share_one_job_root(airflow_db, tmp_path):  # noqa: F811
    """A retraining DAG that trains two models (here a ranker and an embedder), each a ``SpotTraining`` with
    the README's ``checkpoint_uri=".../{{ dag.dag_id }}/{{ run_id }}"``. Both render to the same job root and
    nothing notices: a segment skips or resumes on whatever checkpoint the store holds, whoever wrote it
    (``SpotSegmentOperator._run_segment``: "already done" when the newest checkpoint is past its end), and
    the finish task sums every ledger row in the store (``SpotJobSummaryOperator.execute``: its filter is the
    DAG run, not the job). In the run, whichever job's ``segment_000`` runs first trains steps 0-20 and the
    other job's ``segment_000`` skips as done; the same happens to ``segment_001`` (20-40, resumed from
    whichever checkpoint is newest): a model is trained partly or wholly by the other job's tasks (with two
    real models: the other's state dict loaded, or a resume that fails on it), both jobs report ``completed``
    with the same final checkpoint for their downstream consumers, and both summaries count both jobs'
    attempts and cost, so the DAG's spend is reported twice. Expected: the second job with the same
    ``checkpoint_uri`` is refused at parse time (``SpotTrainingConfigError`` naming ``checkpoint_uri`` and
    how to tell the jobs apart, e.g. ``/{{ run_id }}/train_ranker``), or, at run time, no job reports
    completed on another job's attempts."""
    from airflow.sdk import DAG

    from airflow_spot.operators.training import SpotTraining
    from airflow_spot.operators.validation import SpotTrainingConfigError

    common = dict(command=protocol_command("--step-seconds", "0.01"), total_steps=40, steps_per_segment=20,
                  checkpoint_uri=f"file://{tmp_path}/models/{{{{ dag.dag_id }}}}/{{{{ run_id }}}}", backend="local",
                  backend_options=backend_options(tmp_path), retry_delay=timedelta(seconds=0.5),
                  segment_options=dict(FAST_SEGMENT_OPTIONS))
    try:
        with DAG("review_two_models", schedule="@daily", start_date=DAY1, catchup=False) as dag:
            SpotTraining(task_id="train_ranker", **common)
            SpotTraining(task_id="train_embedder", **common)
    except SpotTrainingConfigError as exc:
        assert "checkpoint_uri" in str(exc), exc
        return
    dr = _run_day(dag, DAY1)
    for job in ("train_ranker", "train_embedder"):
        summary = xcom_value(dr, f"{job}.finish", "summary")
        assert summary is not None, ti_states(dr)
        rows = summary["rows"]
        others = [r["attempt_id"] for r in rows if not r["attempt_id"].startswith(job + ".")]
        if summary["completed"]:
            assert not others, f"{job}'s summary counts the other job's attempts {others}"
            own_steps = sum(r["steps_done"] for r in rows if r["outcome"] == "completed")
            assert own_steps == 40, f"{job} reports completed, but its own attempts trained {own_steps} of 40 steps"


def test_a_catchup_run_on_a_store_an_earlier_run_finished_says_it_trained_nothing(airflow_db, tmp_path):  # noqa: F811
    """A ``checkpoint_uri`` without ``{{ run_id }}`` (one fixed store for the DAG) makes every run after the
    first train nothing: its segments find the earlier run's final checkpoint and skip. The finish task is
    meant to say so -- ``attempts_this_run`` 0 and the warning "this run trained nothing ... put
    {{ run_id }} in checkpoint_uri" (``test_job_summary.py`` checks it with a run started now). But
    ``SpotJobSummaryOperator.execute`` counts "this run's" attempts as the ledger rows started after the
    run's ``run_after``, and a catchup or backfill run of ``@daily`` is due at the end of its (long past)
    interval: every earlier run's rows started after it. Here the 2024-01-02 run (due 2024-01-03) trained
    nothing, and its summary says ``attempts_this_run == 2`` (day 1's) with no warning, so the team never
    learns that its daily retraining has stopped retraining. The launch records already name their DAG run
    (``AttemptLaunch.run_id``). Expected: ``attempts_this_run`` counts the attempts this run launched (0
    here, by the launch records' run id; the time only for records without one), and the warning is logged."""
    dag = _daily_dag("review_shared_catchup", tmp_path, checkpoint_uri=f"file://{tmp_path}/jobs/fixed")
    first = _run_day(dag, DAY1)
    assert xcom_value(first, "train.finish", "summary")["attempts_this_run"] == 2
    second = _run_day(dag, DAY1 + timedelta(days=1))
    assert ti_states(second)["train.segment_000"][0] == "success"
    summary = xcom_value(second, "train.finish", "summary")
    assert summary["attempts"] == 2  # the store's, all day 1's
    # 0 is what makes the finish task warn "this run trained nothing" (the task log; not captured here, where
    # an earlier test of a session may have configured logging elsewhere)
    assert summary["attempts_this_run"] == 0, summary["attempts_this_run"]


def test_steps_trained_across_a_gap_left_by_a_segment_marked_success_are_counted(airflow_db, tmp_path):  # noqa: F811
    """A segment marked success by hand (here ``segment_001`` before it ran; the same happens to one marked
    success while it trains, whose kill leaves its last checkpoint short of its end, and to a run whose DAG
    was edited to longer segments while it ran, or cleared onto such a version) leaves the job's newest
    checkpoint short of the next segment's ``start_step``. That segment trains the gap too: ``SpotSession``
    resumes from the newest checkpoint (10 here) and trains to its end (30). But ``_run_segment``
    (``operators/segment.py``) records the attempt's ``resume_step`` as ``max(latest, start_step)`` (20),
    although ``AttemptLaunch.resume_step`` is documented as "the job's newest committed step when the
    attempt was requested (where it resumes)", and the ledger row's ``steps_done`` is
    ``committed - resume_step``: 10 steps of the 20 trained. The job summary then says 20 steps done for a
    30-step job that completed, the work's pace and ``useful_step_seconds`` are understated and the unpaid-for
    steps show up as lost GPU time. Expected: ``resume_step`` is the newest committed step (or 0), so the
    row counts the 20 steps the attempt trained and the summary's ``steps_done`` is 30."""
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    command = [sys.executable, "-m", "airflow_spot.examples.train_tiny", "--total-steps", "30", "--hidden", "8"]
    dag = _daily_dag("review_marked_gap", tmp_path, command=command, total_steps=30, steps_per_segment=10)
    dr = _run_day(dag, DAY1, mark_success_pattern=r"train\.segment_001")
    states = ti_states(dr)
    assert states["train.segment_002"][0] == "success" and states["train.finish"][0] == "success", states
    summary = xcom_value(dr, "train.finish", "summary")
    assert summary["completed"] and summary["latest_step"] == 30
    row = next(r for r in summary["rows"] if r["attempt_id"].startswith("train.segment_002."))
    beat = JobLayout(open_store(summary["job_uri"])).read_heartbeat(row["attempt_id"])
    resumed_from = beat.first_step - 1  # the session's first step after its restore
    assert resumed_from == 10, beat  # it trained the gap: 10 -> 30
    assert row["steps_done"] == 30 - resumed_from, row
    assert summary["steps_done"] == 30, summary["steps_done"]


def test_a_finish_after_a_segment_marked_success_says_which_segment_to_clear(airflow_db, tmp_path):  # noqa: F811
    """The team marks the last segment success by hand (to unblock a run, or by mistake on the wrong row):
    no segment failed, yet the job is short of ``total_steps``, and the finish task fails (as documented) with
    "job train did not finish: newest checkpoint at step 20 of 40 steps (see the failed segment's log)"
    (``SpotJobSummaryOperator.execute``). There is no failed segment and its log does not exist: the message
    sends the team looking for a failure instead of saying what happened and what to do. The same message
    comes after a DAG edit that lengthened the segments of a run in flight. The store tells the finish task
    which segment the job stopped in (the newest checkpoint's step, the segments' bounds) and that no
    attempt of it ran in this run. Expected: the error names that segment (``segment_001`` / segment 1,
    steps [20, 40)), that it ended without its checkpoint, and to clear it to train the rest, not a failed
    segment's log."""
    dag = _daily_dag("review_last_marked", tmp_path)
    dr = _run_day(dag, DAY1, mark_success_pattern=r"train\.segment_001")
    states = ti_states(dr)
    assert states["train.segment_001"][0] == "success" and states["train.finish"][0] == "failed", states
    summary = xcom_value(dr, "train.finish", "summary")
    assert summary["latest_step"] == 20 and not summary["completed"], summary
    # the message the finish task fails with (its log is not captured here, where an earlier test of a
    # session may have configured logging elsewhere), for the step it stopped at
    message = dag.task_dict["train.finish"]._unfinished_message(summary["latest_step"])
    assert "segment_001" in message or "segment 1" in message, message
    assert "failed segment" not in message, message
    assert "clear" in message.lower(), message


def test_clearing_a_finished_run_records_its_overheads_once(airflow_db, tmp_path):  # noqa: F811
    """Each finished job appends the overheads it measured to the DAG's and the deployment's history
    (``storage/overhead_history.py``: "one object per job"); later runs' estimates take, per figure, the
    median of the newest ten jobs. Clearing a finished run (to rerun a downstream task, or the whole run)
    re-runs its finish task, whose ``_record_overheads`` (``operators/training.py``) appends the same job
    again under a new time: the store's figures are unchanged (the segments skip), but the history now holds
    this job twice, and once more at every clear, so its figures outvote the other runs' in the priors and
    push them out of the kept 50. Expected: a job is recorded once (its entry replaced, or the append skipped
    when the history already holds that job)."""
    from airflow_spot.storage.overhead_history import ENV_URI

    dag = _daily_dag("review_clear_finished", tmp_path)
    first = _run_day(dag, DAY1)
    before = xcom_value(first, "train.finish", "summary")
    history = os.environ[ENV_URI][len("file://"):]
    assert len(os.listdir(history)) == 1
    run = _clear_and_rerun(dag, first, {"train.segment_000", "train.segment_001", "train.finish"})
    states = ti_states(run)
    assert states["train.finish"] == ("success", 2), states
    after = xcom_value(run, "train.finish", "summary")
    assert (after["cost"], after["attempts"], after["steps_done"]) == (before["cost"], before["attempts"],
                                                                      before["steps_done"])  # sound
    entries = sorted(os.listdir(history))
    assert len(entries) == 1, f"the cleared run's job is in the overhead history {len(entries)} times: {entries}"


def test_a_templated_availability_uri_is_rendered(airflow_db, tmp_path):  # noqa: F811
    """``segment_options={"availability_uri": ...}`` places the deployment's availability log; a team that
    keeps one log per DAG in a shared bucket writes it as ``checkpoint_uri`` is written,
    ``.../{{ dag.dag_id }}/_availability``. ``availability_uri`` is neither a template field of
    ``SpotSegmentOperator`` nor of ``SpotJobSummaryOperator`` (``template_fields`` hold ``checkpoint_uri``
    but not it), and nothing checks it at parse time: every launch and refusal is written under a folder
    literally named ``{{ dag.dag_id }}``, one folder for every DAG written this way (the per-DAG logs the
    team asked for are one mixed log, with nothing in the task logs to say so), and each finish task compacts
    that folder. Expected: it is rendered like ``checkpoint_uri`` (the events land in
    ``<root>/<dag_id>/_availability``), or refused at parse time saying it is not templated."""
    from airflow_spot.operators.validation import SpotTrainingConfigError

    options = {**FAST_SEGMENT_OPTIONS, "availability_uri": f"file://{tmp_path}/logs/{{{{ dag.dag_id }}}}/_availability"}
    try:
        dag = _daily_dag("review_templated_log", tmp_path, segment_options=options)
    except SpotTrainingConfigError as exc:
        assert "availability_uri" in str(exc), exc
        return
    dr = _run_day(dag, DAY1)
    assert ti_states(dr)["train.finish"][0] == "success", ti_states(dr)
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["review_templated_log"], sorted(p.name for p in logs.iterdir())
    assert any(p.suffix == ".json" for p in (logs / "review_templated_log" / "_availability").rglob("*"))


def test_a_dag_rendering_native_objects_passes_numbers_in_its_command(tmp_path):
    """``render_template_as_native_obj=True`` renders ``"{{ params.epochs }}"`` to the int 5; the rendered
    command was refused ("a non-empty list of strings") at every try. Numbers are passed as their text."""
    from airflow.sdk import DAG

    from airflow_spot.operators.segment import SpotSegmentOperator

    with DAG("review_native", schedule=None, start_date=DAY1, render_template_as_native_obj=True,
             params={"epochs": 5}) as dag:
        op = SpotSegmentOperator(task_id="segment", command=[sys.executable, "-c", "pass", "{{ params.epochs }}"],
                                 checkpoint_uri=f"file://{tmp_path}/job", start_step=0, end_step=10, total_steps=10,
                                 backend="local", backend_options=backend_options(tmp_path))
    op.render_template_fields({"params": {"epochs": 5}, "dag": dag, "run_id": "r"})
    assert op.command[-1] == 5  # as Airflow rendered it
    op._check_command()
    assert op.command == [sys.executable, "-c", "pass", "5"]
