"""The ``rc-cr`` anchor: the published multi-region RC/CR rule, on hand-computed cases."""
from __future__ import annotations

import pytest

from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec, SimPool, simulate
from airflow_spot.simulate.rc_cr import ON_DEMAND, SPOT, rc_cr_request

OD = 3.0
ON_DEMAND_OFFER = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, OD, OD, "V100", 1, 16.0)


def request(now, done, current=None, has_spot=True, restart_left=0.0):
    # 8000 s of work by 10000 s: the line asks for 0.8 s of work per second; a restart is 100 s
    return rc_cr_request(now=now, deadline=10000.0, work_total=8000.0, work_done=done, restart=100.0, gap=60.0,
                         current=current, has_spot=has_spot, restart_left=restart_left)


def test_behind_the_line_without_spot_is_on_demand_and_ahead_of_it_waits():
    # at 1000 s the line is at 800 s of work
    assert request(1000.0, 500.0, has_spot=False) == ON_DEMAND
    assert request(1000.0, 900.0, has_spot=False) is None
    assert request(1000.0, 500.0) == SPOT and request(1000.0, 900.0) == SPOT


def test_on_demand_is_left_only_two_restarts_ahead_of_the_line():
    # (1000 + 2 * 100) * 0.8 = 960 s of work: at 900 s done the job stays, at 1000 s it leaves
    assert request(1000.0, 900.0, current=ON_DEMAND) == ON_DEMAND
    assert request(1000.0, 1000.0, current=ON_DEMAND) == SPOT
    assert request(1000.0, 1000.0, current=ON_DEMAND, has_spot=False) == ON_DEMAND


def test_near_the_deadline():
    # at 2800 s, 7000 s of work left: work + two restarts (7200 s) no longer fit in the 7200 s left
    assert request(2800.0, 1000.0) == ON_DEMAND  # idle: on-demand although spot is up
    assert request(2800.0, 1000.0, current=SPOT) == SPOT  # a running spot instance keeps going
    # at 2900 s not even one restart fits (7140 s rounded up to the tick, against 7080 s left)
    assert request(2900.0, 1000.0, current=SPOT) == SPOT
    assert request(2900.0, 1000.0, current=SPOT, restart_left=50.0) == ON_DEMAND  # still restarting


def pool(zone, values, price=1.0):
    trace = SpotTrace(name=zone, zone=zone, gap_seconds=60.0, values=tuple(values))
    return SimPool(trace, Offer("p3.2xlarge", zone[:-1], zone, Market.SPOT, price, OD, "V100", 1, 16.0))


def test_replay_takes_the_cheapest_pool_up_and_runs_on_demand_only_while_behind_the_line():
    # 1 h of work by a 1.5 h deadline, 1 min restarts: spot for 20 min (the dearer pool never used), then
    # every pool down for good
    spec = JobSpec(work_hours=1.0, deadline_hours=1.5, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    pools = [pool("us-west-2a", [1] * 20 + [0] * 200, price=1.5), pool("us-west-2b", [1] * 20 + [0] * 200)]
    r = simulate(spec, pools, ON_DEMAND_OFFER, controllers.get("rc-cr")(), max_hours=2.0)
    assert r.completed and r.deadline_met and r.completion_hours == pytest.approx(89 / 60)
    assert (r.rows[0].zone, r.rows[0].market, r.rows[0].outcome) == ("us-west-2b", "spot", "preempted")
    assert {(x.market, x.outcome) for x in r.rows[1:]} == {("on-demand", "completed")}
    # 19 min of work at minute 20; the line (2/3 of a minute of work per minute) passes it at minute 28.5,
    # and the job starts on-demand at the first tick behind it. The published multi-region version
    # decides as if spot were there first: once on-demand has put the job two restarts ahead of the line,
    # it stops it, finds no spot and waits (ahead of the line) until it falls behind again: 9 min on
    # on-demand (1 min restart, 8 min of work) gain 2 min on the line, 3 min idle lose them
    starts = [x.started_at / 60 for x in r.rows[1:]]
    assert starts[:3] == pytest.approx([29, 41, 53])
    assert [x.ended_at / 60 for x in r.rows[1:3]] == pytest.approx([38, 50])
