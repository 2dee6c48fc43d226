"""The pool-age estimate from the job's own observations, on hand-made ledgers."""
from __future__ import annotations

import pytest

from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.policy.pool_age import observed_failures, observed_pool_age, observed_spot_up_seconds

A, B = "p3.2xlarge@us-west-2a", "p3.2xlarge@us-west-2b"


def row(zone: str, start: float, end: float, outcome: str, market: str = "spot") -> LedgerRow:
    return LedgerRow(attempt_id=f"a{start}", instance_id="i", instance_type="p3.2xlarge", zone=zone, market=market,
                     price_per_hour=1.0, on_demand_price_per_hour=3.0, started_at=start, ended_at=end,
                     steps_done=0, outcome=outcome)


def test_last_preemption_or_loss_per_pool():
    rows = [row("us-west-2a", 0, 100, "preempted"), row("us-west-2a", 200, 500, "lost"),
            row("us-west-2b", 0, 300, "preempted"), row("us-west-2b", 400, 450, "completed")]
    assert observed_failures(rows, now=1000) == {A: 500.0, B: 300.0}


def test_completed_failed_and_on_demand_rows_are_not_capacity_failures():
    rows = [row("us-west-2a", 0, 100, "completed"), row("us-west-2a", 100, 200, "failed"),
            row("us-west-2b", 0, 300, "lost", market="on-demand")]
    assert observed_failures(rows, now=1000) == {}


def test_capacity_errors_count_and_the_future_is_ignored():
    rows = [row("us-west-2a", 0, 100, "preempted"), row("us-west-2b", 0, 900, "preempted")]
    assert observed_failures(rows, now=500, capacity_errors=[(A, 250.0), (A, 600.0)]) == {A: 250.0}


def test_age_since_the_last_failure_else_since_the_job_started():
    failures = {A: 700.0}
    assert observed_pool_age(A, failures, now=1000, job_started_at=100) == pytest.approx(300)
    assert observed_pool_age(B, failures, now=1000, job_started_at=100) == pytest.approx(900)
    # never negative, never before the job started
    assert observed_pool_age(A, {A: 50.0}, now=1000, job_started_at=100) == pytest.approx(900)
    assert observed_pool_age(B, {}, now=50, job_started_at=100) == 0.0


def test_best_candidate_age():
    failures = {A: 700.0, B: 900.0}
    assert observed_spot_up_seconds([A, B], failures, now=1000, job_started_at=0) == pytest.approx(300)
    assert observed_spot_up_seconds([B], failures, now=1000, job_started_at=0) == pytest.approx(100)
    assert observed_spot_up_seconds([], failures, now=1000, job_started_at=0) is None
