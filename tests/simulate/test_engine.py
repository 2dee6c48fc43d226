"""The simulator against hand-computed answers on small synthetic traces (1-minute ticks)."""
from __future__ import annotations

import pytest

from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec, SimPool, simulate

SPOT, OD = 1.2, 3.6  # $/h: 2 and 6 cents a minute


def pool(zone, values):
    trace = SpotTrace(name=zone, zone=zone, gap_seconds=60.0, values=tuple(values))
    return SimPool(trace, Offer("p3.2xlarge", zone[:-1], zone, Market.SPOT, SPOT, OD, "V100", 1, 16.0))


ON_DEMAND = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, OD, OD, "V100", 1, 16.0)
# 15 min of work, 1 min restart, no save stall, deadline at 30 min
SPEC = JobSpec(work_hours=15 / 60, deadline_hours=30 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
# up for 10 min, then down past the deadline
TRACE = [1] * 10 + [0] * 50


def run(name, pools, spec=SPEC):
    return simulate(spec, pools, ON_DEMAND, controllers.get(name)(), max_hours=1.0)


def test_matches_the_hand_computed_optimum():
    # Hindsight optimum: spot 0-10 min (1 restart + 9 min of work), then on-demand for 1 restart + the
    # 6 min left, started any time before minute 23: 10 spot minutes + 7 on-demand minutes.
    best = 10 * SPOT / 60 + 7 * OD / 60
    for name in ("ours", "oracle-age", "greedy", "up-any-zone"):
        r = run(name, [pool("us-west-2b", TRACE)])
        assert r.completed and r.deadline_met, name
        assert r.cost == pytest.approx(best), name
        assert r.preemptions == 1
        assert r.spot_hours == pytest.approx(10 / 60) and r.on_demand_hours == pytest.approx(7 / 60)
        # lost: the two restarts, nothing of the work (the emergency save fits in the notice)
        assert r.lost_gpu_hours == pytest.approx(2 / 60)


def test_on_demand_only_and_no_emergency_save():
    r = run("on-demand", [pool("us-west-2b", TRACE)])
    assert r.cost == pytest.approx(16 * OD / 60) and r.completion_hours == pytest.approx(16 / 60)
    # checkpoints every 30 min and no emergency save: a preemption could throw away 30 min, more than
    # the 15 min of slack, so the safety net starts on-demand at once
    r = run("fixed-one-zone", [pool("us-west-2b", TRACE)])
    assert r.deadline_met and r.cost == pytest.approx(16 * OD / 60)


def test_emergency_save_against_fixed_interval_without_deadline():
    # up 10 min, down 5, up again: with the emergency save 1 + 9 min, then 1 + 6 -> done at minute 22;
    # without it the 9 min are lost: 1 + 15 min from minute 15 -> done at 31
    spec = JobSpec(work_hours=15 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    trace = [1] * 10 + [0] * 5 + [1] * 45
    # oracle-age sees the pool come back at minute 15 (ours finds out at its next retry)
    ours = run("oracle-age", [pool("us-west-2b", trace)], spec)
    fixed = run("fixed-one-zone", [pool("us-west-2b", trace)], spec)
    assert ours.completion_hours == pytest.approx(22 / 60) and ours.cost == pytest.approx(17 * SPOT / 60)
    assert fixed.completion_hours == pytest.approx(31 / 60) and fixed.cost == pytest.approx(26 * SPOT / 60)
    assert fixed.lost_gpu_hours == pytest.approx((1 + 9 + 1) / 60)
    assert ours.lost_gpu_hours == pytest.approx(2 / 60)


def test_moves_to_another_zone_instead_of_on_demand():
    # zone b comes up at minute 8 and stays: after the preemption at 10 the job restarts there (1 min)
    pools = [pool("us-west-2b", TRACE), pool("us-west-2c", [0] * 8 + [1] * 52)]
    r = run("ours", pools)
    assert r.deadline_met and r.on_demand_hours == 0
    assert r.cost == pytest.approx((10 + 7) * SPOT / 60)
    assert r.completion_hours == pytest.approx(17 / 60)


def test_without_deadline_waits_for_spot():
    spec = JobSpec(work_hours=5 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    r = run("ours", [pool("us-west-2b", [0] * 20 + [1] * 40)], spec)
    assert r.completion_hours == pytest.approx(26 / 60) and r.on_demand_hours == 0
    assert r.deadline_met is None


def test_ledger_rows_sum_to_the_result():
    r = run("ours", [pool("us-west-2b", TRACE)])
    assert sum(row.cost for row in r.rows) == pytest.approx(r.cost)
    assert [row.outcome for row in r.rows] == ["preempted", "completed"]


def test_bad_job_specs():
    with pytest.raises(ValueError, match="shorter than the work"):
        JobSpec(work_hours=10, deadline_hours=5)
    with pytest.raises(ValueError, match="work_hours"):
        JobSpec(work_hours=0)


#: 3 h of work, 4 h deadline (60 min of slack), 6 min restarts; the pool is up 0-20 min, down to 80,
#: flaps up 80-90, then stays up from minute 100
FLAP_SPEC = JobSpec(work_hours=3, deadline_hours=4, save_cost_seconds=0.0, restart_overhead_hours=0.1)
FLAP_TRACE = [1] * 20 + [0] * 60 + [1] * 10 + [0] * 10 + [1] * 200


def test_oracle_age_waits_its_budget_then_leaves_on_demand_only_for_a_settled_pool():
    spec, trace = FLAP_SPEC, FLAP_TRACE
    r = simulate(spec, [pool("us-west-2b", trace)], ON_DEMAND, controllers.get("oracle-age")(), max_hours=5.0)
    assert r.deadline_met
    spot1, od, spot2 = r.rows
    assert (spot1.market, spot1.outcome, spot1.ended_at) == ("spot", "preempted", 20 * 60)
    # preempted at 20 with 14 min done: slack 54 min; waiting budget 54 - 9 (floor) - 0.1 * 166 = 28.4 min,
    # so on-demand starts at the first tick after minute 48.4
    assert od.market == "on-demand" and od.started_at == 49 * 60
    # the flap at 80-90 and the pool's first 45 min from minute 100 are not worth leaving on-demand for
    assert spot2.market == "spot" and spot2.started_at == (100 + 45) * 60


@pytest.mark.parametrize("name", ["transfer_seconds", "transfer_dollars", "save_cost_seconds"])
def test_a_negative_or_nan_job_figure_is_refused_by_name(name):
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match=f"{name} must be >= 0"):
            JobSpec(work_hours=1, **{name: bad})
