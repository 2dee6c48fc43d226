"""The DAG files import cleanly, and the demo trains through >= 3 preemptions to bit-identical weights."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_fixtures import airflow_db, airflow_threads_released, run_dag  # noqa: F401

DAGS = Path(__file__).resolve().parents[2] / "dags"


def test_dag_files_import_without_errors():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    assert {"spot_training_demo", "spot_retraining"} <= set(bag.dag_ids)
    retraining = bag.dags["spot_retraining"]
    assert retraining.task_dict["train.segment_000"].warm_start_uri.startswith("{{ ti.xcom_pull")
    assert {"evaluate", "promote"} <= set(retraining.task_dict)


@pytest.mark.timeout(300)
def test_demo_survives_three_preemptions_with_identical_weights(airflow_db, tmp_path):  # noqa: F811
    import torch

    from airflow_spot.demo import FINAL_WEIGHTS, build_demo_dag, job_dir, read_summary, train_command
    from airflow_fixtures import leftover_processes

    total = 300
    dag = build_demo_dag(
        dag_id="spot_training_demo_test",
        root=tmp_path,
        total_steps=total,
        steps_per_segment=150,
        step_sleep=0.03,
        # An instance that finishes its segment between its notice and its kill is not preempted and
        # not reused; at most one per segment boundary (one here) can dodge, so 4 planned give >= 3.
        preemption_schedule=(3.5, 3.5, 3.5, 3.5, None),
        max_preemptions=8,
    )
    dr = run_dag(dag)
    assert str(getattr(dr.state, "value", dr.state)) == "success"
    s = read_summary(tmp_path, dag.dag_id, dr.run_id)
    assert s["preemptions"] >= 3 and s["completed"] and s["latest_step"] == total
    assert not leftover_processes(tmp_path)
    # the summary taught the DAG's later runs what this one's overheads were (storage/overhead_history.py)
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.overhead_history import ENV_URI, OverheadHistory

    learnt = OverheadHistory(open_store(os.environ[ENV_URI])).prior()
    assert {"startup", "gap_after_preemption"} <= set(learnt) and learnt["startup"] > 0

    reference = tmp_path / "reference.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_")}
    cmd = train_command(total, 0.0, str(reference)) + ["--job-uri", str(tmp_path / "reference-job")]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=240)
    got = torch.load(job_dir(tmp_path, dag.dag_id, dr.run_id) / FINAL_WEIGHTS)
    want = torch.load(reference)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_demo_can_use_a_random_preemption_rate(tmp_path):
    from airflow_spot.backends.base import get_backend
    from airflow_spot.demo import build_demo_dag

    dag = build_demo_dag(root=tmp_path, preemption={"mode": "rate", "mtbf_seconds": 60.0, "seed": 1})
    options = dag.task_dict["train.segment_000"].backend_options
    assert options["preemption"] == {"mode": "rate", "mtbf_seconds": 60.0, "seed": 1}
    assert get_backend("local", **options).serialize()["preemption"]["mode"] == "rate"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--total-steps", "0"], "--total-steps must be between 1 and 1000000"),
        (["--steps-per-segment", "700"], "steps_per_segment=700 is larger than total_steps=600"),
        (["--preempt-after", "soon"], "expected comma-separated seconds"),
    ],
)
def test_demo_command_rejects_bad_arguments(tmp_path, args, message):
    out = subprocess.run(
        [sys.executable, "-m", "airflow_spot.cli", "demo", "--out", str(tmp_path / "out"), *args],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and message in out.stderr
    assert not (tmp_path / "out" / "airflow" / "airflow.db").exists()  # failed before touching a DB
