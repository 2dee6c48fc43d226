"""The foresight yardstick (``ours`` with one decision read from the traces' future): unchanged ``ours``
when nothing is switched on, and each decision doing what it says on hand-made traces."""
from __future__ import annotations

import pytest

from airflow_spot.market.traces import PREEMPTION_TRACES_SUBDIR, SpotTrace, default_traces_dir, load_traces
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec, SimPool, simulate
from airflow_spot.simulate.foresight import ForesightController
from airflow_spot.simulate.report import build_pools

SPOT, OD = 1.2, 3.6
ON_DEMAND = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, OD, OD, "V100", 1, 16.0)
# 10 h of work in 11 h: 0.10 x the work left is more slack than the job has, so `ours` has no waiting budget
SPEC = JobSpec(work_hours=10, deadline_hours=11, save_cost_seconds=0.0, restart_overhead_hours=0.1)


def pool(zone, values):
    trace = SpotTrace(name=zone, zone=zone, gap_seconds=60.0, values=tuple(values))
    return SimPool(trace, Offer("p3.2xlarge", zone[:-1], zone, Market.SPOT, SPOT, OD, "V100", 1, 16.0))


@pytest.mark.parametrize("offset_hours", [0, 37])
def test_with_nothing_switched_on_it_is_ours(offset_hours):
    traces = load_traces(default_traces_dir() / PREEMPTION_TRACES_SUBDIR)
    pools, od = build_pools(traces, spot_price=0.9731, on_demand_price=3.06)
    spec = JobSpec(48, 52, restart_overhead_hours=0.2)
    offset = int(offset_hours * 3600 // traces[0].gap_seconds)
    ours = simulate(spec, pools, od, controllers.get("ours")(), offset_ticks=offset)
    same = simulate(spec, pools, od, ForesightController(offset_ticks=offset), offset_ticks=offset)
    assert same.cost == ours.cost
    assert [(r.zone, r.started_at, r.outcome) for r in same.rows] == [(r.zone, r.started_at, r.outcome) for r in ours.rows]


def test_wait_rides_out_an_outage_that_ends_soon():
    # preempted at 60 min; capacity is back at 65 min: `ours` cannot know and starts on-demand, the
    # yardstick waits the 5 minutes
    trace = [1] * 60 + [0] * 5 + [1] * 800
    ours = simulate(SPEC, [pool("us-west-2b", trace)], ON_DEMAND, controllers.get("ours")(), max_hours=12)
    seen = ForesightController(wait_if_back_within=600.0)
    ahead = simulate(SPEC, [pool("us-west-2b", trace)], ON_DEMAND, seen, max_hours=12)
    assert any(r.market == "on-demand" for r in ours.rows)
    assert all(r.market == "spot" for r in ahead.rows) and ahead.rows[1].started_at == 65 * 60
    assert ahead.deadline_met and ours.deadline_met and ahead.cost < ours.cost
    # an outage longer than the look-ahead is not waited out
    long_gap = [1] * 60 + [0] * 30 + [1] * 800
    r = simulate(SPEC, [pool("us-west-2b", long_gap)], ON_DEMAND, ForesightController(wait_if_back_within=600.0),
                 max_hours=12)
    assert r.rows[1].market == "on-demand"


def test_leave_goes_back_to_spot_at_the_first_boundary_after_capacity_returns_for_good():
    # down 61-180 min, then up for good: `ours` first waits to see the pool settle (45 min); the yardstick
    # leaves at the next segment boundary, as the operators would, knowing it stays
    trace = [1] * 60 + [0] * 120 + [1] * 800
    ours = simulate(SPEC, [pool("us-west-2b", trace)], ON_DEMAND, controllers.get("ours")(), max_hours=12)
    seen = ForesightController(leave_if_up_for=3600.0)
    ahead = simulate(SPEC, [pool("us-west-2b", trace)], ON_DEMAND, seen, max_hours=12)
    back_ours, back_ahead = ours.rows[-1], ahead.rows[-1]
    assert back_ours.market == back_ahead.market == "spot"
    assert 180 * 60 <= back_ahead.started_at <= 180 * 60 + SPEC.segment_seconds
    assert back_ours.started_at >= 180 * 60 + 45 * 60
    assert ahead.cost < ours.cost and ahead.deadline_met


def test_pool_takes_the_one_that_stays_up():
    # two equal pools: the first by name goes after 10 minutes; the other stays
    flaky, steady = [1] * 10 + [0] * 600, [1] * 610
    spec = JobSpec(work_hours=2, save_cost_seconds=0.0, restart_overhead_hours=0.1)
    pools = [pool("us-west-2a", flaky), pool("us-west-2b", steady)]
    ours = simulate(spec, pools, ON_DEMAND, controllers.get("ours")(), max_hours=5)
    ahead = simulate(spec, pools, ON_DEMAND, ForesightController(pool_by_future=True), max_hours=5)
    assert ours.preemptions == 1 and ours.rows[0].zone == "us-west-2a"
    assert ahead.preemptions == 0 and [r.zone for r in ahead.rows] == ["us-west-2b"]


def test_launch_waits_for_a_pool_that_stays_up_while_the_slack_leaves_a_waiting_budget():
    # pool a is up for its first 10 minutes only; pool b comes up at 20 minutes and stays: `ours` starts on
    # a and is preempted, the yardstick waits for b
    a, b = [1] * 10 + [0] * 1200, [0] * 20 + [1] * 1190
    roomy = JobSpec(work_hours=10, deadline_hours=20, save_cost_seconds=0.0, restart_overhead_hours=0.1)
    pools = [pool("us-west-2a", a), pool("us-west-2b", b)]
    ours = simulate(roomy, pools, ON_DEMAND, controllers.get("ours")(), max_hours=21)
    ahead = simulate(roomy, pools, ON_DEMAND, ForesightController(launch_if_up_for=1800.0), max_hours=21)
    assert ours.preemptions == 1 and ours.rows[0].zone == "us-west-2a"
    assert ahead.preemptions == 0 and [(r.zone, r.started_at) for r in ahead.rows] == [("us-west-2b", 20 * 60)]
    assert ahead.cost < ours.cost and ahead.deadline_met
    # without a waiting budget (10 h of work in 11 h) it starts where `ours` starts
    tight = simulate(SPEC, pools, ON_DEMAND, ForesightController(launch_if_up_for=1800.0), max_hours=12)
    assert tight.rows[0].zone == "us-west-2a" and tight.rows[0].started_at == 0
