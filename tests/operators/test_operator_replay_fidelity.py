"""Does the simulator's ``ours`` replay what ``SpotSegmentOperator`` does? (a review, 2026-11-27)

Issue 11 promises one decision (``policy.decision.decide_attempt``) fed the same observations on both
sides, so that ``simulate``'s figures for ``ours`` describe the operators. Each test below builds one
situation for both sides (the operator's ``planning.plan`` / ``_get_instance`` on the local backend, and
``simulate.observed.ObservedController`` on a View of the same offers) and compares what each does. Each
failed on the code as reviewed; its docstring says the mechanism.
"""
from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from airflow_spot.backends.base import InstanceState, LaunchError
from airflow_spot.market.traces import SpotTrace
from airflow_spot.operators import planning
from airflow_spot.policy import decision
from airflow_spot.policy.observations import PoolEvent
from airflow_spot.policy.offers import GpuRequest, Market, Offer
from airflow_spot.simulate.engine import JobSpec, SimPool, View
from airflow_spot.simulate.observed import ObservedController

#: one V100 in us-west-2 on the local backend: three spot pools and one on-demand offer (the bundled
#: benchmark's instance type and on-demand price)
GPUS = GpuRequest(count=1, names=("V100",), regions=("us-west-2",))
HOUR = 3600.0


def _operator(tmp_path, deployment: bool = False):
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.object_store import open_store

    op = SpotSegmentOperator(
        task_id="segment_001", command=["python", "train.py"], checkpoint_uri=f"file://{tmp_path}/job",
        start_step=10, end_step=20, total_steps=1000, gpus=GPUS, backend_options={"state_dir": str(tmp_path / "state")},
    )
    store = open_store(f"file://{tmp_path}/job")
    rec = planning.AvailabilityRecorder(store, open_store(str(tmp_path / "deployment")) if deployment else None,
                                        "dag.train")
    context = {"ti": SimpleNamespace(try_number=1), "run_id": "manual__1"}
    return op, store, rec, context


def _offers(market):
    offers = [o for o in market.offers(GPUS) if GPUS.matches(o)]
    spot = sorted((o for o in offers if o.is_spot), key=lambda o: o.pool)
    (od,) = [o for o in offers if not o.is_spot]
    return spot, od


def _view(spec: JobSpec, spot: list[Offer], od: Offer, now: float, up: list[bool], work_done: float,
          running=None) -> View:
    pools = [SimPool(SpotTrace(o.zone, o.zone, 60.0, (1,) * 10), o) for o in spot]
    return View(now, spec, pools, od, list(up), {}, {}, {}, {}, work_done, running)


def _terminate_all(backend) -> None:
    backend.terminate([i.instance_id for i in backend.list_instances({})
                       if not InstanceState(i.state).is_terminal()])


def test_a_refused_leave_from_on_demand_keeps_the_on_demand_instance_as_the_replay_does(tmp_path):
    """Leaving on-demand for spot when every spot pool refuses.

    Replay (``ObservedController._execute``): the job on on-demand decides spot, tries the ranked pools,
    all refuse, it decides again with the refusals ("no spot: stay on on-demand") and keeps its running
    on-demand instance: no new attempt, no restart.
    Operator (``SpotSegmentOperator._get_instance``): ``pick_warm`` finds no warm instance of the plan's
    market (spot), so the warm on-demand instance is terminated first as an "extra" (break before make),
    then the spot offers refuse, the replan says on-demand and a NEW on-demand instance is launched: a
    restart (0.2 h in the benchmark's job) and a new billing minimum the replay never pays. Every leave
    that fails (a settled pool gone by the boundary; ``settled_by``'s "the next pool that accepts is
    taken") costs the operators a restart of slack the simulator's figure does not count.
    Should: keep the warm on-demand instance until a spot launch succeeded (as ``move_to`` does for spot).
    """
    op, store, rec, context = _operator(tmp_path)
    market = op.hook.get_market()
    backend = op.hook.get_backend()
    spot, od = _offers(market)
    now = time.time()
    kw = dict(done_steps=int(2.5 * HOUR), total_steps=int(5 * HOUR), job_started_at=now - HOUR,
              deadline=timedelta(hours=10), ledger_rows=[], step_seconds=1.0, running=Market.ON_DEMAND)
    cheapest = planning.plan(market, GPUS, now=now, **{**kw, "running": None}).ranked[0]
    # the job's probes saw the cheapest pool up for 50 min: a settled pool, worth leaving on-demand for
    rec.record(cheapest.pool, "probe-up", now - 3000)
    rec.record(cheapest.pool, "probe-up", now - 60)

    # the replay, same situation: on on-demand, every spot pool down at this boundary
    spec = JobSpec(work_hours=5, deadline_hours=10, save_cost_seconds=0.0)
    sim = ObservedController(events=[PoolEvent(cheapest.pool, "probe-up", HOUR - 3000),
                                     PoolEvent(cheapest.pool, "probe-up", HOUR - 60)])
    sim._where = ("on-demand", 0)
    target = sim.decide(_view(spec, spot, od, HOUR, [False] * len(spot), 2.5 * HOUR, running=("on-demand", 0)))
    assert {e.pool for e in sim.events if e.kind == "refused"} == {o.pool for o in spot}  # it tried spot
    assert target == ("on-demand", 0)  # and kept its on-demand instance: no restart

    p = planning.plan(market, GPUS, now=now, job_events=rec.job_events(), **kw)
    assert p.market is Market.SPOT  # the operator decides the same: leave on-demand

    def replan():
        return planning.plan(market, GPUS, now=time.time(), job_events=rec.job_events(), **kw)

    try:
        # launched by an earlier segment's task (its own launch token)
        earlier = {"ti": SimpleNamespace(try_number=7), "run_id": "manual__0"}
        warm, _, _ = op._launch_first(earlier, store, [od], rec)
        real = backend.launch

        def spot_refuses(spec_):
            if spec_.offer.is_spot:
                raise LaunchError("InsufficientInstanceCapacity", capacity=True)
            return real(spec_)

        backend.launch = spot_refuses
        got, reused = op._get_instance(context, store, p, [warm], recorder=rec, replan=replan, rows=[])
        assert Market(got.offer.market) is Market.ON_DEMAND
        states = {i.instance_id: InstanceState(i.state) for i in backend.list_instances({})}
        assert not states[warm.instance_id].is_terminal(), (
            "the operator terminated its running on-demand instance before any spot pool accepted")
        assert (got.instance_id, reused) == (warm.instance_id, True), (
            "the operator paid a new on-demand instance (a restart) where the replay kept its own")
    finally:
        backend.launch = real if "real" in locals() else backend.launch
        _terminate_all(backend)


def test_the_operator_and_the_replay_decide_with_the_same_restart_overhead(tmp_path):
    """The restart the deadline rule budgets.

    Replay (``ObservedController._params``, observed.py): ``restart_overhead_seconds`` is the job's own,
    ``JobSpec.restart_overhead_hours`` (0.2 h = 720 s in every benchmark row).
    Operator (``planning.plan``): ``DecisionParams()``, i.e. ``DeadlineParams.restart_overhead_seconds`` =
    600 s whatever the job's instances really take (the job's measured overheads,
    ``JobView.measured_overheads`` / the deployment's ``overhead_history``, are used for estimates only).
    The floor (1.5 r), the switch's restart and ``move_targets``' move cost all scale with r, so the
    replay measures a more cautious rule than the operators run: an idle job with 1650 s of slack starts
    on spot in the operators (1650 - 600 >= 900) and on on-demand in the replay (1650 - 720 < 1080).
    Should: one restart figure on both sides: the operators take the job's restart
    (``restart_overhead_seconds``, the figure ``simulate --restart-overhead-hours`` replays). Since
    2026-11-28 they also measure it when the DAG does not say it (``tests/operators/test_restart_budget.py``).
    """
    op, _store, _rec, _context = _operator(tmp_path)
    market = op.hook.get_market()
    spot, od = _offers(market)
    slack = 1650.0
    spec = JobSpec(work_hours=1.0, deadline_hours=1.0 + slack / HOUR, save_cost_seconds=0.0,
                   restart_overhead_hours=0.2)
    target = ObservedController().decide(_view(spec, spot, od, 0.0, [True] * len(spot), 0.0))
    sim_market = None if target is None else target[0]
    now = time.time()
    # a job that neither says nor has measured its restart budgets the default 600 s
    unmeasured = op._restart_budget(_store, []).seconds
    p = planning.plan(market, GPUS, now=now, done_steps=0, total_steps=int(HOUR), job_started_at=now,
                      deadline=timedelta(seconds=HOUR + slack), ledger_rows=[], step_seconds=1.0,
                      restart_overhead_seconds=unmeasured)
    assert unmeasured == 600.0
    assert p.market.value == "spot" and sim_market == "on-demand"
    # a job that says its restart (the figure simulate replays) decides as the replay does
    op = type(op)(task_id="segment_001", command=["python", "train.py"], checkpoint_uri=f"file://{tmp_path}/job",
                  start_step=10, end_step=20, total_steps=1000, gpus=GPUS, restart_overhead_seconds=720.0,
                  backend_options={"state_dir": str(tmp_path / "state")})
    p = planning.plan(market, GPUS, now=now, done_steps=0, total_steps=int(HOUR), job_started_at=now,
                      deadline=timedelta(seconds=HOUR + slack), ledger_rows=[], step_seconds=1.0,
                      restart_overhead_seconds=op.restart_overhead_seconds)
    assert p.market.value == sim_market, (
        f"operator {p.market.value} ({p.reason}) vs replay {sim_market}: the operators budget a 600 s restart, "
        "the replay the job's 720 s")


def test_the_replay_counts_the_spot_time_of_an_instance_it_left_as_the_operators_ledger_does(monkeypatch):
    """The job's own preemption rate (which scales the spot reserve when leaving on-demand, and, per
    region, the move rule's bet) counts preemptions over the job's own spot time.

    Operator: the ledger has a row per segment; ``ledger_events`` gives ``launched`` at an instance's
    start and ``running`` at each row's end, so an instance the job left while it was up (a move to a
    cheaper pool, ``leave_running``, a switch to on-demand) counts its whole run as spot time.
    Replay (``ObservedController``): its own events hold ``launched`` and ``preempted`` only; the
    ``running`` event ``decide_attempt`` adds for the current instance is never kept, so an instance left
    while up counts 0 s in ``own_pool_losses`` (its run ends at its last up-event, its launch). After 3 h
    in pool A and B seen up by probes for 45 min, a move to the cheaper B and B's preemption 15 min later,
    the replay sees 1 loss in 15 min of spot time, the operators 1 loss in 4 h: the replay's rate is higher, so it keeps more slack and
    moves less than the operators on the priced (move) replays. Should: the replay records what the
    ledger has (a ``running`` event for its instance at each boundary, or when it leaves it).
    """
    from airflow_spot.simulate.engine import simulate

    rate = 1 / 3.6
    od = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, 3.06, 3.06, "V100", 1, 16.0)

    def offer(zone, price):
        return Offer("p3.2xlarge", "us-west-2", zone, Market.SPOT, price, 3.06, "V100", 1, 16.0,
                     preemption_rate_per_hour=rate)

    a, b = offer("usw2-az1", 2.0), offer("usw2-az2", 1.0)
    pools = [SimPool(SpotTrace("a", "usw2-az1", 60.0, (1,) * 600), a),
             SimPool(SpotTrace("b", "usw2-az2", 60.0, (0,) * 180 + (1,) * 60 + (0,) * 360), b)]
    calls = []
    real = decision.decide_attempt

    def spy(obs, state=None, params=None):
        out = real(obs, state, params)
        calls.append((obs, params, out))
        return out

    monkeypatch.setattr(decision, "decide_attempt", spy)
    spec = JobSpec(work_hours=10, save_cost_seconds=0.0, restart_overhead_hours=0.1)
    r = simulate(spec, pools, od, ObservedController(), max_hours=4.5)
    assert [(x.zone, x.outcome, x.started_at / HOUR, x.ended_at / HOUR) for x in r.rows[:2]] == [
        ("usw2-az1", "completed", 0.0, 3.75), ("usw2-az2", "preempted", 3.75, 4.0)]  # the situation
    obs, params, sim_d = next(c for c in calls if c[0].now == 4 * HOUR)
    # the operators' observation of the same moment: their ledger (one row per attempt is the same spot
    # time as one per segment) plus the refusals and launches their recorder logged under the job's name
    from airflow_spot.policy.observations import JobObservation, ledger_events

    logged = [PoolEvent(e.pool, e.kind, e.at, "dag.train") for e in obs.events
              if e.kind in ("refused", "launched", "probe-up", "probe-down")]
    op_obs = JobObservation(now=obs.now, started_at=obs.started_at, deadline_at=obs.deadline_at,
                            work_done=obs.work_done, work_total=obs.work_total, offers=obs.offers,
                            events=ledger_events(r.rows[:2]) + logged, running=None, running_pool=None)
    op_d = real(op_obs, None, params)
    assert op_d.preemption_rate_per_hour == pytest.approx((rate * 20 + 1) / 24)  # 1 loss in 4 h of spot
    assert sim_d.preemption_rate_per_hour == pytest.approx(op_d.preemption_rate_per_hour), (
        "the replay counts the 3 h it ran in pool A before moving as no spot time at all")


def test_a_wait_decision_is_carried_out_alike_when_every_pool_is_believed_down(tmp_path):
    """The WAIT decision at a decision point where every spot pool is believed down (another job of the
    deployment was refused in each 10 s ago; no deadline, so the rule waits for spot).

    Replay (``ObservedController._execute``): ``wait`` -> no instance, nothing tried, next decision in
    ``recheck_seconds``.
    Operator (``planning.plan`` maps ``wait`` to the spot market, as ``as_launch_market`` does, then
    ``_get_instance``): it tries the ranked spot offers at once, pools its own decision believes down,
    and launches in the first that accepts. When a pool came back within the 60 s after the refusal the
    operators start up to a minute sooner than the replay (in ``--jobs N`` replays and after a preemption
    in a one-pool market), and otherwise they record refusals the replay does not.
    Should: one meaning of ``wait`` on both sides: the replay tries the offers as the operators do.
    """
    op, store, rec, context = _operator(tmp_path, deployment=True)
    market = op.hook.get_market().with_availability_log(rec.deployment_log)
    backend = op.hook.get_backend()
    spot, od = _offers(market)
    now = time.time()
    for o in spot:
        rec.deployment_log.append(PoolEvent(o.pool, "refused", now - 10, job="other"))

    sim = ObservedController(shared=[PoolEvent(o.pool, "refused", 600.0 - 10, job="other") for o in spot])
    target = sim.decide(_view(JobSpec(work_hours=1.0, save_cost_seconds=0.0), spot, od, 600.0,
                              [True] * len(spot), 0.0))
    # the replay carries 'wait' out as the operators do: it tries the offers, and the first up accepts
    assert target is not None and target[0] == "spot"
    sim_pool = spot[target[1]].pool

    kw = dict(done_steps=0, total_steps=1000, job_started_at=now, deadline=None, ledger_rows=[])
    p = planning.plan(market, GPUS, now=now, job_events=rec.job_events(), **kw)
    assert p.wait  # the same decision: wait for spot

    def replan():
        return planning.plan(market, GPUS, now=time.time(), job_events=rec.job_events(), **kw)

    from airflow_spot.operators.segment import NoCapacityNow

    launched = None
    try:
        try:
            launched, _ = op._get_instance(context, store, p, [], recorder=rec, replan=replan)
        except NoCapacityNow:
            pass
        assert launched is not None and launched.offer.pool == sim_pool, (
            "the operator and the replay carry out 'wait' differently")
    finally:
        _terminate_all(backend)
