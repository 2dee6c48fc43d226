from __future__ import annotations

import math

import pytest

from airflow_spot.policy.checkpoint_interval import (
    IntervalInputs,
    checkpoint_interval,
    checkpoint_interval_policies,
    daly_interval,
    estimate_mtbf,
    estimate_notice_coverage,
    young_interval,
)
from airflow_spot.policy.ledger import LedgerRow, notice_evidence


@pytest.mark.parametrize(
    "mtbf_min, expected_min",
    [(24 * 60, 117), (6 * 60, 57), (15, 9.1)],  # Daly (2006), save cost 5 min
)
def test_daly_published_values(mtbf_min, expected_min):
    assert daly_interval(5.0, mtbf_min) == pytest.approx(expected_min, rel=0.01)


def test_young_is_sqrt_2cm_and_daly_refines_it():
    assert young_interval(5, 1440) == pytest.approx(120.0)
    assert daly_interval(5, 1440) < young_interval(5, 1440)
    assert daly_interval(10, 4) == 4  # C >= 2M: checkpointing cannot pay off, use M


@pytest.mark.parametrize("c, m", [(0, 10), (1, 0), (-1, 10), (1, math.inf)])
def test_bad_inputs(c, m):
    with pytest.raises(ValueError, match="positive finite"):
        daly_interval(c, m)


def test_mtbf_blends_prior_with_observations():
    assert estimate_mtbf(3600, 0, 0) == 3600
    assert estimate_mtbf(3600, 3, 300) == pytest.approx(975)
    assert estimate_mtbf(3600, 100, 10_000) < 200  # many preemptions dominate the prior
    with pytest.raises(ValueError):
        estimate_mtbf(3600, -1, 0)


def test_policy_clamps_to_floor_ceiling_and_write_time():
    base = dict(save_cost_seconds=5.0, mtbf_seconds=3 * 3600.0)
    assert checkpoint_interval(IntervalInputs(**base)) == pytest.approx(daly_interval(5, 3 * 3600))
    assert checkpoint_interval(IntervalInputs(**base, max_interval_seconds=60)) == 60
    assert checkpoint_interval(IntervalInputs(**base, min_interval_seconds=1000)) == 1000
    assert checkpoint_interval(IntervalInputs(**base, write_seconds=5000)) == 5000
    assert checkpoint_interval(IntervalInputs(0.0, 3600, min_interval_seconds=30)) == 30
    assert checkpoint_interval(IntervalInputs(**base), "young") == pytest.approx(young_interval(5, 3 * 3600))
    assert checkpoint_interval(IntervalInputs(**base, min_interval_seconds=42), "fixed") == 42


def test_unknown_policy_lists_valid_ones():
    assert set(checkpoint_interval_policies.names()) >= {"daly", "young", "fixed"}
    with pytest.raises(ValueError, match="valid checkpoint-interval policies: daly, fixed, young"):
        checkpoint_interval(IntervalInputs(1, 1), "nope")


def test_a_covered_preemption_is_not_a_loss_so_the_interval_insures_only_the_misses():
    # Young's interval with M the mean time between preemptions that lose work: M / (1 - q)
    base = dict(save_cost_seconds=10.0, mtbf_seconds=3 * 3600.0, max_interval_seconds=1e9)
    plain = checkpoint_interval(IntervalInputs(**base), "young")
    half = checkpoint_interval(IntervalInputs(**base, notice_coverage=0.5), "young")
    assert half == pytest.approx(young_interval(10, 6 * 3600)) == pytest.approx(plain * math.sqrt(2))
    # never certain: a notice can always be missed, so the interval stays finite before the ceiling
    assert math.isfinite(checkpoint_interval(IntervalInputs(**base, notice_coverage=1.0)))
    assert checkpoint_interval(IntervalInputs(save_cost_seconds=10.0, mtbf_seconds=3 * 3600.0,
                                              notice_coverage=0.99)) == 3600.0  # the ceiling insures anyway
    with pytest.raises(ValueError, match="notice_coverage must be in"):
        IntervalInputs(1, 1, notice_coverage=1.5)


def test_notice_coverage_is_a_prior_moved_by_the_jobs_own_preemptions():
    assert estimate_notice_coverage(0, 0, prior=0.99, weight=5) == 0.99
    assert estimate_notice_coverage(5, 0, prior=0.99, weight=5) == pytest.approx(0.995)
    # one miss among the first preemptions: (5 x 0.99 + 0) / 6
    assert estimate_notice_coverage(0, 1, prior=0.99, weight=5) == pytest.approx(4.95 / 6)
    assert estimate_notice_coverage(0, 20, prior=0.99, weight=5) < 0.2  # notices that never come
    # an emergency save that cannot commit in the window covers nothing, whatever the record says
    assert estimate_notice_coverage(10, 0, fits=False) == 0.0
    assert estimate_notice_coverage(0, 0, prior=0.5, weight=0) == 0.5
    with pytest.raises(ValueError):
        estimate_notice_coverage(-1, 0)
    with pytest.raises(ValueError):
        estimate_notice_coverage(0, 0, prior=1.5)


def _row(n, outcome, steps_done, steps_lost, notice_at):
    return LedgerRow(attempt_id=f"a{n}", instance_id="i", instance_type="t", zone="z", market="spot",
                     price_per_hour=1.0, on_demand_price_per_hour=3.0, started_at=float(n), ended_at=n + 1.0,
                     steps_done=steps_done, outcome=outcome, steps_lost=steps_lost, notice_at=notice_at)


def test_notice_evidence_reads_the_preempted_attempts_that_had_work_at_stake():
    rows = [
        _row(0, "preempted", 40, 0, 0.5),   # notice came, the emergency save kept everything: covered
        _row(1, "preempted", 10, 7, 1.5),   # notice came but the save did not commit: missed
        _row(2, "lost", 30, 12, None),      # gone without a notice: missed
        _row(3, "preempted", 25, 0, None),  # no notice reached the process (nothing lost by luck): missed
        _row(4, "preempted", 0, 0, 4.5),    # still starting up: nothing at stake, no evidence
        _row(5, "completed", 100, 0, None),
    ]
    assert notice_evidence(rows) == (1, 3)
