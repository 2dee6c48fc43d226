"""The hindsight optimum against hand-computed answers (1-minute grid)."""
from __future__ import annotations

import pytest

from airflow_spot.simulate.engine import JobSpec
from airflow_spot.simulate.hindsight import hindsight_cost
from tests.simulate.test_engine import OD, ON_DEMAND, SPEC, SPOT, TRACE, pool


def test_matches_the_engine_tests_hand_computed_optimum():
    # spot 0-10 min (1 restart + 9 of work), then on-demand: 1 restart + the 6 min left
    assert hindsight_cost(SPEC, [pool("us-west-2b", TRACE)], ON_DEMAND, step_seconds=60.0) == pytest.approx(
        10 * SPOT / 60 + 7 * OD / 60)


def test_waits_out_an_outage_it_can_afford_and_picks_the_zone_that_lasts():
    # down for the first 10 min, then up: 15 min of slack covers the wait -> 1 + 15 spot minutes
    late = [0] * 10 + [1] * 50
    assert hindsight_cost(SPEC, [pool("us-west-2b", late)], ON_DEMAND, step_seconds=60.0) == pytest.approx(
        16 * SPOT / 60)
    # a second zone up from minute 8 and for good: knowing that, idle until 8 and run there (1 + 15
    # minutes), one restart cheaper than the causal policies' zone b then zone c (17 minutes)
    assert hindsight_cost(SPEC, [pool("us-west-2b", TRACE), pool("us-west-2c", [0] * 8 + [1] * 52)], ON_DEMAND,
                          step_seconds=60.0) == pytest.approx(16 * SPOT / 60)


def test_needs_a_deadline():
    with pytest.raises(ValueError, match="deadline"):
        hindsight_cost(JobSpec(work_hours=1), [pool("us-west-2b", TRACE)], ON_DEMAND)
