"""`ours` as the operators run it (observed events only), the baselines' stated pick rule, multi-node
traces, per-zone prices and the hindsight column of `airflow-spot simulate`."""
from __future__ import annotations

import json

import pytest

from airflow_spot.cli import main
from airflow_spot.market.traces import SpotTrace, TraceError, parse_trace
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec, SimPool, simulate
from airflow_spot.simulate.report import build_pools, read_prices, run_jobs, run_one

SPOT, OD = 1.2, 3.6
ON_DEMAND = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, OD, OD, "V100", 1, 16.0)


def pool(zone, values, price=SPOT):
    trace = SpotTrace(name=zone, zone=zone, gap_seconds=60.0, values=tuple(values))
    return SimPool(trace, Offer("p3.2xlarge", zone[:-1], zone, Market.SPOT, price, OD, "V100", 1, 16.0))


def test_ours_learns_capacity_only_by_trying():
    # down for 21 min, then up; no deadline: ours retries every minute and is refused until minute 21
    spec = JobSpec(work_hours=10 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    c = controllers.get("ours")()
    r = simulate(spec, [pool("us-west-2b", [0] * 21 + [1] * 60)], ON_DEMAND, c, max_hours=2.0)
    # of the run of refusals the first and the newest are kept (all the decision reads of a run)
    assert [(e.kind, e.at / 60) for e in c.events] == [("refused", 0), ("refused", 20), ("launched", 21)]
    assert r.rows[0].started_at == 21 * 60 and r.on_demand_hours == 0


def test_probes_on_on_demand_are_charged():
    # 3 h of work, 4 h deadline; the pool is down 20-100 min: ours goes on-demand, probes every 15 min
    # once a switch could pay off, and leaves on-demand after seeing the pool up 45 min
    spec = JobSpec(work_hours=3, deadline_hours=4, save_cost_seconds=0.0, restart_overhead_hours=0.1)
    trace = [1] * 20 + [0] * 80 + [1] * 200
    c = controllers.get("ours")()
    r = simulate(spec, [pool("us-west-2b", trace)], ON_DEMAND, c, max_hours=5.0)
    ups = [e.at for e in c.events if e.kind == "probe-up"]
    assert r.deadline_met and c.probes_made >= 3 and c.probes_accepted >= 3
    assert c.probe_cost == pytest.approx(c.probes_accepted * SPOT / 60)  # one billed minute per accepted probe
    assert r.cost == pytest.approx(sum(x.cost for x in r.rows) + c.probe_cost)
    spot2 = r.rows[-1]
    assert spot2.market == "spot" and spot2.started_at - ups[0] >= 45 * 60
    nop = controllers.get("ours-no-probe")()
    assert simulate(spec, [pool("us-west-2b", trace)], ON_DEMAND, nop, max_hours=5.0).rows[-1].market == "on-demand"


@pytest.mark.parametrize("minutes", [15, 30])
def test_ours_leaves_on_demand_only_at_a_segment_boundary(minutes):
    # the operators decide at segment boundaries: an on-demand instance is kept for whole segments, and
    # the move back to spot comes at one of them, however early the pool settled
    spec = JobSpec(work_hours=3, deadline_hours=4, save_cost_seconds=0.0, restart_overhead_hours=0.1,
                   segment_seconds=minutes * 60.0)
    trace = [1] * 20 + [0] * 80 + [1] * 200
    r = simulate(spec, [pool("us-west-2b", trace)], ON_DEMAND, controllers.get("ours")(), max_hours=5.0)
    od, back = r.rows[-2], r.rows[-1]
    assert (od.market, back.market) == ("on-demand", "spot") and r.deadline_met
    assert (back.started_at - od.started_at) % (minutes * 60) == pytest.approx(0.0)
    assert back.started_at - od.started_at >= 45 * 60  # and the pool had been seen up 45 min


def test_two_jobs_meeting_the_same_outage_together_cost_what_one_does():
    # both are refused each minute until minute 21: the other's refusals are no news to either
    spec = JobSpec(work_hours=10 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    pools = [pool("us-west-2b", [0] * 21 + [1] * 60)]
    one = run_one(spec, pools, ON_DEMAND, "ours", jobs=1)
    both = run_jobs(spec, pools, ON_DEMAND, "ours", jobs=2)
    assert all(r.cost == pytest.approx(one.cost) and r.rows[0].started_at == 21 * 60 for r in both)
    assert run_one(spec, pools, ON_DEMAND, "ours", jobs=2).cost == pytest.approx(one.cost)  # the jobs' mean


def test_jobs_replayed_together_read_each_others_events_as_they_happen():
    """Two jobs of one deployment start together. The first cannot probe: alone, it never sees the pool
    settle and stays on on-demand to the end; beside a job that probes, it reads that job's probes (made
    after both started, so a replay of the jobs one after the other could not show them to it) and leaves
    on-demand at the same boundary as the prober."""
    from airflow_spot.simulate.engine import simulate_together
    from airflow_spot.simulate.observed import OtherJobs

    spec = JobSpec(work_hours=3, deadline_hours=4, save_cost_seconds=0.0, restart_overhead_hours=0.1)
    trace = [1] * 20 + [0] * 80 + [1] * 200
    blind, prober = controllers.get("ours-no-probe")(), controllers.get("ours")()
    blind.shared, prober.shared = OtherJobs([("prober", prober)]), OtherJobs([("blind", blind)])
    rb, rp = simulate_together(spec, [pool("us-west-2b", trace)], ON_DEMAND, [blind, prober], max_hours=5.0)
    assert prober.probes_made >= 3 and blind.probes_made == 0
    assert [r.market for r in rb.rows] == ["spot", "on-demand", "spot"]
    assert rb.rows[-1].started_at == rp.rows[-1].started_at and rb.deadline_met
    assert not any(e.kind.startswith("probe") for e in blind.events)  # what it learnt of the pool, it read
    assert any(e.kind == "probe-up" and e.job == "prober" for e in blind.shared)
    alone = simulate(spec, [pool("us-west-2b", trace)], ON_DEMAND, controllers.get("ours-no-probe")(), max_hours=5.0)
    assert alone.rows[-1].market == "on-demand" and alone.cost > rb.cost


def test_jobs_replayed_together_decide_in_time_order():
    """simulate_together interleaves the jobs' decisions by time (at equal times in the jobs' order),
    however differently often each decides."""
    log = []

    class Every:
        emergency_save = True

        def __init__(self, name, seconds):
            self.name, self.seconds, self.next_decision_at = name, seconds, 0.0

        def decide(self, view):
            log.append((view.now, self.name))
            if view.now >= self.next_decision_at:
                self.next_decision_at = view.now + self.seconds
            return ("on-demand", 0)

        def checkpoint_interval(self, view):
            return 3600.0

    from airflow_spot.simulate.engine import simulate_together

    spec = JobSpec(work_hours=0.5, save_cost_seconds=0.0, restart_overhead_hours=0.0)
    results = simulate_together(spec, [pool("us-west-2b", [1] * 100)], ON_DEMAND,
                                [Every("slow", 300.0), Every("fast", 25.0)])
    assert all(r.completed for r in results)
    assert log == sorted(log, key=lambda x: (x[0], x[1] != "slow"))
    assert {n for _, n in log} == {"slow", "fast"} and len([1 for _, n in log if n == "fast"]) > 60


@pytest.mark.parametrize("name", ["greedy", "up-any-zone", "rc-cr", "adrs-gepa", "fixed-one-zone"])
def test_baselines_do_not_depend_on_the_order_zones_are_listed_in(name):
    # b is cheaper and up from the start; a is dearer; whichever comes first in the list, b is taken
    spec = JobSpec(work_hours=10 / 60, deadline_hours=1.0, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    a, b = pool("us-west-2a", [1] * 90, price=1.5), pool("us-west-2b", [1] * 90, price=1.0)
    results = [simulate(spec, ps, ON_DEMAND, controllers.get(name)(), max_hours=1.5) for ps in ([a, b], [b, a])]
    assert [r.rows[0].zone for r in results] == ["us-west-2b", "us-west-2b"]
    assert results[0].cost == pytest.approx(results[1].cost)


def test_equal_prices_take_the_pool_up_the_longest():
    spec = JobSpec(work_hours=10 / 60, deadline_hours=1.0, save_cost_seconds=0.0, restart_overhead_hours=1 / 60)
    # at the job's start (tick 5) a has been up 2 ticks, b 5
    a, b = pool("us-west-2a", [0] * 3 + [1] * 90), pool("us-west-2b", [1] * 95)
    r = simulate(spec, [a, b], ON_DEMAND, controllers.get("greedy")(), offset_ticks=5, max_hours=1.5)
    assert r.rows[0].zone == "us-west-2b"


def test_multi_node_traces_load_as_counts_and_a_gang_needs_all_its_nodes():
    name = "availability/4-node/aws-10-26-2022/us-west-2a_v100_1.json"  # the N of an N-node folder bounds counts
    t = parse_trace({"metadata": {"gap_seconds": 60}, "data": [4, 2, 0, 3]}, name=name)
    assert t.max_count == 4 and t.up_for(3) == (True, False, False, True) and t.up_fraction() == 0.75
    for bad in ([1, -1], [1, 5]):
        with pytest.raises(TraceError, match="whole count of instances from 0 to 4"):
            parse_trace({"metadata": {"gap_seconds": 60}, "data": bad}, name=name)
    with pytest.raises(TraceError, match="N-node"):  # a one-node trace holds 0/1 only
        parse_trace({"metadata": {"gap_seconds": 60}, "data": [4, 2]}, name="us-west-2a_v100_4.json")
    # 2 instances for 10 min: the pool holds 2 for 5 min, then 1: the gang is preempted at minute 5
    spec = JobSpec(work_hours=10 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60, nodes=2)
    trace = SpotTrace("z", "us-west-2b", 60.0, (2,) * 5 + (1,) * 10 + (2,) * 60)
    pools, od = build_pools([trace], spot_price=1.0, on_demand_price=3.0, nodes=2)
    assert pools[0].offer.price_per_hour == 2.0 and od.price_per_hour == 6.0  # the gang's price
    r = simulate(spec, pools, od, controllers.get("oracle-age")(), max_hours=1.0)
    assert r.rows[0].outcome == "preempted" and r.rows[0].ended_at == 5 * 60
    assert r.rows[1].started_at == 15 * 60
    single = simulate(JobSpec(work_hours=10 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60),
                      pools, od, controllers.get("oracle-age")(), max_hours=1.0)
    assert single.preemptions == 0


def test_prices_file(tmp_path):
    f = tmp_path / "p.csv"
    f.write_text("zone,spot,on_demand\nus-west-2b,0.9,3.06\nus-east-1a,0.7,3.2\n")
    assert read_prices(f) == {"us-west-2b": (0.9, 3.06), "us-east-1a": (0.7, 3.2)}
    for bad, msg in (("us-west-2b,x,3\n", "must be numbers"), ("us-west-2b,1\n", "zone,spot,on_demand"),
                     ("us-west-2b,0,3\n", "positive"), ("us-west-2b,inf,3\n", "finite"),
                     ("us-west-2b,1,nan\n", "finite"), ("a,1,2\na,1,2\n", "twice")):
        f.write_text(bad)
        with pytest.raises(ValueError, match=msg):
            read_prices(f)
    with pytest.raises(ValueError, match="is a folder"):
        read_prices(tmp_path)
    traces = [SpotTrace("z", "us-west-2b", 60.0, (1, 1)), SpotTrace("y", "us-east-1a", 60.0, (1, 1))]
    f.write_text("us-west-2b,0.9,3.06\nus-east-1a,0.7,3.2\n")
    pools, od = build_pools(traces, spot_price=None, on_demand_price=None, prices=read_prices(f))
    assert [p.offer.price_per_hour for p in pools] == [0.9, 0.7]
    assert (od.region, od.price_per_hour) == ("us-west-2", 3.06)  # the cheapest on-demand
    f.write_text("us-west-2b,0.9,3.06\n")
    with pytest.raises(ValueError, match="no line for zones"):
        build_pools(traces, spot_price=None, on_demand_price=None, prices=read_prices(f))


def test_cross_region_moves_are_charged(tmp_path):
    spec = JobSpec(work_hours=20 / 60, deadline_hours=2.0, save_cost_seconds=0.0, restart_overhead_hours=1 / 60,
                   transfer_seconds=300.0, transfer_dollars=0.5)
    west = pool("us-west-2b", [1] * 10 + [0] * 200)
    east = SimPool(SpotTrace("e", "us-east-1a", 60.0, (0,) * 5 + (1,) * 205),
                   Offer("p3.2xlarge", "us-east-1", "us-east-1a", Market.SPOT, SPOT, OD, "V100", 1, 16.0))
    r = simulate(spec, [west, east], ON_DEMAND, controllers.get("oracle-age")(), max_hours=3.0)
    assert [x.region for x in r.rows] == ["us-west-2", "us-east-1"]
    # 1 + 9 min in the west; in the east 1 min restart + 5 min transfer + 11 min of work, plus $0.5
    assert r.rows[1].ended_at - r.rows[1].started_at == pytest.approx((1 + 5 + 11) * 60)
    # the egress is on the ledger row of the attempt that paid it, as the operators record it
    assert [x.transfer_dollars for x in r.rows] == [0.0, 0.5]
    assert r.cost == pytest.approx(sum(x.cost for x in r.rows)) and r.rows[1].cost == pytest.approx(17 * SPOT / 60 + 0.5)


class _Scripted:
    """Runs where it is told, minute by minute, and notes where the replay says the checkpoint is."""

    name, emergency_save = "scripted", True

    def __init__(self, plan):
        self.plan, self.seen = plan, {}

    def decide(self, view):
        self.seen[view.now] = view.checkpoint_region
        return next(where for until, where in self.plan if view.now < until)

    def checkpoint_interval(self, view):
        return 3600.0


def test_a_move_given_up_before_the_new_instance_made_progress_leaves_the_checkpoint_where_it_was():
    spec = JobSpec(work_hours=10 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60,
                   transfer_seconds=300.0, transfer_dollars=0.5)
    west = pool("us-west-2b", [1] * 60)
    east = SimPool(SpotTrace("e", "us-east-1a", 60.0, (1,) * 60),
                   Offer("p3.2xlarge", "us-east-1", "us-east-1a", Market.SPOT, SPOT, OD, "V100", 1, 16.0))
    # west for 3 min (1 restart + 2 of work), east for 2 (still moving the checkpoint), west again
    c = _Scripted([(180, ("spot", 0)), (300, ("spot", 1)), (10**9, ("spot", 0))])
    r = simulate(spec, [west, east], ON_DEMAND, c, max_hours=1.0)
    assert (c.seen[0.0], c.seen[180.0], c.seen[240.0], c.seen[300.0]) == (None, "us-west-2", "us-west-2", "us-west-2")
    assert [x.region for x in r.rows] == ["us-west-2", "us-east-1", "us-west-2"]
    # back in the west: 1 min restart and the 8 min left, no transfer; one move paid, the one begun
    assert r.rows[2].ended_at - r.rows[2].started_at == pytest.approx(9 * 60)
    assert [x.transfer_dollars for x in r.rows] == [0.0, 0.5, 0.0]


def test_with_one_store_every_instance_outside_its_region_pays_the_transfer():
    # the operators' model: checkpoints in one bucket in us-west-2; the east pool restores from it and
    # saves back, on its first instance too (preempted at minute 8, then again from minute 10)
    spec = JobSpec(work_hours=10 / 60, save_cost_seconds=0.0, restart_overhead_hours=1 / 60,
                   transfer_seconds=120.0, transfer_dollars=0.5, store_region="us-west-2")
    east = SimPool(SpotTrace("e", "us-east-1a", 60.0, (1,) * 8 + (0,) * 2 + (1,) * 50),
                   Offer("p3.2xlarge", "us-east-1", "us-east-1a", Market.SPOT, SPOT, OD, "V100", 1, 16.0))
    c = _Scripted([(480, ("spot", 0)), (600, None), (10**9, ("spot", 0))])
    r = simulate(spec, [east], ON_DEMAND, c, max_hours=1.0)
    assert set(c.seen.values()) == {"us-west-2"}
    # 1 + 2 + 5 minutes, then 1 + 2 + the 5 left: two transfers paid
    assert [x.ended_at - x.started_at for x in r.rows] == pytest.approx([480, 480])
    assert [x.transfer_dollars for x in r.rows] == [0.5, 0.5]


def test_cli_store_region_prices_every_attempt_outside_it(tmp_path, capsys):
    d = tmp_path / "traces"
    d.mkdir()
    for zone, values in (("us-west-2b", [1] * 240), ("us-east-1a", [1] * 240)):
        (d / f"{zone}_v100_1.json").write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": values}))
    prices = tmp_path / "prices.csv"
    prices.write_text("us-west-2b,1.0,3.0\nus-east-1a,0.9,3.0\n")  # the east is cheaper by $0.1/h
    base = ["simulate", "--work-hours", "1", "--deadline-hours", "2", "--restart-overhead-hours", "0.1",
            "--traces", str(d), "--prices", str(prices), "--policies", "ours,hindsight", "--json",
            str(tmp_path / "out.json")]

    def run(*extra):
        assert main(base + list(extra)) == 0
        assert "us-west-2" in capsys.readouterr().out
        return {r["policy"]: r for r in json.loads((tmp_path / "out.json").read_text())["runs"]}

    free, held = run(), run("--store-region", "us-west-2", "--transfer-dollars", "1")
    # the east is cheaper by $0.1/h; with the store in the west, a $1 restore there outweighs that for an hour
    # (1 h of work + a 0.1 h restart, in the east at $0.9/h, then in the west at $1/h)
    assert (free["ours"]["cost"], free["hindsight"]["cost"]) == pytest.approx((0.9 * 1.1, 0.9 * 1.1), rel=0.01)
    assert (held["ours"]["cost"], held["hindsight"]["cost"]) == pytest.approx((1.1, 1.1), rel=0.01)
    # a 2 GiB checkpoint at $0.02 a GiB: its restore ($0.04) is less than the east saves over the job
    # ($0.11), but its saves back, one a 15-min segment, cost $0.16 an hour in the east: the job stays west
    gib = ("--store-region", "us-west-2", "--checkpoint-gib", "2", "--transfer-dollars-per-gib", "0.02")
    per_gib = run(*gib)
    assert (per_gib["ours"]["cost"], per_gib["hindsight"]["cost"]) == pytest.approx((1.1, 1.1), rel=0.01)
    # with hour-long segments the saves cost $0.04 an hour: the east, paying the restore and its saves
    hourly = run(*gib, "--segment-minutes", "60")
    east = 0.9 * 1.1 + 0.04 + 0.04 * 1.1
    assert (hourly["ours"]["cost"], hourly["hindsight"]["cost"]) == pytest.approx((east, east), rel=0.01)
    assert main(base + ["--transfer-dollars", "-1"]) == 2
    assert "--transfer-dollars must be >= 0" in capsys.readouterr().err
    assert main(base + ["--store-region", "us-west-2", "--transfer-dollars-per-gib", "0.02"]) == 2
    assert "give its size with --checkpoint-gib" in capsys.readouterr().err
    assert main(base + ["--store-region", "us-west-2b"]) == 2
    assert "is a zone; give its region (us-west-2)" in capsys.readouterr().err


def test_cli_hindsight_column_prices_and_nodes(tmp_path, capsys):
    d = tmp_path / "availability" / "2-node"  # counts up to 2 are valid under a 2-node folder
    d.mkdir(parents=True)
    (d / "us-west-2b_v100_2.json").write_text(json.dumps({"metadata": {"gap_seconds": 60},
                                                          "data": [2] * 30 + [1] * 30 + [2] * 120}))
    prices = tmp_path / "prices.csv"
    prices.write_text("us-west-2b,1.0,3.0\n")
    args = ["simulate", "--work-hours", "1", "--deadline-hours", "1.5", "--restart-overhead-hours", "0.05",
            "--traces", str(d), "--prices", str(prices), "--nodes", "2", "--policies", "ours,greedy,hindsight"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "x hindsight" in out and "hindsight optimum = $" in out and "2 node(s)" in out
    row = next(line for line in out.splitlines() if line.startswith("hindsight"))
    assert row.split()[3] == "1.000"  # hindsight / hindsight
    assert main(args[:-2] + ["--nodes", "3"]) == 2
    assert "never show that many" in capsys.readouterr().err
    assert main(["simulate", "--work-hours", "1", "--traces", str(d), "--prices", str(prices),
                 "--policies", "hindsight"]) == 2
    assert "needs a deadline" in capsys.readouterr().err


def test_cli_jobs_prints_a_row_per_job_of_a_policy_that_reads_the_others(tmp_path, capsys):
    """`simulate --jobs 2`: ours (whose jobs read each other's events) gets a row per job; greedy, which
    reads nothing of the others, one row; the JSON holds the same runs."""
    trace = tmp_path / "us-west-2b_v100_1.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [1] * 20 + [0] * 30 + [1] * 200}))
    out_json = tmp_path / "out.json"
    assert main(["simulate", "--work-hours", "2", "--deadline-hours", "3", "--traces", str(trace),
                 "--spot-price", "1", "--on-demand-price", "3", "--policies", "ours,greedy", "--jobs", "2",
                 "--json", str(out_json)]) == 0
    rows = [line.split()[0:3] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("ours", "greedy"))]
    assert [r[:3] for r in rows][:2] == [["ours", "(job", "1/2)"], ["ours", "(job", "2/2)"]]
    assert [r[0] for r in rows] == ["ours", "ours", "greedy"]
    runs = json.loads(out_json.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["ours (job 1/2)", "ours (job 2/2)", "greedy"]
    assert all(r["deadline_met"] for r in runs)


def test_replayed_jobs_checkpoint_as_the_session_would_given_the_notices_they_get():
    from airflow_spot.policy.checkpoint_interval import daly_interval, estimate_mtbf
    from airflow_spot.simulate.engine import View
    from airflow_spot.simulate.observed import session_interval

    spec = JobSpec(work_hours=3, save_cost_seconds=10.0, notice_seconds=120.0)
    p = pool("us-west-2b", [1] * 10)

    def view(counts, spec=spec, running=("spot", 0)):
        return View(now=7200.0, spec=spec, pools=[p], on_demand=ON_DEMAND, up=[True], last_capacity_loss={},
                    up_since={}, our_preemptions={}, our_preemption_counts=counts, work_done=0.0, running=running)

    m = estimate_mtbf(3.6 * 3600, 2, 7200.0)
    # no emergency saves (or saves that outlast the notice): every preemption loses work, plain Daly
    assert session_interval(view({p.name: 2}), 3.6, emergency_save=False) == pytest.approx(daly_interval(10, m))
    slow = JobSpec(work_hours=3, save_cost_seconds=150.0, notice_seconds=120.0)
    assert session_interval(view({p.name: 2}, spec=slow), 3.6, True) == pytest.approx(daly_interval(150, m))
    # the replay delivers every notice and the save fits it: the job's preemptions were all covered, so its
    # periodic saves insure only the misses the prior still allows, up to the hourly ceiling
    q = (5 * 0.99 + 2) / 7
    covered = session_interval(view({p.name: 2}), 3.6, True)
    assert covered == pytest.approx(min(3600.0, daly_interval(10, m / (1 - q))))
    assert covered > 5 * daly_interval(10, m)
    assert session_interval(view({}, running=("on-demand", 0)), 3.6, True) == 3600.0


def test_ours_decides_at_its_own_times_inside_a_coarse_trace_tick():
    # a trace sampled every 10 min (the availability traces): preempted at 60 min, capacity back at 90.
    # The operators retry a job waiting for capacity every minute; the replay asks `ours` then too, with
    # the tick's capacity, so the minute's grace is a minute, not a whole tick
    spec = JobSpec(work_hours=10, deadline_hours=11, save_cost_seconds=0.0, restart_overhead_hours=0.1)
    trace = SpotTrace(name="us-west-2b", zone="us-west-2b", gap_seconds=600.0, values=(1,) * 6 + (0,) * 3 + (1,) * 80)
    p = SimPool(trace, Offer("p3.2xlarge", "us-west-2", "us-west-2b", Market.SPOT, SPOT, OD, "V100", 1, 16.0))
    c = controllers.get("ours")()
    r = simulate(spec, [p], ON_DEMAND, c, max_hours=12)
    od = next(x for x in r.rows if x.market == "on-demand")
    assert od.started_at == 3600 + c.recheck_seconds
    # on on-demand it decides at segment boundaries, also between two of the trace's ticks
    assert any((x.started_at - od.started_at) % 600 != 0 for x in r.rows if x.started_at > od.started_at)


def _probe_misses(miss, retries, times=400):
    """Share of probes of an up pool that read down, and whether a down pool ever read up."""
    from types import SimpleNamespace

    from airflow_spot.simulate.observed import ObservedController

    pools = [pool("us-west-2b", [1]), pool("us-west-2c", [0])]
    spec = JobSpec(work_hours=1, probe_miss=miss)
    c = ObservedController("ours", probe_retries=retries)
    for k in range(times):
        c._probe(SimpleNamespace(pools=pools, up=[True, False], now=900.0 * k, spec=spec, window_start=0.0))
    reads = [(e.pool, e.kind) for e in c.events]
    assert len(reads) >= 2  # runs of equal reads are folded; the folding keeps first and newest
    up_pool = [e for e in c.events if e.pool == pools[0].name]
    false_up = any(e.kind == "probe-up" for e in c.events if e.pool == pools[1].name)
    return (times - c.probes_accepted) / times, false_up, c.probe_cost, up_pool


def test_probes_that_miss_read_some_up_pools_down_never_a_down_pool_up():
    """A probe of a pool with capacity misses with probability probe_miss (the request not fulfilled, not
    billed); a fulfilled request is capacity, so a down pool never reads up. The draws are reproducible,
    and asking a refused probe again (the operators' PROBE_RETRIES) leaves about miss^2."""
    exact, false_up, cost, _ = _probe_misses(0.0, 0)
    assert exact == 0 and not false_up and cost == pytest.approx(400 * SPOT / 60)
    once, false_up, cost, events = _probe_misses(0.3, 0)
    assert 0.2 < once < 0.4 and not false_up and cost == pytest.approx(400 * (1 - once) * SPOT / 60)
    assert _probe_misses(0.3, 0)[3] == events  # reproducible
    twice, false_up, _, _ = _probe_misses(0.3, 1)
    assert 0.03 < twice < 0.16 and not false_up


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan")])
def test_probe_miss_must_be_a_probability(bad, capsys):
    with pytest.raises(ValueError, match="probe_miss is a probability"):
        JobSpec(work_hours=1, probe_miss=bad)
    assert main(["simulate", "--work-hours", "1", "--probe-miss", str(bad)]) == 2
    assert "--probe-miss is a probability in [0, 1)" in capsys.readouterr().err  # the flag, not the field


def test_ours_moves_a_running_job_to_a_cheaper_pool_once_it_accepts():
    # the cheap pool is down for the first hour: ours starts in the dear one. At the segment boundaries
    # where a move would pay it probes the cheap pool (one billed minute when it accepts) and moves once
    # the probes have seen it up 45 min; greedy, which never moves, stays
    spec = JobSpec(work_hours=6, save_cost_seconds=0.0, restart_overhead_hours=0.1)
    pools = [pool("us-west-2a", [0] * 60 + [1] * 600, price=0.6), pool("us-west-2b", [1] * 660, price=1.2)]
    c = controllers.get("ours")()
    r = simulate(spec, pools, ON_DEMAND, c, max_hours=10.0)
    assert [(x.zone, x.outcome) for x in r.rows] == [("us-west-2b", "completed"), ("us-west-2a", "completed")]
    assert r.rows[1].started_at == 105 * 60  # seen up since minute 60
    # refused at the start; at 15 and 30 min a pool seen down so lately is not worth a move; probed at 45
    # (down), 60, 75 and 90 min (up: a run of them is kept as its first and newest)
    assert [(e.kind, e.at / 60) for e in c.events if e.pool.endswith("us-west-2a")][:5] == [
        ("refused", 0), ("probe-down", 45), ("probe-up", 60), ("probe-up", 90), ("launched", 105)]
    assert c.probes_accepted == 3 and c.probe_cost == pytest.approx(3 * 0.6 / 60)
    # a backend that cannot probe moves at the first boundary at which the cheap pool accepts
    blind = controllers.get("ours-no-probe")()
    assert simulate(spec, pools, ON_DEMAND, blind, max_hours=10.0).rows[1].started_at == 60 * 60
    greedy = simulate(spec, pools, ON_DEMAND, controllers.get("greedy")(), max_hours=10.0)
    assert [x.zone for x in greedy.rows] == ["us-west-2b"] and r.cost < greedy.cost
    # at one price there is nothing to move for
    same = [pool("us-west-2a", [0] * 60 + [1] * 600), pool("us-west-2b", [1] * 660)]
    assert len(simulate(spec, same, ON_DEMAND, controllers.get("ours")(), max_hours=10.0).rows) == 1
