from __future__ import annotations

import math

import pytest

from airflow_spot.policy.checkpoint_interval import (
    IntervalInputs,
    checkpoint_interval,
    checkpoint_interval_policies,
    daly_interval,
    estimate_mtbf,
    young_interval,
)


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
