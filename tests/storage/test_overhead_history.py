"""The deployment's overhead history: what finished jobs measured, the prior of a new job's estimate."""
from __future__ import annotations

import json

import pytest

from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.overhead_history import (
    DEFAULT_DIR, ENV_URI, NEWEST, OverheadHistory, history_uris, job_name, prior_for, record,
)


def test_a_job_belongs_to_its_dags_history_and_to_the_deployments_when_one_is_named():
    env: dict[str, str] = {}
    assert history_uris("s3://bucket/train_dag/run_1", env) == [f"s3://bucket/train_dag/{DEFAULT_DIR}"]
    assert history_uris("file:///data/jobs/dag/run_2/", env) == [f"file:///data/jobs/dag/{DEFAULT_DIR}"]
    assert history_uris("s3://bucket", env) == [f"s3://bucket/{DEFAULT_DIR}"]  # a job at the bucket's root
    shared = {ENV_URI: "s3://shared/overheads"}
    assert history_uris("s3://bucket/dag/run", shared) == [f"s3://bucket/dag/{DEFAULT_DIR}", "s3://shared/overheads"]
    # the deployment's history named as the DAG's own place is one history, not two
    assert history_uris("s3://bucket/dag/run", {ENV_URI: f"s3://bucket/dag/{DEFAULT_DIR}/"}) == [
        f"s3://bucket/dag/{DEFAULT_DIR}"]
    # the run, and a digest of the whole root: two DAGs' runs of one date are two jobs in the deployment's history
    assert job_name("s3://bucket/dag/manual__2026-11-24/").startswith("manual__2026-11-24.")
    assert job_name("s3://bucket/dag/manual__2026-11-24/") == job_name("s3://bucket/dag/manual__2026-11-24")
    assert job_name("s3://bucket/dag/manual__2026-11-24") != job_name("s3://bucket/other/manual__2026-11-24")


def test_a_dags_first_run_borrows_from_the_deployment_what_its_dags_runs_have_not_measured(tmp_path, monkeypatch):
    from airflow_spot.storage import overhead_history

    monkeypatch.setattr(overhead_history, "history_uris", history_uris)  # the real places (conftest narrows them)
    monkeypatch.setenv(ENV_URI, f"file://{tmp_path}/deployment")
    job = open_store(f"file://{tmp_path}/jobs/train_dag/run_2")
    assert prior_for(job) == {}  # nothing recorded anywhere yet
    # an earlier run of the same DAG records in both: the DAG's history and the deployment's
    record(open_store(f"file://{tmp_path}/jobs/train_dag/run_1"), "run_1", 100.0, {"startup": 30.0})
    assert OverheadHistory(open_store(f"file://{tmp_path}/jobs/train_dag/{DEFAULT_DIR}")).prior() == {"startup": 30.0}
    assert OverheadHistory(open_store(f"file://{tmp_path}/deployment")).prior() == {"startup": 30.0}
    # another DAG (another model: a slower restore) measured more
    record(open_store(f"file://{tmp_path}/jobs/other_dag/run_9"), "run_9", 200.0,
           {"startup": 90.0, "warm_boundary": 0.7})
    # the DAG's own runs win where they measured; the deployment fills in the rest
    assert prior_for(job, exclude_job="run_2") == {"startup": 30.0, "warm_boundary": 0.7}
    # a new DAG's first run has only the deployment's figures
    assert prior_for(open_store(f"file://{tmp_path}/jobs/new_dag/run_1")) == {
        "startup": 60.0, "warm_boundary": 0.7}
    # an unreadable history is skipped: the other still answers
    monkeypatch.setenv(ENV_URI, "ftp://nowhere/overheads")
    assert prior_for(job) == {"startup": 30.0}
    with pytest.raises(Exception):
        record(job, "run_2", 300.0, {"startup": 31.0})  # the deployment's could not take it; the error is raised
    assert OverheadHistory(open_store(f"file://{tmp_path}/jobs/train_dag/{DEFAULT_DIR}")).prior(newest=1) == {
        "startup": 31.0}  # after the DAG's history took it


def test_prior_is_the_median_per_field_of_the_newest_jobs_other_than_the_reader(tmp_path):
    history = OverheadHistory(open_store(f"file://{tmp_path}"))
    history.append("run_a", 100.0, {"warm_boundary": 0.6, "startup": 3.0})
    history.append("run_b", 200.0, {"warm_boundary": 0.8})
    history.append("run_c", 300.0, {"warm_boundary": 5.0, "last_finish": 0.7})
    assert history.prior() == {"warm_boundary": 0.8, "startup": 3.0, "last_finish": 0.7}
    # the reading job's own entry is not its prior
    assert history.prior(exclude_job="run_c") == {"warm_boundary": pytest.approx(0.7), "startup": 3.0}
    # only the newest jobs count: a deployment that changed its image follows
    assert history.prior(newest=1) == {"warm_boundary": 5.0, "startup": 3.0, "last_finish": 0.7}
    assert NEWEST >= 5


def test_only_known_finite_non_negative_fields_are_kept_and_an_empty_record_is_not_written(tmp_path):
    store = open_store(f"file://{tmp_path}")
    history = OverheadHistory(store)
    assert history.append("run_a", 1.0, {"lost_per_preemption": 3.0, "tail": 1.0}) is None  # the job's own
    key = history.append("run_b", 2.0, {"warm_boundary": float("nan"), "finish": -1.0, "gap_after_boundary": 0.2})
    assert json.loads(store.get_bytes(key))["overheads"] == {"gap_after_boundary": 0.2}
    assert store.list("") == [key]


def test_unreadable_or_newer_entries_are_skipped(tmp_path):
    store = open_store(f"file://{tmp_path}")
    history = OverheadHistory(store)
    history.append("run_a", 1.0, {"warm_boundary": 0.5})
    store.put_bytes("0000000000002.000-run_b.json", b"{not json")
    store.put_bytes("0000000000003.000-run_c.json", json.dumps(
        {"schema": 99, "job": "run_c", "at": 3.0, "overheads": {"warm_boundary": 9.0}}).encode())
    store.put_bytes("0000000000004.000-run_d.json", json.dumps({"schema": 1, "overheads": "?"}).encode())
    assert history.prior() == {"warm_boundary": 0.5}
    assert OverheadHistory(open_store(f"file://{tmp_path}/empty")).prior() == {}


def test_the_history_keeps_only_the_newest_entries(tmp_path):
    store = open_store(f"file://{tmp_path}")
    history = OverheadHistory(store)
    for i in range(7):
        history.append(f"run_{i}", 100.0 + i, {"warm_boundary": float(i)}, keep=3)
    assert sorted(store.list("")) == [f"0000000000{100 + i}.000-run_{i}.json" for i in (4, 5, 6)]
    assert history.prior() == {"warm_boundary": 5.0}
