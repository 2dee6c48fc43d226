"""A replayed job in a deployment that has run before: its availability log holds what an earlier job of
the same policy logged before it started (`simulate --history-hours`), and nothing from after."""
from __future__ import annotations

import json

import pytest

from airflow_spot.cli import main
from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.observations import LOGGED_KINDS
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec, SimPool, simulate
from airflow_spot.simulate.history import PREVIOUS_JOB, deployment_history
from airflow_spot.simulate.report import run_one

SPOT, OD = 1.2, 3.6
ON_DEMAND = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, OD, OD, "V100", 1, 16.0)


def pool(zone, values):
    trace = SpotTrace(name=zone, zone=zone, gap_seconds=60.0, values=tuple(values))
    return SimPool(trace, Offer("p3.2xlarge", zone[:-1], zone, Market.SPOT, SPOT, OD, "V100", 1, 16.0))


# us-east-1a (first by name, so first to try for a job that knows nothing) is down for the first 3 h;
# us-west-2b is up throughout
POOLS = [pool("us-east-1a", [0] * 180 + [1] * 600), pool("us-west-2b", [1] * 780)]
SPEC = JobSpec(work_hours=1, save_cost_seconds=0.0, restart_overhead_hours=0.1)


def test_the_history_is_what_an_earlier_job_logged_before_the_start_on_the_new_jobs_clock():
    alone = controllers.get("ours")()
    simulate(SPEC, POOLS, ON_DEMAND, alone, offset_ticks=60, max_hours=1.0)  # the earlier job, from minute 60
    history = deployment_history(SPEC, POOLS, ON_DEMAND, "ours", offset_ticks=120, hours=1.0)
    # the same events, an hour earlier on the new job's clock, named as the earlier job's: those its log
    # holds (its instance's ``running`` rows are its own ledger's, never the deployment's)
    assert [(e.pool, e.kind, e.at + 3600.0) for e in history] == [
        (e.pool, e.kind, e.at) for e in alone.events if e.at <= 3600.0 and e.kind in LOGGED_KINDS]
    assert any(e.kind == "running" and e.at <= 3600.0 for e in alone.events)
    assert history and all(e.job == PREVIOUS_JOB and e.at <= 0.0 for e in history)
    assert ("p3.2xlarge@us-east-1a", "refused") in {(e.pool, e.kind) for e in history}
    # no history before the traces' start, and none for a policy that reads the traces, not a log
    assert deployment_history(SPEC, POOLS, ON_DEMAND, "ours", offset_ticks=0, hours=5.0) == []
    assert deployment_history(SPEC, POOLS, ON_DEMAND, "greedy", offset_ticks=120, hours=1.0) == []
    with pytest.raises(ValueError, match="must be >= 0 hours"):
        deployment_history(SPEC, POOLS, ON_DEMAND, "ours", offset_ticks=120, hours=-1.0)


def test_a_job_that_finds_the_deployments_history_skips_the_pool_it_says_is_down():
    """Without history the job tries us-east-1a first and is refused; with the earlier job's log (it was
    refused there and runs in us-west-2b) the new job launches in us-west-2b at once."""
    cold, warm = controllers.get("ours")(), controllers.get("ours")()
    simulate(SPEC, POOLS, ON_DEMAND, cold, offset_ticks=120)
    warm.shared = deployment_history(SPEC, POOLS, ON_DEMAND, "ours", offset_ticks=120, hours=2.0)
    simulate(SPEC, POOLS, ON_DEMAND, warm, offset_ticks=120)
    assert [(e.pool, e.kind) for e in cold.events][:2] == [("p3.2xlarge@us-east-1a", "refused"),
                                                         ("p3.2xlarge@us-west-2b", "launched")]
    assert [(e.pool, e.kind) for e in warm.events][:1] == [("p3.2xlarge@us-west-2b", "launched")]
    # the history reaches the replay through run_one, alone and beside other jobs
    assert run_one(SPEC, POOLS, ON_DEMAND, "ours", 120, history_hours=2.0).cost == pytest.approx(
        run_one(SPEC, POOLS, ON_DEMAND, "ours", 120, jobs=2, history_hours=2.0).cost)


def test_cli_history_hours(tmp_path, capsys):
    d = tmp_path / "traces"
    d.mkdir()
    for p in POOLS:
        (d / f"{p.trace.zone}_v100_1.json").write_text(json.dumps({"metadata": {"gap_seconds": 60},
                                                                   "data": list(p.trace.values)}))
    out = tmp_path / "out.json"
    argv = ["simulate", "--work-hours", "1", "--deadline-hours", "2", "--traces", str(d), "--spot-price", "1.2",
            "--on-demand-price", "3.6", "--restart-overhead-hours", "0.1", "--start-hour", "2",
            "--policies", "ours,greedy", "--json", str(out)]
    assert main(argv) == 0
    cold = {r["policy"]: r for r in json.loads(out.read_text())["runs"]}
    assert main([*argv, "--history-hours", "2"]) == 0
    assert "after 2 h of history" in capsys.readouterr().out
    warm = {r["policy"]: r for r in json.loads(out.read_text())["runs"]}
    assert warm["greedy"] == cold["greedy"]  # it reads the traces, not the log
    assert warm["ours"]["deadline_met"]
