from __future__ import annotations

import pytest

from airflow_spot.policy.ledger import LedgerRow, billed_seconds, mean_price, summarize, totals
from airflow_spot.policy.offers import Market


def row(i, market="spot", start=0.0, end=3600.0, price=1.0, od=3.0, done=100, lost=0, outcome="completed", **kw):
    return LedgerRow(attempt_id=f"a{i}", instance_id=f"i-{i}", instance_type=kw.pop("itype", "p3.2xlarge"),
                     zone="usw2-az1", market=market, price_per_hour=price, on_demand_price_per_hour=od,
                     started_at=start, ended_at=end, steps_done=done, steps_lost=lost, outcome=outcome, **kw)


def test_aws_billing_per_second_with_a_60s_minimum_on_new_instances():
    assert billed_seconds(10.0) == 60.0
    assert billed_seconds(10.0, new_instance=False) == 10.0
    assert billed_seconds(60.2) == 61.0
    assert billed_seconds(0.0) == 60.0
    with pytest.raises(ValueError):
        billed_seconds(-1.0)
    r = row(1, start=100.0, end=130.0, price=3.6)
    assert r.billed_seconds == 60.0 and r.cost == pytest.approx(0.06)


def test_totals_equal_the_sum_of_rows():
    rows = [
        row(1, end=3600.0, price=0.9, od=3.06),
        row(2, start=3600.0, end=5400.0, price=0.9, od=3.06, done=10, lost=40, outcome="preempted"),
        row(3, market=Market.ON_DEMAND, start=6000.0, end=9000.0, price=3.06, od=3.06),
        row(4, start=9000.0, end=9030.0, price=0.5, od=1.2, new_instance=False, itype="g5.xlarge"),
    ]
    s = summarize(rows)
    assert s.cost == pytest.approx(sum(r.cost for r in rows))
    assert s.on_demand_cost == pytest.approx(sum(r.on_demand_cost for r in rows))
    assert s.billed_seconds == sum(r.billed_seconds for r in rows) == 3600 + 1800 + 3000 + 30
    assert s.lost_gpu_hours == pytest.approx(sum(r.lost_seconds for r in rows) / 3600)
    assert s.preemptions == 1 and s.attempts == 4
    assert s.steps_done == 310 and s.steps_lost == 40
    assert s.spot_cost == pytest.approx(rows[0].cost + rows[1].cost + rows[3].cost)
    assert totals is summarize


def test_savings_use_the_same_instance_types_on_demand_price():
    v100 = row(1, end=3600.0, price=1.0, od=3.06)
    a10g = row(2, start=3600.0, end=7200.0, price=0.5, od=1.2, itype="g5.xlarge")
    s = summarize([v100, a10g])
    assert s.on_demand_cost == pytest.approx(3.06 + 1.2)
    assert s.savings == pytest.approx(3.06 + 1.2 - 1.5)
    assert s.savings_fraction == pytest.approx(s.savings / s.on_demand_cost)


def test_lost_time_is_not_credited_as_savings():
    # 1 h preempted, 10 of 50 steps kept: 80 % of the hour lost
    r = row(1, end=3600.0, price=1.0, od=3.0, done=10, lost=40, outcome="preempted")
    assert r.lost_seconds == pytest.approx(2880.0)
    assert r.on_demand_cost == pytest.approx(0.6)
    # with a known step time: lost = billed - steps * step time (boot and restore included)
    r2 = row(2, end=3600.0, done=300, step_seconds=10.0)
    assert r2.lost_seconds == pytest.approx(600.0)


def test_a_completed_attempt_is_credited_its_whole_bill_and_a_preempted_one_only_its_kept_steps():
    # a 90 s segment on spot: boot, restore and saves take 40 s of it; on-demand pays those too, and
    # the 60 s minimum, so the spot discount stays a saving however short the segment
    done = row(1, end=90.0, price=1.0, od=3.0, done=5, step_seconds=10.0)
    assert done.lost_seconds == pytest.approx(40.0)  # still paid time without a kept step
    assert done.on_demand_seconds == 90.0 and done.on_demand_cost == pytest.approx(90 * 3.0 / 3600)
    short = row(2, end=20.0, price=1.0, od=3.0, done=1, step_seconds=5.0)
    assert summarize([short]).savings == pytest.approx(60 * 2.0 / 3600)
    # the preemption's boot and lost steps, and the retry's restart, are spot's own: only kept steps count
    lost = row(3, end=600.0, price=1.0, od=3.0, done=30, lost=10, outcome="preempted", step_seconds=10.0)
    assert lost.on_demand_seconds == pytest.approx(300.0)
    for outcome in ("lost", "failed", "abandoned"):
        assert row(4, end=600.0, done=30, outcome=outcome, step_seconds=10.0).on_demand_seconds == pytest.approx(300.0)
    s = summarize([lost, done])
    assert s.on_demand_cost == pytest.approx((300 + 90) * 3.0 / 3600)
    assert s.savings == pytest.approx(s.on_demand_cost - (600 + 90) * 1.0 / 3600)


def test_probes_add_their_bill_to_the_cost_and_nothing_else():
    """A probe (a spot instance launched only to learn whether its pool has capacity, terminated at once)
    pays the billing minimum, which the simulator charges too: the job's cost holds it, its attempts,
    work and on-demand figure do not."""
    attempt = row(1, end=3600.0, price=1.0, od=3.0)
    probe = row(2, start=4000.0, end=4003.0, price=0.9, od=3.0, done=0, outcome="probe")
    s = summarize([attempt], [probe])
    assert s.probes == 1 and s.probe_dollars == pytest.approx(60 * 0.9 / 3600)
    assert s.cost == pytest.approx(1.0 + s.probe_dollars) and s.spot_cost == pytest.approx(s.cost)
    assert (s.attempts, s.on_demand_cost, s.billed_seconds) == (1, pytest.approx(3.0), 3600)
    assert s.savings == pytest.approx(3.0 - 1.0 - s.probe_dollars)


def test_round_trip_and_validation():
    r = row(1, market=Market.ON_DEMAND, segment_index=3, region="us-west-2")
    d = r.to_dict()
    assert d["market"] == "on-demand" and d["billed_seconds"] == 3600.0 and d["cost"] == pytest.approx(1.0)
    assert LedgerRow.from_dict(d) == r
    with pytest.raises(ValueError, match="before"):
        row(1, start=10.0, end=5.0)
    with pytest.raises(ValueError):
        row(1, market="reserved")
    with pytest.raises(ValueError, match="newer"):
        LedgerRow.from_dict({**d, "schema_version": 99})
    assert summarize([]).to_dict()["cost"] == 0.0


def test_mean_price_weights_each_price_by_the_time_it_was_in_effect():
    # 0.30 in effect since before the start, 0.60 from t=1800 to t=2700, 0.30 again after: one hour
    changes = [(2700.0, 0.30), (-500.0, 0.30), (1800.0, 0.60)]  # any order
    assert mean_price(changes, 0.0, 3600.0, quoted=0.99) == pytest.approx((1800 * 0.3 + 900 * 0.6 + 900 * 0.3) / 3600)
    # with no change at or before the start, the launch price holds until the first change
    assert mean_price([(900.0, 0.40)], 0.0, 3600.0, quoted=0.20) == pytest.approx((900 * 0.2 + 2700 * 0.4) / 3600)
    # a change at the start takes effect at once; one at the end or later is not billed
    assert mean_price([(0.0, 0.50), (3600.0, 9.0), (9000.0, 9.0)], 0.0, 3600.0, quoted=0.20) == pytest.approx(0.50)
    assert mean_price([], 0.0, 60.0, quoted=0.25) == 0.25
    assert mean_price([(-1.0, 0.70)], 5.0, 5.0, quoted=0.25) == 0.70  # an empty window: the price then


def test_mean_price_refuses_bad_input_with_what_is_wrong():
    with pytest.raises(ValueError, match="ends before it starts"):
        mean_price([], 10.0, 5.0, quoted=0.1)
    with pytest.raises(ValueError, match="finite"):
        mean_price([(1.0, float("nan"))], 0.0, 5.0, quoted=0.1)


def test_a_restart_after_a_preemption_is_not_credited_as_savings():
    """Review: a segment on a warm instance is preempted and completes on a new one. An on-demand run
    would have gone on warm: the retry's boot, restore and 60 s minimum are the preemption's cost, and
    crediting the completed retry's whole bill made them savings."""
    lost = row(1, end=300.0, price=1.0, od=3.0, done=20, lost=5, outcome="preempted", step_seconds=10.0,
               new_instance=False)
    retry = row(2, start=400.0, end=500.0, price=1.0, od=3.0, done=5, step_seconds=10.0)  # 50 s restart
    s = summarize([lost, retry])
    assert s.on_demand_cost == pytest.approx((200 + 50) * 3.0 / 3600)
    # another segment's completed attempt keeps its whole bill
    other = row(3, start=600.0, end=700.0, price=1.0, od=3.0, done=5, step_seconds=10.0, segment_index=1)
    assert summarize([lost, retry, other]).on_demand_cost == pytest.approx((200 + 50 + 100) * 3.0 / 3600)
