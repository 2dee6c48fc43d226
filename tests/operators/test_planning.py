"""The operator's offer plan: the bundled market through the ranking and deadline policies."""
from __future__ import annotations

from datetime import timedelta

import pytest

from airflow_spot.backends.base import InstanceInfo, InstanceState
from airflow_spot.market import get_market
from airflow_spot.operators.planning import NoOfferError, pick_warm, plan
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.policy.offer_ranking import cost_per_step
from airflow_spot.policy.offers import GpuRequest, Market

T0 = 1_800_000_000.0
GPUS = GpuRequest(count=1, min_memory_gib=16)


@pytest.fixture(scope="module")
def market():
    return get_market("local")


def make_plan(market, **kw):
    args = dict(now=T0, done_steps=0, total_steps=1000, job_started_at=T0, deadline=None, ledger_rows=[])
    args.update(kw)
    return plan(market, GPUS, **args)


def test_without_deadline_spot_ranked_by_cost_per_step(market):
    p = make_plan(market)
    assert p.market is Market.SPOT and all(o.is_spot for o in p.ranked)
    costs = [cost_per_step(o) for o in p.ranked]
    assert costs == sorted(costs)
    assert p.mtbf_seconds and p.mtbf_seconds > 0  # handed to the session's checkpoint interval


def nearly_late(market):
    # 5 of 10 hours gone, 4 % done at 18 s/step: the remaining 960 steps need 4.8 h of the 5 h left,
    # a slack of 12 minutes, less than two restarts' worth: the deadline policy commits to on-demand
    return make_plan(market, now=T0 + 5 * 3600, done_steps=40, deadline=timedelta(hours=10), step_seconds=18.0)


def test_when_the_slack_runs_out_it_goes_on_demand(market):
    p = nearly_late(market)
    assert p.market is Market.ON_DEMAND and not any(o.is_spot for o in p.ranked)


def test_ahead_of_the_line_stays_on_spot(market):
    p = make_plan(market, now=T0 + 3600, done_steps=500, deadline=timedelta(hours=10), step_seconds=18.0)
    assert p.market is Market.SPOT


def test_a_pool_that_just_preempted_us_is_ranked_last(market):
    best = make_plan(market).ranked[0]
    row = LedgerRow("seg.try1", "i-1", best.instance_type, best.zone, "spot", best.price_per_hour,
                    best.on_demand_price_per_hour, T0 - 100, T0 - 10, 5, "preempted")
    p = make_plan(market, ledger_rows=[row])
    assert p.ranked[0].pool != best.pool and p.ranked[-1].pool == best.pool


def test_warm_instance_reused_only_while_near_the_best(market):
    p = make_plan(market)
    best, worst = p.ranked[0], p.ranked[-1]

    def inst(offer, iid):
        return InstanceInfo(iid, InstanceState.RUNNING, offer, "file:///job")

    assert pick_warm([inst(best, "a")], p, 0.25).instance_id == "a"
    assert pick_warm([inst(worst, "b")], p, 0.25) is None
    on_demand = nearly_late(market)
    assert pick_warm([inst(best, "a")], on_demand, 10.0) is None  # the policy wants on-demand now


def test_no_matching_offer_is_a_clear_error(market):
    with pytest.raises(NoOfferError, match="relax the GPU request"):
        plan(market, GpuRequest(count=1, min_memory_gib=10_000), now=T0, done_steps=0, total_steps=10,
             job_started_at=T0, deadline=None, ledger_rows=[])


def test_the_safety_net_holds_once_fired(market):
    assert nearly_late(market).committed
    # later the job is comfortably ahead again, but the policy had committed to on-demand to the end
    relaxed = dict(now=T0 + 3600, done_steps=500, deadline=timedelta(hours=10), step_seconds=18.0)
    assert make_plan(market, **relaxed).market is Market.SPOT
    assert make_plan(market, committed=True, **relaxed).market is Market.ON_DEMAND


def test_leaving_on_demand_waits_for_a_settled_pool_when_its_age_is_known(market):
    # 10 h deadline, 1 h in, half the 5 h of work done: plenty of slack, running on on-demand
    kw = dict(now=T0 + 3600, done_steps=500, deadline=timedelta(hours=10), step_seconds=18.0,
              running=Market.ON_DEMAND)
    assert make_plan(market, **kw).market is Market.SPOT  # age unknown: slack-reserve, far ahead -> spot
    assert make_plan(market, spot_up_seconds=300.0, **kw).market is Market.ON_DEMAND
    assert make_plan(market, spot_up_seconds=2 * 3600.0, **kw).market is Market.SPOT
