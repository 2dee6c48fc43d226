"""The hindsight optimum against hand-computed answers (1-minute grid)."""
from __future__ import annotations

import functools
import math
import random
from dataclasses import replace

import pytest

from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.engine import JobSpec, SimPool
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


def test_a_checkpoint_moved_across_regions_pays_the_transfer():
    # west up 10 min, then down; east up from minute 10; 20 min of work by minute 30, on-demand in the west.
    # Free transfer: west 0-10 (1 + 9), east 10-22 (1 + 11): 22 spot minutes. A 5 min transfer: the east
    # leg takes 1 + 5 + 11 (done at 27) for 27 spot minutes, plus $0.5 a move: on-demand in the west
    # (1 + 11 minutes, the checkpoint already there) is cheaper. East alone cannot finish by minute 30.
    east = SimPool(SpotTrace("e", "us-east-1a", 60.0, (0,) * 10 + (1,) * 50),
                   Offer("p3.2xlarge", "us-east-1", "us-east-1a", Market.SPOT, SPOT, OD, "V100", 1, 16.0))
    pools = [pool("us-west-2b", TRACE), east]
    spec = JobSpec(work_hours=20 / 60, deadline_hours=30 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    assert hindsight_cost(spec, pools, ON_DEMAND, step_seconds=60.0) == pytest.approx(22 * SPOT / 60)
    slow = replace(spec, transfer_seconds=300.0)
    assert hindsight_cost(slow, pools, ON_DEMAND, step_seconds=60.0) == pytest.approx(27 * SPOT / 60)
    dear = replace(slow, transfer_dollars=0.5)
    assert hindsight_cost(dear, pools, ON_DEMAND, step_seconds=60.0) == pytest.approx(10 * SPOT / 60 + 12 * OD / 60)
    # on-demand in the east too: started before the east pool comes up, its checkpoint is written in the
    # east, so the job moves to the east pool with no transfer (1 + 1 on-demand minutes, 1 + 19 on spot)
    east_od = replace(ON_DEMAND, region="us-east-1", zone="us-east-1")
    assert hindsight_cost(dear, pools, east_od, step_seconds=60.0) == pytest.approx(2 * OD / 60 + 20 * SPOT / 60)


def test_running_outside_the_stores_region_pays_its_saves_back_by_the_hour():
    # both pools up throughout; the east is cheaper ($0.9 against $1.2/h), the store is in the west. Saves
    # written back at $0.6 an hour make the east $1.5/h: the job runs in the west (1 + 20 minutes)
    east = SimPool(SpotTrace("e", "us-east-1a", 60.0, (1,) * 60),
                   Offer("p3.2xlarge", "us-east-1", "us-east-1a", Market.SPOT, 0.9, OD, "V100", 1, 16.0))
    pools = [pool("us-west-2b", [1] * 60), east]
    spec = JobSpec(work_hours=20 / 60, deadline_hours=30 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60,
                   store_region="us-west-2")
    assert hindsight_cost(spec, pools, ON_DEMAND, step_seconds=60.0) == pytest.approx(21 * 0.9 / 60)
    saves = replace(spec, remote_dollars_per_hour=0.6)
    assert hindsight_cost(saves, pools, ON_DEMAND, step_seconds=60.0) == pytest.approx(21 * SPOT / 60)
    assert _explicit(saves, pools, ON_DEMAND) == pytest.approx(21 * SPOT / 60)
    with pytest.raises(ValueError, match="give the store's region"):
        replace(spec, store_region=None, remote_dollars_per_hour=0.6)


def test_an_instance_given_up_while_the_checkpoint_moves_leaves_it_where_it_was():
    # the east pool is up in minute 2 and from minute 10. Had a move started in minute 2 and given up put
    # the checkpoint in the east, on-demand (west) for 1 + 1 minutes and the east pool from minute 10
    # (1 + 19) would do. It does not: from minute 10 the move takes 1 + 5 minutes, so on-demand carries 6
    # minutes of work (1 + 6), the east pool the other 14 (1 + 5 + 14, done at minute 30).
    east = SimPool(SpotTrace("e", "us-east-1a", 60.0, (0, 0, 1) + (0,) * 7 + (1,) * 50),
                   Offer("p3.2xlarge", "us-east-1", "us-east-1a", Market.SPOT, SPOT, OD, "V100", 1, 16.0))
    spec = JobSpec(work_hours=20 / 60, deadline_hours=30 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60,
                   transfer_seconds=300.0)
    best = 7 * OD / 60 + 20 * SPOT / 60
    assert hindsight_cost(spec, [east], ON_DEMAND, step_seconds=60.0) == pytest.approx(best)
    assert _explicit(spec, [east], ON_DEMAND) == pytest.approx(best)


def _explicit(spec, pools, on_demand, step_seconds=60.0):
    """The same optimum by an explicit search over every state (time, work, place, restart left, checkpoint
    region; with a store region the checkpoint is always there): slow, obviously right."""
    work, horizon = round(spec.work_hours * 3600 / step_seconds), round(spec.deadline_hours * 3600 / step_seconds)
    restart, move = round(spec.restart_overhead_hours * 3600 / step_seconds), round(spec.transfer_seconds / step_seconds)
    places = [(on_demand.region, on_demand.price_per_hour, None)] + [
        (p.offer.region, p.offer.price_per_hour, p.trace.values) for p in pools]

    store = spec.store_region

    @functools.lru_cache(None)
    def best(t, done, place, left, ckpt):
        if done == work:
            return 0.0
        if t == horizon:
            return math.inf
        out = best(t + 1, done, None, 0, ckpt)  # idle
        for q, (region, price, values) in enumerate(places):
            if values is not None and not values[t]:
                continue
            remote = spec.remote_dollars_per_hour if store and region != store else 0.0  # saves written back
            step = (price + remote) * step_seconds / 3600
            if q == place:  # stay: restart, or progress (the checkpoint is here from now on)
                nxt = best(t + 1, done, q, left - 1, ckpt) if left else best(t + 1, done + 1, q, 0, store or region)
                out = min(out, step + nxt)
            elif ckpt is None or ckpt == region:
                out = min(out, step + best(t + 1, done, q, restart - 1, ckpt))
            else:
                out = min(out, step + spec.transfer_dollars + best(t + 1, done, q, restart + move - 1, ckpt))
        return out

    return best(0, 0, None, 0, store)


@pytest.mark.parametrize("seed", range(10))
def test_matches_an_explicit_search_on_random_traces_across_regions(seed):
    rng = random.Random(seed)
    zones = ["us-west-2b", "us-west-2c", "us-east-1a"]
    pools = [SimPool(SpotTrace(z, z, 60.0, tuple(int(rng.random() < 0.7) for _ in range(40))),
                     Offer("p3.2xlarge", z[:-1], z, Market.SPOT, rng.choice([0.9, 1.2, 1.5]), OD, "V100", 1, 16.0))
             for z in zones]
    od = replace(ON_DEMAND, region=rng.choice(["us-west-2", "us-east-1"]))
    store = rng.choice([None, "us-west-2", "eu-west-1"])
    spec = JobSpec(work_hours=12 / 60, deadline_hours=20 / 60, save_cost_seconds=0.0,
                   restart_overhead_hours=rng.choice([1, 2]) / 60, transfer_seconds=rng.choice([0, 60, 180]),
                   transfer_dollars=rng.choice([0.0, 0.05]), store_region=store,
                   remote_dollars_per_hour=rng.choice([0.0, 0.6]) if store else 0.0)
    assert hindsight_cost(spec, pools, od, step_seconds=60.0) == pytest.approx(_explicit(spec, pools, od))
