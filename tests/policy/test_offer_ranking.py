from __future__ import annotations

import pytest

from airflow_spot.policy.offer_ranking import (
    RankingParams, choose_offer, cost_per_step, offer_ranking_policies, rank_offers, risk_multiplier,
)
from airflow_spot.policy.offers import Market, Offer


def offer(itype, zone, price, thr, market=Market.SPOT, rate=0.0, od=3.0):
    return Offer(itype, "us-west-2", zone, market, price, od, "X", 1, 16.0, relative_throughput=thr,
                 preemption_rate_per_hour=rate)


def test_prefers_cheaper_per_step_over_cheaper_per_hour():
    slow_cheap = offer("g4dn.xlarge", "a", 0.30, 0.40)   # $0.75 per V100-hour
    fast_dear = offer("g5.xlarge", "a", 0.60, 0.90)      # $0.667 per V100-hour
    assert cost_per_step(fast_dear) < cost_per_step(slow_cheap)
    assert rank_offers([slow_cheap, fast_dear], now=0.0)[0] is fast_dear
    assert rank_offers([slow_cheap, fast_dear], now=0.0, policy="cheapest-per-hour")[0] is slow_cheap


def test_preemption_risk_inflates_spot_cost():
    params = RankingParams(overhead_seconds=1800.0)
    calm = offer("p3.2xlarge", "a", 1.00, 1.0, rate=0.1)   # 1.00 * (1 + 0.1 * 0.5) = 1.05
    risky = offer("p3.2xlarge", "b", 0.95, 1.0, rate=0.5)  # 0.95 * (1 + 0.5 * 0.5) = 1.1875
    assert cost_per_step(calm, params) == pytest.approx(1.05)
    assert cost_per_step(risky, params) == pytest.approx(1.1875)
    assert rank_offers([risky, calm], now=0.0, params=params)[0] is calm
    od = offer("p3.2xlarge", "r", 3.0, 1.0, market=Market.ON_DEMAND, rate=0.5)
    assert cost_per_step(od, params) == pytest.approx(3.0)  # on-demand is never preempted


def test_cooldown_ranks_a_pool_that_just_preempted_last_then_forgets():
    a, b = offer("p3.2xlarge", "a", 0.90, 1.0), offer("p3.2xlarge", "b", 1.00, 1.0)
    recent = {a.pool: 1000.0}
    params = RankingParams(cooldown_seconds=600.0)
    assert rank_offers([a, b], now=1300.0, recent_preemptions=recent, params=params) == [b, a]
    assert rank_offers([a, b], now=1700.0, recent_preemptions=recent, params=params) == [a, b]
    # never empty because of a cool-down
    assert choose_offer([a], now=1300.0, recent_preemptions=recent, params=params) is a


def test_risk_multiplier_decays_with_age():
    assert risk_multiplier(None, 600.0) == 1.0
    assert risk_multiplier(0.0, 600.0) == pytest.approx(5.0)
    assert risk_multiplier(600.0, 600.0) == pytest.approx(1.8)
    assert risk_multiplier(1e9, 600.0) == pytest.approx(1.0, abs=1e-5)


def test_choose_offer_filters_market_and_falls_back():
    s, o = offer("p3.2xlarge", "a", 1.0, 1.0), offer("p3.2xlarge", "r", 3.0, 1.0, market=Market.ON_DEMAND)
    assert choose_offer([s, o], now=0.0, market="on-demand") is o
    assert choose_offer([s], now=0.0, market="on-demand") is s
    assert choose_offer([], now=0.0) is None


def test_registry_default_and_unknown():
    assert offer_ranking_policies.default == "cost-per-step"
    with pytest.raises(ValueError, match="cheapest-per-hour"):
        rank_offers([], now=0.0, policy="bogus")
