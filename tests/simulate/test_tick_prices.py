"""A spot price that varies over the trace (the SkyPilot simulator's per-tick ``prices``): the replay offers
each tick's price to the policies, bills a running instance the price in effect, and the hindsight optimum
pays the same; ``--mean-prices`` replays the series at its mean. Hand-computed cases, 1-minute ticks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_spot.cli import main
from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec, SimPool, simulate
from airflow_spot.simulate.hindsight import _price_by_step, hindsight_cost
from airflow_spot.simulate.report import build_pools

OD = 6.0
ON_DEMAND = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, OD, OD, "V100", 1, 16.0)


def priced_pool(zone: str, prices: list[float], values: list[int] | None = None) -> SimPool:
    """A pool up throughout (unless ``values``), offered at the series' mean and priced per tick."""
    trace = SpotTrace(zone, zone, 60.0, tuple(values or [1] * len(prices)))
    mean = sum(prices) / len(prices)
    return SimPool(trace, Offer("p3.2xlarge", zone[:-1], zone, Market.SPOT, mean, OD, "V100", 1, 16.0),
                   prices=tuple(prices))


def flat(p: SimPool) -> SimPool:
    return SimPool(p.trace, p.offer)


def test_a_running_instance_is_billed_the_price_in_effect():
    # $1.2/h for 5 min, then $2.4/h; 10 min of work after a 1 min restart, run from minute 0:
    # 5 min at $1.2 and 6 at $2.4 = $0.34; at the mean ($2.3/h) it would be 11 min x $2.3 = $0.4217
    a = priced_pool("us-west-2b", [1.2] * 5 + [2.4] * 55)
    spec = JobSpec(work_hours=10 / 60, deadline_hours=30 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    r = simulate(spec, [a], ON_DEMAND, controllers.get("greedy")(), max_hours=1.0)
    assert r.completed and len(r.rows) == 1
    assert r.cost == pytest.approx(5 * 1.2 / 60 + 6 * 2.4 / 60)
    # the ledger row carries the mean price over the run, so its cost is what was billed
    assert r.rows[0].price_per_hour == pytest.approx(0.34 / (11 / 60))
    at_mean = simulate(spec, [flat(a)], ON_DEMAND, controllers.get("greedy")(), max_hours=1.0)
    assert at_mean.cost == pytest.approx(11 * 2.3 / 60)


class Recorder:
    """Runs on the first pool and notes the prices each decision was offered."""

    name = "recorder"
    emergency_save = True

    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []

    def decide(self, view):
        self.seen.append((view.now, view.pools[0].offer.price_per_hour))
        return ("spot", 0)

    def checkpoint_interval(self, view) -> float:
        return 3600.0


def test_each_decision_is_offered_the_price_of_its_tick():
    a = priced_pool("us-west-2b", [1.0] * 3 + [5.0] * 57)
    rec = Recorder()
    simulate(JobSpec(work_hours=0.1), [a], ON_DEMAND, rec, max_hours=0.2)
    prices = dict(rec.seen)
    assert prices[0.0] == 1.0 and prices[120.0] == 1.0 and prices[180.0] == 5.0 and prices[300.0] == 5.0
    # from a later start the replay's clock reads 0 at tick 2
    rec = Recorder()
    simulate(JobSpec(work_hours=0.1), [a], ON_DEMAND, rec, offset_ticks=2, max_hours=0.2)
    assert dict(rec.seen)[0.0] == 1.0 and dict(rec.seen)[60.0] == 5.0


@pytest.mark.parametrize("policy", ["ours", "greedy", "rc-cr"])
def test_policies_pick_the_pool_that_is_cheapest_now(policy):
    # a: $1/h for the first hour, then $3; b: $2.1 throughout; a's mean ($2) is below b's. Started at
    # minute 60, every policy must see that a now costs $3 and take b
    a = priced_pool("us-west-2a", [1.0] * 60 + [3.0] * 60)
    b = priced_pool("us-west-2b", [2.1] * 120)
    spec = JobSpec(work_hours=10 / 60, deadline_hours=40 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    early = simulate(spec, [a, b], ON_DEMAND, controllers.get(policy)(), max_hours=1.0)
    assert early.rows[0].zone == "us-west-2a"
    late = simulate(spec, [a, b], ON_DEMAND, controllers.get(policy)(), offset_ticks=60, max_hours=0.5)
    assert late.rows[0].zone == "us-west-2b" and late.cost == pytest.approx(11 * 2.1 / 60)
    at_mean = simulate(spec, [flat(a), flat(b)], ON_DEMAND, controllers.get(policy)(), offset_ticks=60, max_hours=0.5)
    assert at_mean.rows[0].zone == "us-west-2a" and at_mean.cost == pytest.approx(11 * 2.0 / 60)


def test_the_hindsight_optimum_follows_the_price():
    # a costs $1/h for 10 min, then $4; b the other way round; both up throughout. 20 min of work, 1 min
    # restart, deadline at 22 min: a for 10 min (1 + 9 of work), then b (1 + 11): 22 minutes at $1/h.
    # At their means (a $3.5/h, b $1.5/h) the best is b alone, 21 minutes at $1.5/h.
    a = priced_pool("us-west-2a", [1.0] * 10 + [4.0] * 50)
    b = priced_pool("us-west-2b", [4.0] * 10 + [1.0] * 50)
    spec = JobSpec(work_hours=20 / 60, deadline_hours=22 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    assert hindsight_cost(spec, [a, b], ON_DEMAND, step_seconds=60.0) == pytest.approx(22 * 1.0 / 60)
    assert hindsight_cost(spec, [flat(a), flat(b)], ON_DEMAND, step_seconds=60.0) == pytest.approx(21 * 1.5 / 60)
    # a step is charged its prices weighted by the time each holds in it (from a later start too, and past
    # the series' end at its last price)
    steps = _price_by_step([a, b], 0, 4, 180.0)
    assert steps[:, 0].tolist() == [1.0, 1.0, 1.0, 3.0] and steps[:, 1].tolist() == [4.0, 4.0, 4.0, 2.0]
    assert _price_by_step([a], 8, 2, 180.0)[:, 0].tolist() == [2.0, 4.0]
    assert _price_by_step([a], 9, 1, 90.0)[:, 0].tolist() == pytest.approx([(60 * 1.0 + 30 * 4.0) / 90])
    assert _price_by_step([a], 59, 2, 120.0)[:, 0].tolist() == [4.0, 4.0]


def sim_pool_file(root: Path, pool: str, values: list[int], prices: list[float]) -> None:
    (root / pool).mkdir()
    (root / pool / "full.json").write_text(json.dumps({
        "metadata": {"gap_seconds": 60, "price_info": {"price": prices[0], "on_demand_price": OD}},
        "data": values, "prices": prices}))


def test_build_pools_keeps_the_series_only_where_the_trace_prices_the_pool(tmp_path):
    sim_pool_file(tmp_path, "us-east-1f_v100_1", [0] * 4, [1.0, 1.0, 2.0, 2.0])
    from airflow_spot.market.traces import load_traces

    traces = load_traces(tmp_path)
    (p,), _ = build_pools(traces, spot_price=None, on_demand_price=None, nodes=2)
    assert p.prices == (2.0, 2.0, 4.0, 4.0) and p.offer.price_per_hour == pytest.approx(3.0)  # a gang of 2
    (p,), _ = build_pools(traces, spot_price=None, on_demand_price=None, tick_prices=False)
    assert p.prices is None and p.offer.price_per_hour == pytest.approx(1.5)
    (p,), _ = build_pools(traces, spot_price=0.5, on_demand_price=None)  # a price given overrides the series
    assert p.prices is None and p.offer.price_per_hour == 0.5


def test_simulate_replays_per_tick_prices_unless_told_to_use_their_mean(tmp_path, capsys):
    # one pool up throughout: $1/h for the first hour, then $3/h; 1 h of work from the start
    sim_pool_file(tmp_path, "us-east-1f_v100_1", [0] * 240, [1.0] * 60 + [3.0] * 180)
    argv = ["simulate", "--work-hours", "1", "--deadline-hours", "2", "--restart-overhead-hours", "0.05",
            "--traces", str(tmp_path), "--policies", "greedy,hindsight"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "$1-$3/h, mean $2.5/h" in out and "the price of each tick" in out
    assert "ran past the end" not in out  # the hindsight row has no completion time; it is not "late"
    by_tick = _cost(out, "greedy")
    assert by_tick == pytest.approx(1.0 + 0.05 * 3.0, abs=0.01)  # 1 h at $1, the last 3 min at $3
    assert main(argv + ["--mean-prices"]) == 0
    out = capsys.readouterr().out
    assert "charges its mean" in out
    assert _cost(out, "greedy") == pytest.approx(1.05 * 2.5, abs=0.01)
    # a price given replaces the files': nothing is said of theirs
    assert main(argv + ["--spot-price", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "varies over the trace" not in out and "prices from the trace files" not in out
    assert _cost(out, "greedy") == pytest.approx(1.05 * 0.5, abs=0.01)


def _cost(out: str, policy: str) -> float:
    line = next(x for x in out.splitlines() if x.split() and x.split()[0] == policy)
    return float(line.split()[1])  # the "cost $" column


def test_ours_leaves_a_running_pool_whose_price_passes_on_demand():
    """a: $1/h for 20 min, then $7/h, above on-demand's $6; b is down throughout. Running on a, ``ours``
    lets it go at its next decision (a segment boundary, 15 min later) and runs as an idle job would,
    rather than pay a's $7/h to the end."""
    a = priced_pool("us-west-2a", [1.0] * 20 + [7.0] * 100)
    b = priced_pool("us-west-2b", [1.0] * 120, values=[0] * 120)
    spec = JobSpec(work_hours=60 / 60, deadline_hours=100 / 60, save_cost_seconds=0.0,
                   restart_overhead_hours=1 / 60)
    r = simulate(spec, [a, b], ON_DEMAND, controllers.get("ours")(), max_hours=2.0)
    assert r.completed and r.deadline_met
    on_a = [row for row in r.rows if row.zone == "us-west-2a"]
    assert on_a and max(row.ended_at for row in on_a) <= 31 * 60  # gone by the boundary after minute 20
