"""`ours` replayed (observed events only): the decisions added for issue 11's targets, by mechanism."""
from __future__ import annotations

from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec, SimPool, simulate

SPOT, OD = 1.2, 3.6
ON_DEMAND = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, OD, OD, "V100", 1, 16.0)


def pool(zone, values):
    trace = SpotTrace(name=zone, zone=zone, gap_seconds=60.0, values=tuple(values))
    return SimPool(trace, Offer("p3.2xlarge", zone[:-1], zone, Market.SPOT, SPOT, OD, "V100", 1, 16.0,
                                preemption_rate_per_hour=1 / 3.6))


def test_after_a_preemption_a_pool_never_seen_down_is_tried_before_one_that_preempted_the_job_recently():
    """Three pools at one price, no deadline. The job starts in 2a (names break the tie: nothing seen),
    2a preempts it at minute 10, it moves to 2b, and 2b preempts it at minute 60. 2a is back since minute
    30, but the job last saw it lose capacity 50 min ago: if back, it is at most 50 min old, priced at
    1.52x its long-run preemption rate; 2c, never seen down, at 1x. The job goes to 2c, where the names'
    order (the rule before) took 2a again."""
    spec = JobSpec(work_hours=3, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    a = pool("us-west-2a", [1] * 10 + [0] * 20 + [1] * 300)
    b = pool("us-west-2b", [1] * 60 + [0] * 270)
    c = pool("us-west-2c", [1] * 330)
    ctl = controllers.get("ours")()
    r = simulate(spec, [a, b, c], ON_DEMAND, ctl, max_hours=5.0)
    launches = [(e.pool.split("@")[1], e.at / 60) for e in ctl.events if e.kind == "launched"]
    assert launches == [("us-west-2a", 0), ("us-west-2b", 10), ("us-west-2c", 60)]
    assert r.completed and [x.outcome for x in r.rows] == ["preempted", "preempted", "completed"]
