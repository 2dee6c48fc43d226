"""Retry semantics under real Airflow (dag.test) on the real local backend.

Preemptions and user-code failures have separate budgets: a job survives many preemptions with no
code retries at all, a broken script stops after its small budget, and an exhausted preemption budget
stops retrying although Airflow would allow more tries. After each run no instance process is left.
"""
from __future__ import annotations

import pytest

from airflow_fixtures import airflow_db, airflow_threads_released, run_dag  # noqa: F401
from airflow_fixtures import (
    backend_options,
    build_dag,
    job_store,
    leftover_processes,
    protocol_command,
    summary,
    ti_states,
)

pytestmark = pytest.mark.timeout(300)


def test_many_preemptions_need_no_code_retries(airflow_db, tmp_path):  # noqa: F811
    dag = build_dag(
        "budget_preemptions",
        tmp_path,
        # segment 0 alone is >= 6 s of work against instances that each live 1 s: all four preemptions
        # must hit it (none can be dodged by finishing a segment between a notice and its kill)
        command=protocol_command("--step-seconds", "0.03"),
        total_steps=300,
        steps_per_segment=200,
        backend_options=backend_options(tmp_path, [1.0, 1.0, 1.0, 1.0, None]),
        max_preemptions=4,
        retries=0,
    )
    dr = run_dag(dag)
    states = ti_states(dr)
    assert str(getattr(dr.state, "value", dr.state)) == "success", states
    s = summary(tmp_path, dr.run_id)
    assert s["completed"] and s["latest_step"] == 300
    assert s["preemptions"] == 4 and s["failures"] == 0
    # every preempted attempt saved on its notice: the next one resumed where it stopped
    assert s["steps_lost"] == 0
    assert sum(r["steps_done"] for r in s["rows"]) == 300
    # segment 1 ran on segment 0's warm instance, whose bill continues without a gap or a new minimum
    warm = [r for r in s["rows"] if not r["new_instance"]]
    assert len(warm) == 1 and warm[0]["segment_index"] == 1
    before = [r for r in s["rows"] if r["instance_id"] == warm[0]["instance_id"] and r is not warm[0]]
    assert warm[0]["started_at"] == max(r["ended_at"] for r in before)
    assert not leftover_processes(tmp_path)


def test_broken_script_fails_after_its_small_budget(airflow_db, tmp_path):  # noqa: F811
    dag = build_dag(
        "budget_code",
        tmp_path,
        command=protocol_command("--fail", "bad learning rate schedule"),
        total_steps=100,
        steps_per_segment=50,
        backend_options=backend_options(tmp_path),
        max_preemptions=5,
        retries=1,
    )
    dr = run_dag(dag)
    states = ti_states(dr)
    seg_state, seg_try = states["train.segment_000"]
    # Airflow would allow 1 + 5 + 1 tries; the code budget (1 retry) stopped it at the second
    assert seg_state == "failed" and seg_try == 2, states
    assert states["train.segment_001"][0] == "upstream_failed"
    assert states["train.finish"][0] == "failed"  # ran (ALL_DONE), cleaned up, reported the job unfinished
    s = summary(tmp_path, dr.run_id)
    assert s["failures"] == 2 and s["preemptions"] == 0 and not s["completed"]
    from airflow_spot.storage.protocol import JobLayout

    status = JobLayout(job_store(tmp_path, dr.run_id)).read_status("train.segment_000.try2")
    assert "bad learning rate schedule" in status.error_tail
    assert not leftover_processes(tmp_path)


def test_exhausted_preemption_budget_stops_retrying(airflow_db, tmp_path):  # noqa: F811
    dag = build_dag(
        "budget_exhausted",
        tmp_path,
        command=protocol_command("--step-seconds", "0.05"),
        total_steps=400,
        steps_per_segment=400,
        backend_options=backend_options(tmp_path, [1.0, 1.0, 1.0, 1.0]),
        max_preemptions=1,
        retries=2,
    )
    dr = run_dag(dag)
    states = ti_states(dr)
    # Airflow retries = 1 + 2 = 3, yet the second preemption (> max_preemptions=1) ended it
    assert states["train.segment_000"] == ("failed", 2), states
    s = summary(tmp_path, dr.run_id)
    assert s["preemptions"] == 2 and s["failures"] == 0
    assert 0 < s["latest_step"] < 400  # progress was kept across the preemption
    assert not leftover_processes(tmp_path)


def test_a_run_created_again_with_the_same_run_id_starts_afresh(airflow_db, tmp_path):  # noqa: F811
    from datetime import datetime, timezone

    from airflow_spot.storage.protocol import JobLayout

    dag = build_dag(
        "budget_recreated",
        tmp_path,
        command=protocol_command("--step-seconds", "0.05"),
        total_steps=400,
        steps_per_segment=400,
        backend_options=backend_options(tmp_path, [1.0, 1.0, 1.0, 1.0]),
        max_preemptions=1,
        retries=2,
    )
    when = datetime.now(timezone.utc).replace(microsecond=0)
    first = run_dag(dag, logical_date=when, run_after=when)
    assert ti_states(first)["train.segment_000"] == ("failed", 2)
    # dag.test on the same dates makes the run again: same run id, same job root, tries from 1
    again = run_dag(dag, logical_date=when, run_after=when)
    assert again.run_id == first.run_id
    # its tries got attempt ids of their own (the old try1's status must not end the new try1) ...
    layout = JobLayout(job_store(tmp_path, again.run_id))
    attempts = [k.split("/")[2] for k in layout.store.list("control/attempts/") if k.endswith("/launch.json")]
    assert len(attempts) == len(set(attempts)) == 4
    assert {"train.segment_000.try1", "train.segment_000.try2"} < set(attempts)
    # ... and a fresh budget: one preemption survived (try 1), the second (try 2) ended it; counting the
    # old run's two preemptions it would have failed at once, at try 1
    assert ti_states(again)["train.segment_000"] == ("failed", 2), ti_states(again)
    assert summary(tmp_path, again.run_id)["preemptions"] == 4
    assert not leftover_processes(tmp_path)
