"""Review: does the replayed ``ours`` decide only from what a real job observes, and are the published
figures' costs (probes, billing minimum, restarts, the hindsight yardstick and its per-offset pairing)
accounted as stated?

Two kinds of tests:

* FAILING ON PURPOSE (``# DEFECT``): each fails on the code as reviewed because of a real defect; its
  docstring names the mechanism (file:line) and the effect on the figures.
* PASSING PINS (``# VERIFIED``): properties the review checked by running code and found honest.
"""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.observations import EVENT_KINDS, ledger_events, own_pool_losses
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec, SimPool, simulate, simulate_together
from airflow_spot.simulate.hindsight import hindsight_cost
from airflow_spot.simulate.history import deployment_history
from airflow_spot.simulate.observed import ObservedController, OtherJobs
from airflow_spot.simulate.report import (
    distribution, hindsight_distribution, hindsight_ratios, run_jobs, run_one,
)

SPOT, OD = 1.2, 3.6
ON_DEMAND = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, OD, OD, "V100", 1, 16.0)
#: the kinds the operators write to the deployment's availability log: ``AvailabilityRecorder.record``
#: (launched / refused in ``segment_instances._get_instance``, probe-up / probe-down in
#: ``planning.probe_spot``) and ``segment.py`` (preempted). ``running`` is never logged: a job derives it
#: only from its OWN ledger rows (``observations.ledger_events``).
LOGGED_KINDS = frozenset({"launched", "refused", "probe-up", "probe-down", "preempted"})


def pool(zone, values, price=SPOT, gap=60.0, prices=None, rate=0.0):
    trace = SpotTrace(name=zone, zone=zone, gap_seconds=gap, values=tuple(values))
    offer = Offer("p3.2xlarge", zone[:-1], zone, Market.SPOT, price, OD, "V100", 1, 16.0,
                  preemption_rate_per_hour=rate)
    return SimPool(trace, offer, prices=tuple(prices) if prices else None)


# ---------------------------------------------------------------------------------------------------------
# DEFECT 1: the controller's event compaction drops the job's own ``launched`` events
# ---------------------------------------------------------------------------------------------------------

def test_defect_compaction_drops_own_launch_so_a_preemption_vanishes_from_the_own_preemption_rate():
    """DEFECT (failed on the reviewed code; fixed: ``_record`` keeps ``launched`` and ``preempted``).

    Mechanism: ``ObservedController._record`` (airflow_spot/simulate/observed.py:111-120) keeps of a run
    of same-direction events of one pool only the first and the newest, claiming that is "all that
    ``pool_views`` reads". But ``own_pool_losses`` (airflow_spot/policy/observations.py:167-209, used by
    ``decide_attempt`` at policy/decision.py:364 for the own preemption rate that scales the spot reserve,
    and at :403 for the move rule's regional losses) starts an instance only at a ``launched`` event. When
    ``ours`` leaves on-demand it probes first (``probe-up``) and launches at the same instant: the
    ``launched`` event is the second of the up-run, and the next segment boundary's ``running`` event
    replaces it. That instance's seconds and its preemption are then missing from the job's own history;
    so is any instance launched into a pool whose previous up-run had no down-event (a move away and back).
    The operators compute the same figures from ``ledger_events`` of every ledger row, so the replayed
    ``ours`` does not decide what ``SpotSegmentOperator`` decides.

    Effect on the figures: bundled 4-zone traces, 52 h, every 4th hourly offset (32 offsets): 7 offsets
    change cost by up to ~2% (e.g. offset tick 10304: $88.83 replayed vs $86.96 with the launches kept);
    mean cost / hindsight 1.1519 vs 1.1507.

    Fix: never replace or drop a ``launched`` (or ``preempted``) event in ``_record``; compact only runs of
    ``running`` / ``refused`` / probe events of one kind, e.g. replace the newest only when it and the new
    event are both not ``launched``.
    """
    # pool up 0-20 min, down 20-100 (ours goes on-demand, probes), up 100-200 (probe-up, then ``launched``
    # right after the probe), down 200-203 (that instance is preempted), then up
    spec = JobSpec(work_hours=3, deadline_hours=4, save_cost_seconds=0.0, restart_overhead_hours=0.1)
    trace = [1] * 20 + [0] * 80 + [1] * 100 + [0] * 3 + [1] * 200
    c = controllers.get("ours")()
    r = simulate(spec, [pool("us-west-2b", trace)], ON_DEMAND, c, max_hours=5.0)
    spot_rows = [x for x in r.rows if x.market == "spot"]
    assert [x.outcome for x in spot_rows] == ["preempted", "preempted"]  # the scenario is as intended
    assert any(e.kind == "probe-up" for e in c.events)
    now = spot_rows[-1].ended_at  # the decision right after the second preemption
    operators_view = own_pool_losses(ledger_events(spot_rows), now)  # what plan() computes from the ledger
    replayed_view = own_pool_losses(c.events, now)  # what the replayed ``ours`` computes
    # the operators: 2 losses in 20 + 46 min of own spot time; the replay: 1 loss in 20 min
    assert operators_view == {"p3.2xlarge@us-west-2b": (2.0, 3960.0)}
    assert replayed_view == operators_view


# ---------------------------------------------------------------------------------------------------------
# DEFECT 2: other jobs' ``running`` events are shared although no deployment log holds them
# ---------------------------------------------------------------------------------------------------------

def test_defect_other_jobs_share_running_events_the_deployment_log_never_holds():
    """DEFECT (failed on the reviewed code; fixed: ``observations.LOGGED_KINDS`` filters both).

    Mechanism: ``OtherJobs.__iter__`` (airflow_spot/simulate/observed.py:53-57) yields every event of the
    other replayed jobs, and ``deployment_history`` (airflow_spot/simulate/history.py:44) every event of the
    earlier job, including the ``running`` events each records at its own segment boundaries
    (observed.py:210). The operators never write ``running`` to the deployment's log (only launched /
    refused via ``AvailabilityRecorder.record``, probe-up / probe-down via ``planning.probe_spot``,
    preempted in ``segment.py:750``); a job derives ``running`` only from its own ledger rows. So with
    ``--jobs N`` / ``--history-hours`` a replayed job reads, every 15 minutes, that another job's pool is
    still up: information a real job does not have. It refreshes the "newest spot observation" that gates
    probes (policy/decision.py:388-390), so a job on on-demand skips probes (and their charge) a real one
    would pay for.

    Effect on the figures: none measured on the bundled 4-zone set (``--jobs 2``, 16 offsets, and the 24 h
    history variant, 17 offsets: identical costs with ``running`` filtered out), since identical jobs move
    together; it matters for jobs that are not in lock-step.

    Fix: in ``OtherJobs.__iter__`` and ``deployment_history`` pass only the logged kinds
    (``e.kind != "running"``), i.e. what ``AvailabilityLog`` can hold.
    """
    spec = JobSpec(work_hours=2, deadline_hours=3, save_cost_seconds=0.0, restart_overhead_hours=0.1)
    pools = [pool("us-west-2b", [1] * 400)]
    results = run_jobs(spec, pools, ON_DEMAND, "ours", jobs=2)
    assert all(r.completed for r in results)
    a, b = controllers.get("ours")(), controllers.get("ours")()
    a.shared, b.shared = OtherJobs([("b", b)]), OtherJobs([("a", a)])
    simulate_together(spec, pools, ON_DEMAND, [a, b], max_hours=4)
    read_by_b = {e.kind for e in b.shared}
    history = deployment_history(spec, [pool("us-west-2b", [1] * 2000)], ON_DEMAND, "ours", 600, 5.0)
    assert "launched" in read_by_b and history  # the jobs did log something
    assert read_by_b <= LOGGED_KINDS, f"read from another job's log: {sorted(read_by_b - LOGGED_KINDS)}"
    assert {e.kind for e in history} <= LOGGED_KINDS


# ---------------------------------------------------------------------------------------------------------
# DEFECT 3: ``--jobs N`` reports the job that, by construction, never pays for a probe
# ---------------------------------------------------------------------------------------------------------

def test_defect_jobs_together_report_the_free_rider_on_the_others_probes():
    """DEFECT (failed on the reviewed code; fixed: ``report.per_job_mean``).

    Mechanism: ``run_one`` (airflow_spot/simulate/report.py:167-171), and through it ``distribution(...,
    jobs=N)`` (``simulate --jobs N`` over offsets), reports only the LAST of the N jobs. Jobs started
    together on one window decide at the same instants, and at equal times in the controllers' order
    (engine.py:251); so when the jobs on on-demand are due for a probe, the first probes (and is charged),
    and the last reads those probes from the log a moment later, finds its newest observation fresh
    (policy/decision.py:388-390) and never probes: it pays no probe at all. The reported job is the one
    the others pay for; the deployment's cost per job is the mean.

    Effect on the figures: bundled 4-zone traces, 52 h, every 6th hourly offset: alone 1.1532 x hindsight,
    first of two 1.1532, second of two 1.1458 (probes $0.44 / $0.44 / $0.00 a job); a job of the pair
    costs 1.1495 on average. ``benchmarks/results_simulate.md`` ("do as well as a lone job or a little
    better (52 h, the second of two: 1.144)", and the "2 jobs" table) rests on the free rider; most of its
    gain over a lone job is the probes the first job paid.

    Fix: report the mean over the deployment's jobs (or every job's row, as ``run_policies`` does), or
    charge the probes of one instant to the jobs that read them; say which in the results.
    """
    import statistics

    spec = JobSpec(work_hours=5, deadline_hours=6, save_cost_seconds=10.0, restart_overhead_hours=0.1)
    pools, _ = _twin_traces(1500, 1500)
    each = run_jobs(spec, pools, ON_DEMAND, "ours", 600, jobs=2)
    reported = run_one(spec, pools, ON_DEMAND, "ours", 600, jobs=2)
    assert each[0].cost != pytest.approx(each[1].cost)  # the jobs did not pay alike
    assert reported.cost == pytest.approx(statistics.mean(r.cost for r in each))


# ---------------------------------------------------------------------------------------------------------
# VERIFIED: the information barrier (passing pins)
# ---------------------------------------------------------------------------------------------------------

class _Recording(ObservedController):
    """``ours`` that records, for every decision before ``barrier``, what it returned and all it knew."""

    def decide(self, view):
        target = super().decide(view)
        if view.now < self.barrier:
            self.log.append((view.now, target, tuple(self.events), self.probe_cost, self.probes_made,
                             self.state))
        return target


def _recording(barrier: float, **kw) -> _Recording:
    c = _Recording(**kw)
    c.barrier, c.log = barrier, []
    return c


def _flapping(seed: int, n: int, p_flip: float = 0.04) -> list[int]:
    rng = random.Random(seed)
    v, out = 1, []
    for _ in range(n):
        if rng.random() < p_flip:
            v = 1 - v
        out.append(v)
    return out


def _twin_traces(n: int, k: int):
    """Three pools whose traces (and per-tick spot prices) are identical before tick ``k`` and differ after
    it: up/down inverted and prices changed."""
    base = [_flapping(s, n) for s in (1, 2, 3)]
    prices = [[0.9 + 0.3 * ((i // 37 + s) % 3) for i in range(n)] for s in range(3)]
    zones = ("us-west-2a", "us-west-2b", "us-east-1c")
    first = [pool(z, v, prices=p) for z, v, p in zip(zones, base, prices)]
    other = [pool(z, v[:k] + [1 - x for x in v[k:]], prices=p[:k] + [3.0 - x for x in p[k:]])
             for z, v, p in zip(zones, base, prices)]
    return first, other


# VERIFIED (passing): two traces identical up to t and different after give identical decisions up to t
@pytest.mark.parametrize("probe_miss", [0.0, 0.18])
def test_verified_information_barrier_one_job(probe_miss):
    n, k = 900, 200  # the barrier at 200 min, inside the job's run (it ends after 5 h)
    spec = JobSpec(work_hours=5, deadline_hours=6, save_cost_seconds=10.0, restart_overhead_hours=0.1,
                   probe_miss=probe_miss)
    a_pools, b_pools = _twin_traces(n, k)
    runs, costs = [], []
    for pools in (a_pools, b_pools):
        c = _recording(k * 60.0)
        costs.append(simulate(spec, pools, ON_DEMAND, c, max_hours=8).cost)
        runs.append(c.log)
    kinds = {e.kind for e in runs[0][-1][2]}
    # the window before the barrier exercises launches, refusals, preemptions and probes
    assert {"launched", "refused", "preempted", "probe-up"} <= kinds, kinds
    assert runs[0][-1][4] >= 3  # probes made before the barrier
    assert costs[0] != pytest.approx(costs[1])  # what comes after the barrier does change the run
    assert runs[0] == runs[1]


# VERIFIED (passing): the same with two jobs replayed together and an earlier job's history, from an offset
def test_verified_information_barrier_jobs_together_with_history():
    n, k, offset = 1500, 150, 600  # the barrier 150 min after the jobs' start, inside their run
    # 1.5 h of slack: with 1 h both jobs are on on-demand for good before the barrier, and what comes after
    # it cannot change them
    spec = JobSpec(work_hours=5, deadline_hours=6.5, save_cost_seconds=10.0, restart_overhead_hours=0.1)
    a_pools, b_pools = _twin_traces(n, offset + k)
    logs = []
    for pools in (a_pools, b_pools):
        history = deployment_history(spec, pools, ON_DEMAND, "ours", offset, 6.0)
        jobs = [_recording(k * 60.0), _recording(k * 60.0)]
        for i, c in enumerate(jobs):
            c.shared = OtherJobs([(f"j{j}", o) for j, o in enumerate(jobs) if j != i], history)
        results = simulate_together(spec, pools, ON_DEMAND, jobs, offset_ticks=offset, max_hours=8)
        logs.append(([c.log for c in jobs], history, [r.cost for r in results]))
    assert logs[0][1] and all(e.at <= 0 for e in logs[0][1])  # the history holds only the past
    assert logs[0][2] != pytest.approx(logs[1][2])  # what comes after the barrier does change the runs
    assert logs[0][0][0][-1][4] >= 3  # the first job probed before the barrier (the second reads its probes)
    assert logs[0][:2] == logs[1][:2]


# VERIFIED (passing): every spot pool ours ever learns about comes from an event at or before the decision
def test_verified_no_event_is_stamped_in_the_future():
    spec = JobSpec(work_hours=5, deadline_hours=6, save_cost_seconds=10.0, restart_overhead_hours=0.1)
    pools, _ = _twin_traces(900, 900)
    c = _recording(math.inf)
    simulate(spec, pools, ON_DEMAND, c, max_hours=8)
    for now, _target, events, *_ in c.log:
        assert all(e.at <= now and e.kind in EVENT_KINDS for e in events)


# ---------------------------------------------------------------------------------------------------------
# VERIFIED: cost accounting (passing pins)
# ---------------------------------------------------------------------------------------------------------

# VERIFIED (passing): probes are charged one billed minute at the probe tick's spot price, accepted ones only
def test_verified_probes_charged_at_the_tick_price_per_accepted_request():
    spec = JobSpec(work_hours=3, deadline_hours=4, save_cost_seconds=0.0, restart_overhead_hours=0.1)
    values = [1] * 20 + [0] * 80 + [1] * 200
    prices = [1.0 + 0.01 * i for i in range(300)]
    p = pool("us-west-2b", values, prices=prices)
    c = controllers.get("ours")()

    charged = []
    real_probe = c._probe

    def spy(view):
        before = c.probe_cost
        real_probe(view)
        charged.append((view.now, c.probe_cost - before, view.pools[0].offer.price_per_hour, view.up[0]))

    c._probe = spy
    r = simulate(spec, [p], ON_DEMAND, c, max_hours=5.0)
    assert charged and c.probes_accepted >= 1
    for now, dollars, price, up in charged:
        assert price == pytest.approx(prices[int(now // 60)])
        assert dollars == pytest.approx(price / 60.0 if up else 0.0)
    assert r.cost == pytest.approx(sum(x.cost for x in r.rows) + c.probe_cost)


# VERIFIED (passing): every new instance of ours pays the restart; a short one pays the 60 s minimum
def test_verified_restart_on_every_new_instance_and_billing_minimum():
    spec = JobSpec(work_hours=3, deadline_hours=4, save_cost_seconds=10.0, restart_overhead_hours=0.1)
    trace = [1] * 20 + [0] * 80 + [1] * 100 + [0] * 3 + [1] * 200
    r = simulate(spec, [pool("us-west-2b", trace)], ON_DEMAND, controllers.get("ours")(), max_hours=5.0)
    assert len(r.rows) >= 4 and {x.market for x in r.rows} == {"spot", "on-demand"}
    for x in r.rows:  # no progress during the restart (360 s) of any instance
        assert x.steps_done <= (x.ended_at - x.started_at) - 360.0 + 1.0
    # a spot instance reclaimed 20 s after its launch is billed 60 s
    short = [1] + [0] * 5 + [1] * 2000
    p = pool("us-west-2b", short, gap=20.0)
    r = simulate(JobSpec(work_hours=1, save_cost_seconds=0.0, restart_overhead_hours=0.01), [p], ON_DEMAND,
                 controllers.get("ours")(), max_hours=2.0)
    first = r.rows[0]
    assert (first.outcome, first.ended_at - first.started_at, first.billed_seconds) == ("preempted", 20.0, 60.0)
    assert first.cost == pytest.approx(60.0 / 3600.0 * SPOT)


# VERIFIED (passing): the hindsight optimum at an offset is the optimum of the window the policies replay
def test_verified_hindsight_uses_the_offset_window_and_the_same_job():
    spec = JobSpec(work_hours=2, deadline_hours=3, save_cost_seconds=10.0, restart_overhead_hours=0.2)
    values = [_flapping(s, 800, 0.03) for s in (4, 5)]
    pools = [pool("us-west-2a", values[0], price=1.0), pool("us-west-2b", values[1], price=1.4)]
    for offset in (0, 130, 377):
        sliced = [replace(p, trace=replace(p.trace, values=p.trace.values[offset:])) for p in pools]
        assert hindsight_cost(spec, pools, ON_DEMAND, offset_ticks=offset) == pytest.approx(
            hindsight_cost(spec, sliced, ON_DEMAND, offset_ticks=0))
        best = hindsight_cost(spec, pools, ON_DEMAND, offset_ticks=offset)
        for name in ("ours", "greedy", "on-demand"):  # a lower bound of what any policy pays (deadline met)
            r = run_one(spec, pools, ON_DEMAND, name, offset)
            if r.deadline_met:
                assert best <= r.cost + 1e-6


# VERIFIED (passing): per-offset ratios pair each policy's offset with the hindsight's same offset
def test_verified_per_offset_ratios_pair_the_same_offsets():
    spec = JobSpec(work_hours=2, deadline_hours=3, save_cost_seconds=10.0, restart_overhead_hours=0.2)
    values = [_flapping(s, 800, 0.03) for s in (6, 7)]
    pools = [pool("us-west-2a", values[0]), pool("us-west-2b", values[1])]
    offsets = [0, 60, 120, 300]
    base = 10.0
    d = distribution(spec, pools, ON_DEMAND, "ours", offsets, base)
    hs = hindsight_distribution(spec, pools, ON_DEMAND, offsets, base)
    paired = hindsight_ratios(d, hs)
    for i, o in enumerate(offsets):
        cost = run_one(spec, pools, ON_DEMAND, "ours", o).cost
        assert d.ratios[i] == pytest.approx(cost / base)
        assert paired[i] == pytest.approx(cost / hindsight_cost(spec, pools, ON_DEMAND, offset_ticks=o))
