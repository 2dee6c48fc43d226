"""The finish task on its own: what it terminates, what it says of a run that trained nothing."""
from __future__ import annotations

import time
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from airflow_spot.backends.base import InstanceInfo, InstanceState
from airflow_spot.hooks.spot import SpotHook
from airflow_spot.operators.training import SpotJobSummaryOperator
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout

OFFER = Offer("g5.xlarge", "us-east-1", "us-east-1a", Market.SPOT, 0.5, 1.0, "A10G", 1, 24.0)


class FakeBackend:
    """What the finish task asks of a backend; EC2 reports a stopped instance terminated, and lists it
    among ``stopped_instances`` (its volumes bill until it is terminated)."""

    def __init__(self):
        self.terminated: list[str] = []

    def list_instances(self, tags=None):
        return [InstanceInfo("i-running", InstanceState.RUNNING, OFFER, "file:///job"),
                InstanceInfo("i-stopped", InstanceState.TERMINATED, OFFER, "file:///job"),
                InstanceInfo("i-gone", InstanceState.TERMINATED, OFFER, "file:///job")]

    def stopped_instances(self, tags=None):
        return [InstanceInfo("i-stopped", InstanceState.TERMINATED, OFFER, "file:///job", launched_at=0.0)]

    def terminate(self, ids):
        self.terminated += list(ids)


def run_finish(tmp_path, monkeypatch, run_started: float, rows_started: list[float], latest: int | None):
    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    if latest is not None:
        JobLayout(store).checkpoint_store().save(latest, lambda f: f.write(b"state"))
    for n, started in enumerate(rows_started):
        LedgerStore(store).write(LedgerRow(
            attempt_id=f"s.try{n}", instance_id="i-old", instance_type="g5.xlarge", zone="us-east-1a",
            market="spot", price_per_hour=0.5, on_demand_price_per_hour=1.0, started_at=started,
            ended_at=started + 60, steps_done=10, outcome="completed", segment_index=0))
    backend = FakeBackend()
    monkeypatch.setattr(SpotHook, "get_backend", lambda self: backend)
    op = SpotJobSummaryOperator(task_id="finish", checkpoint_uri=uri, job_name="train", total_steps=10, segments=1)
    op._compact_availability = lambda hook, store: None
    pushed = {}
    context = {"run_id": "r", "ti": SimpleNamespace(xcom_push=lambda key, value: pushed.update({key: value})),
               "dag_run": SimpleNamespace(start_date=datetime.fromtimestamp(run_started, timezone.utc))}
    monkeypatch.setattr(SpotJobSummaryOperator, "dag_id", property(lambda self: "d"))
    return op, context, backend, pushed


def test_the_finish_task_terminates_stopped_instances_too(tmp_path, monkeypatch):
    now = time.time()
    op, context, backend, _ = run_finish(tmp_path, monkeypatch, now - 100, [now - 50], latest=10)
    summary = op.execute(context)
    assert sorted(backend.terminated) == ["i-running", "i-stopped"]
    assert summary["attempts_this_run"] == 1


def test_a_run_on_a_store_an_earlier_run_finished_says_it_trained_nothing(tmp_path, monkeypatch):
    now = time.time()
    op, context, _, _ = run_finish(tmp_path, monkeypatch, now, [now - 7200], latest=10)
    warnings = []
    logger = SimpleNamespace(warning=lambda msg, *a: warnings.append(msg % a), info=lambda *a: None)
    monkeypatch.setattr(SpotJobSummaryOperator, "log", property(lambda self: logger))
    summary = op.execute(context)
    assert summary["attempts_this_run"] == 0 and summary["attempts"] == 1
    assert any("this run trained nothing" in w and "{{ run_id }}" in w for w in warnings), warnings


def test_a_job_with_no_checkpoint_says_so(tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    now = time.time()
    op, context, _, _ = run_finish(tmp_path, monkeypatch, now - 100, [], latest=None)
    with pytest.raises(AirflowFailException, match="no checkpoint was committed of 10 steps"):
        op.execute(context)


def test_a_cleared_finish_task_counts_the_runs_attempts_from_when_the_run_was_due(tmp_path, monkeypatch):
    """Clearing a task resets the run's start_date; run_after stays: the run's own attempts still count."""
    now = time.time()
    op, context, _, _ = run_finish(tmp_path, monkeypatch, now, [now - 50], latest=10)
    context["dag_run"].run_after = datetime.fromtimestamp(now - 100, timezone.utc)
    assert op.execute(context)["attempts_this_run"] == 1
