"""The ``adrs-gepa`` anchor: the ADRS leaderboard's best multi-region policy, on hand-computed cases."""
from __future__ import annotations

import pytest

from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.adrs import MAX_WAIT_TICKS, NONE, ON_DEMAND, SPOT, GepaState, gepa_request
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec, SimPool, simulate

OD = 3.0
ON_DEMAND_OFFER = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, OD, OD, "V100", 1, 16.0)
D = 100.0  # one restart


def ask(state, slack, current=None, any_up=True, now=1000.0):
    return gepa_request(state, now=now, slack=slack, restart=D, current=current, any_up=any_up)


def test_no_slack_is_on_demand_and_sticks_for_a_restart():
    req, st = ask(GepaState(), slack=0.0, current=SPOT)
    assert req == ON_DEMAND and st.sticky_until == 1100.0
    # inside the stay a pool up does not take it back while its slack is under half a restart...
    assert ask(st, slack=40.0, current=ON_DEMAND, now=1050.0)[0] == ON_DEMAND
    # ...but with more slack it does, and after the stay it does at any slack
    assert ask(st, slack=60.0, current=ON_DEMAND, now=1050.0)[0] == SPOT
    assert ask(st, slack=10.0, current=ON_DEMAND, now=1100.0)[0] == SPOT


def test_no_pool_up_waits_a_few_ticks_then_starts_on_demand_and_keeps_it():
    st = GepaState()
    seen = []
    for _ in range(MAX_WAIT_TICKS + 1):
        req, st = ask(st, slack=10 * D, any_up=False)
        seen.append(req)
    assert seen == [NONE] * MAX_WAIT_TICKS + [ON_DEMAND]
    assert st.waited == 0 and st.sticky_until == 1050.0
    assert ask(st, slack=10 * D, current=ON_DEMAND, any_up=False)[0] == ON_DEMAND


def test_waits_only_while_the_slack_holds_more_than_two_restarts_and_fewer_ticks_than_restarts():
    assert ask(GepaState(), slack=2 * D, any_up=False)[0] == ON_DEMAND
    # 3.5 restarts of slack: at most 3 ticks of waiting
    st, seen = GepaState(), []
    for _ in range(4):
        req, st = ask(st, slack=3.5 * D, any_up=False)
        seen.append(req)
    assert seen == [NONE, NONE, NONE, ON_DEMAND]


def test_a_pool_coming_back_resets_the_wait():
    st = ask(ask(GepaState(), slack=10 * D, any_up=False)[1], slack=10 * D, any_up=False)[1]
    assert st.waited == 2
    req, st = ask(st, slack=10 * D)
    assert req == SPOT and st.waited == 0


def pool(zone, values, price=1.0):
    trace = SpotTrace(name=zone, zone=zone, gap_seconds=60.0, values=tuple(values))
    return SimPool(trace, Offer("p3.2xlarge", zone[:-1], zone, Market.SPOT, price, OD, "V100", 1, 16.0))


def test_replay_waits_five_ticks_into_an_outage_then_runs_on_demand_and_leaves_it_for_a_pool_back():
    # 1 h of work by 2 h, 1 min restarts, 1 min ticks: spot for 20 min, every pool down for 30 min, then up
    spec = JobSpec(work_hours=1.0, deadline_hours=2.0, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    pools = [pool("us-west-2a", [1] * 20 + [0] * 30 + [1] * 200, price=1.5),
             pool("us-west-2b", [1] * 20 + [0] * 30 + [1] * 200)]
    r = simulate(spec, pools, ON_DEMAND_OFFER, controllers.get("adrs-gepa")(), max_hours=3.0)
    assert r.completed and r.deadline_met
    assert [(x.zone, x.market, x.outcome) for x in r.rows] == [
        ("us-west-2b", "spot", "preempted"), ("us-west-2", "on-demand", "completed"),
        ("us-west-2b", "spot", "completed")]
    # preempted at minute 20; waits minutes 20-24, on-demand from 25 until the pools return at 50
    assert [(x.started_at / 60, x.ended_at / 60) for x in r.rows[1:2]] == [pytest.approx((25, 50))]
