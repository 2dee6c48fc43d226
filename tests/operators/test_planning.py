"""The operator's offer plan: the bundled market through the ranking and deadline policies."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest

from airflow_spot.backends.base import InstanceInfo, InstanceState
from airflow_spot.market import get_market
from airflow_spot.operators.planning import NoOfferError, pick_warm, plan, segment_length_advice
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.policy.offer_ranking import cost_per_step
from airflow_spot.policy.offers import GpuRequest, Market
from airflow_spot.storage.ledger_store import LedgerStore

T0 = 1_800_000_000.0
GPUS = GpuRequest(count=1, min_memory_gib=16)


@pytest.fixture(scope="module")
def market():
    return get_market("local")


def make_plan(market, **kw):
    args = dict(now=T0, done_steps=0, total_steps=1000, job_started_at=T0, deadline=None, ledger_rows=[])
    args.update(kw)
    return plan(market, GPUS, **args)


def test_without_deadline_spot_ranked_by_cost_per_step(market):
    p = make_plan(market)
    assert p.market is Market.SPOT and all(o.is_spot for o in p.ranked)
    costs = [cost_per_step(o) for o in p.ranked]
    assert costs == sorted(costs)
    assert p.mtbf_seconds and p.mtbf_seconds > 0  # handed to the session's checkpoint interval


def nearly_late(market):
    # 5 of 10 hours gone, 4 % done at 18 s/step: the remaining 960 steps need 4.8 h of the 5 h left,
    # a slack of 12 minutes, less than two restarts' worth: the deadline policy commits to on-demand
    return make_plan(market, now=T0 + 5 * 3600, done_steps=40, deadline=timedelta(hours=10), step_seconds=18.0)


def test_when_the_slack_runs_out_it_goes_on_demand(market):
    p = nearly_late(market)
    assert p.market is Market.ON_DEMAND and not any(o.is_spot for o in p.ranked)


def test_ahead_of_the_line_stays_on_spot(market):
    p = make_plan(market, now=T0 + 3600, done_steps=500, deadline=timedelta(hours=10), step_seconds=18.0)
    assert p.market is Market.SPOT


def test_a_pool_that_just_preempted_us_is_ranked_last(market):
    best = make_plan(market).ranked[0]
    row = LedgerRow("seg.try1", "i-1", best.instance_type, best.zone, "spot", best.price_per_hour,
                    best.on_demand_price_per_hour, T0 - 100, T0 - 10, 5, "preempted")
    p = make_plan(market, ledger_rows=[row])
    assert p.ranked[0].pool != best.pool and p.ranked[-1].pool == best.pool


def test_the_warm_instance_is_reused_in_the_market_the_policy_wants(market):
    p = make_plan(market)
    best, worst = p.ranked[0], p.ranked[-1]

    def inst(offer, iid):
        return InstanceInfo(iid, InstanceState.RUNNING, offer, "file:///job")

    assert pick_warm([inst(best, "a")], p).instance_id == "a"
    assert pick_warm([inst(worst, "b"), inst(best, "a")], p).instance_id == "a"  # the cheaper of two
    on_demand = nearly_late(market)
    assert pick_warm([inst(best, "a")], on_demand) is None  # the policy wants on-demand now


def test_a_warm_instance_in_a_dear_pool_is_offered_the_cheaper_ones_to_move_to(market):
    from airflow_spot.policy.observations import PoolEvent

    p = make_plan(market)
    best, worst = p.ranked[0], p.ranked[-1]
    now = T0 + 3600
    kw = dict(now=now, done_steps=100, running=Market.SPOT, running_pool=worst.pool)
    # not seen up yet: the cheaper pools are to be probed first, not moved to
    dear = make_plan(market, **kw)
    assert dear.move_to == [] and dear.settle_probe and dear.settle_probe[0].pool == best.pool
    assert worst.pool not in [o.pool for o in dear.settle_probe]
    # seen up by probes for 50 min: moved to
    seen = [PoolEvent(o.pool, "probe-up", at) for o in p.ranked[:-1] for at in (now - 3000, now - 60)]
    dear = make_plan(market, job_events=seen, **kw)
    assert dear.move_to and dear.move_to[0].pool == best.pool and worst.pool not in [o.pool for o in dear.move_to]
    assert dear.settle_probe == []
    assert make_plan(market, running=Market.SPOT, running_pool=best.pool).move_to == []


def test_no_matching_offer_is_a_clear_error(market):
    with pytest.raises(NoOfferError, match="relax the GPU request"):
        plan(market, GpuRequest(count=1, min_memory_gib=10_000), now=T0, done_steps=0, total_steps=10,
             job_started_at=T0, deadline=None, ledger_rows=[])


def test_the_safety_net_holds_once_fired(market):
    assert nearly_late(market).committed
    # later the job is comfortably ahead again, but the policy had committed to on-demand to the end
    relaxed = dict(now=T0 + 3600, done_steps=500, deadline=timedelta(hours=10), step_seconds=18.0)
    assert make_plan(market, **relaxed).market is Market.SPOT
    assert make_plan(market, committed=True, **relaxed).market is Market.ON_DEMAND


def test_leaving_on_demand_waits_for_a_pool_observed_up_long_enough(market, tmp_path):
    # 10 h deadline, 1 h in, half the 5 h of work done: plenty of slack, running on on-demand. Whether to
    # go back to spot rests on what the job and the deployment observed of the pools (no trace, no oracle)
    from airflow_spot.policy.observations import PoolEvent
    from airflow_spot.storage.availability import AvailabilityLog
    from airflow_spot.storage.object_store import open_store

    kw = dict(now=T0 + 3600, done_steps=500, deadline=timedelta(hours=10), step_seconds=18.0,
              running=Market.ON_DEMAND)
    nothing = make_plan(market, **kw)
    assert nothing.market is Market.ON_DEMAND and nothing.probe  # never seen up: stay, and ask for a probe
    best = make_plan(market).ranked[0]
    fresh = [PoolEvent(best.pool, "launched", T0 + 3300)]
    assert make_plan(market, job_events=fresh, **kw).market is Market.ON_DEMAND
    # another job of the deployment has held that pool for 2 h: read through the market's observations
    log = AvailabilityLog(open_store(str(tmp_path / "deployment")))
    log.append(PoolEvent(best.pool, "launched", T0 - 3600, job="other"))
    log.append(PoolEvent(best.pool, "running", T0 + 3500, job="other"))
    shared = get_market("local").with_availability_log(log)
    p = make_plan(shared, **kw)
    assert p.market is Market.SPOT and p.ranked[0].pool == best.pool


def test_a_decision_reads_the_deployment_log_from_names_not_a_get_per_event(market, tmp_path):
    # the log is read at every decision: a GET per event made each decision's read grow with the
    # deployment's whole history; a body is read per pool, for its exact name
    from airflow_spot.policy.observations import PoolEvent
    from airflow_spot.storage.availability import AvailabilityLog
    from airflow_spot.storage.object_store import LocalStore

    class Counting(LocalStore):
        gets = 0

        def get_bytes(self, key):
            Counting.gets += 1
            return super().get_bytes(key)

    log = AvailabilityLog(Counting(tmp_path / "deployment"))
    best = make_plan(market).ranked[0]
    log.append(PoolEvent(best.pool, "launched", T0 - 3600, job="other"))
    log.append(PoolEvent(best.pool, "running", T0 + 3500, job="other"))
    for i in range(30):  # a pool of another job's GPU type: its outages still count for the deployment
        log.append(PoolEvent("x9.huge@mars-1a", "refused" if i % 2 else "launched", T0 - 86400 + i * 600, job="other"))
    Counting.gets = 0
    shared = get_market("local").with_availability_log(log)
    p = make_plan(shared, now=T0 + 3600, done_steps=500, deadline=timedelta(hours=10), step_seconds=18.0,
                  running=Market.ON_DEMAND)
    assert p.market is Market.SPOT and p.ranked[0].pool == best.pool  # the other job's run was read
    assert Counting.gets == 2  # one body per pool, not 32
    assert len(shared.observations(T0 + 3600)) == 32

def test_the_operator_and_the_simulator_call_one_function_with_one_observation_type(market, monkeypatch):
    """planning.plan (what SpotSegmentOperator calls) and the simulator's `ours` both go through
    policy.decision.decide_attempt with a JobObservation."""
    from airflow_spot.market.traces import SpotTrace
    from airflow_spot.policy import decision
    from airflow_spot.policy.observations import JobObservation
    from airflow_spot.simulate.controllers import controllers
    from airflow_spot.simulate.engine import JobSpec, SimPool, simulate

    calls = []
    real = decision.decide_attempt

    def spy(obs, state=None, params=None):
        calls.append(type(obs))
        return real(obs, state, params)

    monkeypatch.setattr(decision, "decide_attempt", spy)
    make_plan(market)
    assert calls == [JobObservation]
    trace = SpotTrace("z", "us-west-2b", 60.0, (1,) * 30)
    offer = make_plan(market).ranked[0]
    sim = simulate(JobSpec(work_hours=0.2), [SimPool(trace, offer)], offer, controllers.get("ours")(), max_hours=0.5)
    assert sim.completed and len(calls) > 2 and set(calls) == {JobObservation}


def test_capacity_refusals_are_recorded_for_the_job_and_the_deployment(tmp_path):
    from airflow_spot.operators.planning import AvailabilityRecorder
    from airflow_spot.storage.object_store import open_store

    job, deployment = open_store(str(tmp_path / "job")), open_store(str(tmp_path / "dep"))
    rec = AvailabilityRecorder(job, deployment, "dag.train")
    rec.record("p3.2xlarge@us-west-2b", "refused", T0)
    assert [(e.kind, e.job) for e in rec.job_events()] == [("refused", "dag.train")]
    assert [e.pool for e in rec.deployment_log.read()] == ["p3.2xlarge@us-west-2b"]
    assert job.list("control/availability/")  # in the job's own store, under JobLayout.AVAILABILITY_PREFIX


def test_probes_record_capacity_and_leave_no_instance_running(market, tmp_path):
    """planning.probe_spot on the real local backend: a pool whose replayed trace is down refuses
    (probe-down); one with capacity launches and is terminated at once (probe-up)."""
    import json

    from airflow_spot.backends.base import InstanceState, LaunchSpec
    from airflow_spot.backends.local import LocalBackend
    from airflow_spot.operators.planning import AvailabilityRecorder, probe_spot
    from airflow_spot.storage.object_store import open_store

    offer = make_plan(market).ranked[0]
    trace = tmp_path / "us-west-2b_v100_1.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 3600}, "data": [0, 0, 0, 1, 0]}))  # down at its start
    job = open_store(str(tmp_path / "job"))

    def spec(o, try_number):
        return LaunchSpec(offer=o, job_uri=job.uri, idempotency_token=f"probe-{o.pool}-{try_number}",
                          tags={"t": "probe"}, idle_timeout_seconds=60.0)

    down = LocalBackend(state_dir=str(tmp_path / "s1"),
                        preemption={"mode": "trace", "path": str(trace), "capacity": True,
                                    "start_offset_seconds": 0})
    rec = AvailabilityRecorder(job, None, "j")
    billed = []  # a refused probe is not billed; one that launched is, once terminated

    def bill(o, info, ended_at):
        billed.append((o.pool, info.instance_id, ended_at))

    assert probe_spot(down, [offer], spec, rec, now=T0, bill=bill) == 1
    assert [e.kind for e in rec.job_events()] == ["probe-down"] and billed == []
    up = LocalBackend(state_dir=str(tmp_path / "s2"))
    try:
        assert probe_spot(up, [offer], spec, rec, now=T0 + 1, bill=bill) == 1
        assert [e.kind for e in rec.job_events()] == ["probe-down", "probe-up"]
        assert all(InstanceState(i.state).is_terminal() for i in up.list_instances(tags={"t": "probe"}))
        (launched,) = up.list_instances(tags={"t": "probe"})
        assert billed == [(offer.pool, launched.instance_id, billed[0][2])]
    finally:
        up.terminate([i.instance_id for i in up.list_instances(tags={"t": "probe"})])


def test_a_probe_refused_once_is_asked_again_before_it_counts(market, tmp_path):
    """An unfulfilled spot request may be a miss: probe_spot asks a refusing pool once more (with its own
    idempotency token) before recording probe-down; a pool that refuses every try is recorded down."""
    from airflow_spot.backends.base import LaunchError, LaunchSpec
    from airflow_spot.backends.local import LocalBackend
    from airflow_spot.operators.planning import AvailabilityRecorder, probe_spot
    from airflow_spot.storage.object_store import open_store

    offer = make_plan(market).ranked[0]
    job = open_store(str(tmp_path / "job"))
    tokens = []

    def spec(o, try_number):
        tokens.append(f"probe-{try_number}")
        return LaunchSpec(offer=o, job_uri=job.uri, idempotency_token=tokens[-1], tags={"t": "probe"},
                          idle_timeout_seconds=60.0)

    class MissesFirst(LocalBackend):
        """The local backend, except that its first ``misses`` launches are refused for capacity (a probe's
        miss cannot be produced on a real pool here)."""

        misses = 1
        then_broken = False  # after the misses, fail for another reason (a throttled API, say)

        def launch(self, spec):
            if self.misses > 0:
                self.misses -= 1
                raise LaunchError("InsufficientInstanceCapacity (a miss)", capacity=True)
            if self.then_broken:
                raise LaunchError("RequestLimitExceeded", capacity=False)
            return super().launch(spec)

    backend = MissesFirst(state_dir=str(tmp_path / "s"))
    rec = AvailabilityRecorder(job, None, "j")
    try:
        assert probe_spot(backend, [offer], spec, rec, now=T0) == 1
        assert [e.kind for e in rec.job_events()] == ["probe-up"]
        assert tokens == ["probe-0", "probe-1"]
        backend.misses = 2
        assert probe_spot(backend, [offer], spec, rec, now=T0 + 1) == 1
        assert [e.kind for e in rec.job_events()] == ["probe-up", "probe-down"]
        backend.misses = 1
        assert probe_spot(backend, [offer], spec, rec, now=T0 + 2, retries=0) == 1
        assert [e.kind for e in rec.job_events()][-1] == "probe-down"
        # refused for capacity, then a failure that says nothing of capacity: the refusal still counts
        backend.misses, backend.then_broken = 1, True
        assert probe_spot(backend, [offer], spec, rec, now=T0 + 3) == 1
        assert [(e.kind, e.at) for e in rec.job_events()][-1] == ("probe-down", T0 + 3)
        backend.misses = 0  # only the other failure: nothing learnt, nothing recorded
        assert probe_spot(backend, [offer], spec, rec, now=T0 + 4) == 0
        assert len(rec.job_events()) == 4
    finally:
        backend.terminate([i.instance_id for i in backend.list_instances(tags={"t": "probe"})])


def test_each_try_of_a_probe_has_its_own_idempotency_token(market, tmp_path):
    """EC2 answers a repeated ClientToken with the first request's outcome: the second ask of a refused probe
    must carry another token, and the same try the same one (a retried call stays idempotent)."""
    from types import SimpleNamespace

    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.object_store import open_store

    op = SpotSegmentOperator(task_id="segment_000", command=["python", "train.py"],
                             checkpoint_uri=f"file://{tmp_path}/job", start_step=0, end_step=10, total_steps=10,
                             gpus=GPUS, backend_options={"state_dir": str(tmp_path / "state")})
    store = open_store(f"file://{tmp_path}/job")
    offer = make_plan(market).ranked[0]
    context = {"ti": SimpleNamespace(try_number=1), "run_id": "manual__1"}
    first, second = (op._probe_spec(context, store, offer, T0, k).idempotency_token for k in (0, 1))
    assert first != second
    assert op._probe_spec(context, store, offer, T0, 1).idempotency_token == second
    assert len(first) == 64  # EC2's ClientToken limit


def test_the_operator_records_refusals_and_plans_again_with_them(tmp_path):
    """Every spot pool refuses (the local backend replays a trace that is down): SpotSegmentOperator's
    _get_instance records each refusal in the job's log and the deployment's, plans again with them, and a
    job without slack to wait launches on-demand instead of failing the try."""
    import json
    from types import SimpleNamespace

    from airflow_spot.backends.base import InstanceState
    from airflow_spot.operators.planning import AvailabilityRecorder
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.object_store import open_store

    trace = tmp_path / "us-west-2b_v100_1.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 3600}, "data": [0, 0, 0, 1, 0]}))
    op = SpotSegmentOperator(
        task_id="segment_000", command=["python", "train.py"], checkpoint_uri=f"file://{tmp_path}/job",
        start_step=0, end_step=10, total_steps=10, gpus=GPUS,
        backend_options={"state_dir": str(tmp_path / "state"),
                         "preemption": {"mode": "trace", "path": str(trace), "capacity": True,
                                        "start_offset_seconds": 0}},
    )
    store = open_store(f"file://{tmp_path}/job")
    rec = AvailabilityRecorder(store, open_store(str(tmp_path / "deployment")), "dag.train")
    market = op.hook.get_market()
    now = time.time()
    # 100 steps of 100 s and 1600 s of slack: enough to start on spot (a restart above the 900 s floor),
    # not to wait for it; the pools already refused a previous try 2 minutes ago (past the 60 s grace)
    kw = dict(done_steps=0, total_steps=100, job_started_at=now, deadline=timedelta(seconds=11_600), ledger_rows=[],
              step_seconds=100.0)
    for o in market.offers(GPUS):
        if o.is_spot and GPUS.matches(o):
            rec.record(o.pool, "refused", now - 120)
    first = plan(market, GPUS, now=now, job_events=rec.job_events(), **kw)
    assert first.market is Market.SPOT

    def replan():
        return plan(market, GPUS, now=time.time(), job_events=rec.job_events(), **kw)

    context = {"ti": SimpleNamespace(try_number=1), "run_id": "manual__1"}
    backend = op.hook.get_backend()
    before = len(rec.deployment_log.read())
    try:
        info, reused = op._get_instance(context, store, first, [], recorder=rec, replan=replan)
        assert Market(info.offer.market) is Market.ON_DEMAND and not reused
        refused = [e.pool for e in rec.job_events() if e.kind == "refused" and e.at >= now]
        assert sorted(refused) == sorted(o.pool for o in first.ranked if o.is_spot)
        assert len(rec.deployment_log.read()) == before + len(refused)
    finally:
        backend.terminate([i.instance_id for i in backend.list_instances({})
                           if not InstanceState(i.state).is_terminal()])


def test_the_plan_scales_its_preemption_reserve_with_the_job_s_own_preemptions(market):
    """Three spot attempts of an hour each, all preempted: the plan's decision sees the job's own rate,
    (prior x 20 h + 3) / (20 h + 3 h) with the prior the matching spot offers' mean rate, and says so."""
    best = make_plan(market).ranked[0]
    rows = [LedgerRow(f"seg.try{i}", f"i-{i}", best.instance_type, best.zone, "spot", best.price_per_hour,
                      best.on_demand_price_per_hour, T0 - (3 - i) * 3600, T0 - (2 - i) * 3600, 5, "preempted")
            for i in range(3)]
    spots = [o for o in market.offers(GPUS) if GPUS.matches(o) and o.is_spot and o.preemption_rate_per_hour > 0]
    prior = sum(o.preemption_rate_per_hour for o in spots) / len(spots)
    p = make_plan(market, ledger_rows=rows, deadline=timedelta(hours=10), step_seconds=18.0)
    assert f"this job's preemptions {(prior * 20 + 3) / 23:.2f}/h" in p.reason
    fresh = make_plan(market, deadline=timedelta(hours=10), step_seconds=18.0)
    assert f"this job's preemptions {prior:.2f}/h" in fresh.reason


def test_ledger_events_tell_a_new_instance_from_one_reused_by_the_next_segment():
    from airflow_spot.policy.observations import ledger_events

    def row(i, start, end, outcome, new):
        return LedgerRow(f"seg{i}.try1", "i-1", "g5.xlarge", "use1-az1", "spot", 0.5, 1.0, start, end, 5, outcome,
                         new_instance=new)

    ev = ledger_events([row(0, 0.0, 600.0, "completed", True), row(1, 630.0, 900.0, "preempted", False)])
    assert [(e.kind, e.at) for e in ev] == [("launched", 0.0), ("running", 600.0), ("running", 630.0),
                                            ("preempted", 900.0)]


def test_hour_long_segments_under_a_deadline_get_advice_with_a_step_count():
    day = timedelta(hours=52)
    advice = segment_length_advice(3600, 1.0, day)  # 60 min segments
    assert advice and "about 60 min" in advice and "steps_per_segment=1200" in advice
    assert segment_length_advice(1200, 1.0, day) is None  # 20 min: fine
    assert segment_length_advice(3600, 1.0, None) is None  # no deadline: spot only, nothing to decide
    assert segment_length_advice(3600, None, day) is None  # no step time measured yet


def segment_operator(tmp_path):
    """A segment operator on the local backend, its job's store and availability recorder, its market and
    backend, and a task context: what its instance choice (``_get_instance``) is called with."""
    from types import SimpleNamespace

    from airflow_spot.operators.planning import AvailabilityRecorder
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.object_store import open_store

    op = SpotSegmentOperator(
        task_id="segment_001", command=["python", "train.py"], checkpoint_uri=f"file://{tmp_path}/job",
        start_step=10, end_step=20, total_steps=1000, gpus=GPUS, backend_options={"state_dir": str(tmp_path / "state")},
    )
    store = open_store(f"file://{tmp_path}/job")
    context = {"ti": SimpleNamespace(try_number=1), "run_id": "manual__1"}
    return (op, store, AvailabilityRecorder(store, None, "dag.train"), op.hook.get_market(), op.hook.get_backend(),
            context)


def test_the_operator_moves_a_warm_instance_only_once_a_cheaper_pool_accepts(tmp_path):
    """Make before break: SpotSegmentOperator._get_instance launches the plan's move target first and
    terminates its warm instance in the dear pool only then; when the cheaper pools refuse, it keeps the
    warm instance (and records the refusals)."""
    from airflow_spot.backends.base import LaunchError

    op, store, rec, market, backend, context = segment_operator(tmp_path)
    worst = make_plan(market).ranked[-1]
    try:
        warm, _, _ = op._launch_first(context, store, [worst], rec)
        for o in make_plan(market).ranked[:-1]:  # the cheaper pools, seen up by probes for 50 min
            rec.record(o.pool, "probe-up", time.time() - 3000)
        p = plan(market, GPUS, now=time.time(), done_steps=10, total_steps=1000, job_started_at=T0, deadline=None,
                 ledger_rows=[], running=Market.SPOT, running_pool=worst.pool, job_events=rec.job_events())
        assert p.move_to
        refusing = backend.launch
        backend.launch = lambda spec: (_ for _ in ()).throw(LaunchError("no capacity", capacity=True))
        kept, reused = op._get_instance(context, store, p, [warm], recorder=rec)
        assert (kept.instance_id, reused) == (warm.instance_id, True)
        assert {e.pool for e in rec.job_events() if e.kind == "refused"} == {o.pool for o in p.move_to}
        # a target that cannot be launched for another reason (quota, the region's setup) is skipped, not fatal
        backend.launch = lambda spec: (_ for _ in ()).throw(LaunchError("quota exceeded", capacity=False))
        kept, reused = op._get_instance(context, store, p, [warm], recorder=rec)
        assert (kept.instance_id, reused) == (warm.instance_id, True)
        backend.launch = refusing
        last = LedgerRow("seg.try1", warm.instance_id, worst.instance_type, worst.zone, "spot", worst.price_per_hour,
                         worst.on_demand_price_per_hour, time.time() - 900, time.time() - 120, 10, "completed")
        moved, reused = op._get_instance(context, store, p, [warm], recorder=rec, rows=[last])
        assert not reused and moved.offer.pool == p.move_to[0].pool
        states = {i.instance_id: InstanceState(i.state) for i in backend.list_instances({})}
        assert states[warm.instance_id].is_terminal() and not states[moved.instance_id].is_terminal()
        # the warm instance's time from its last attempt to its termination is in the job's cost (no
        # attempt reused it to pay it); kept, it was not billed
        (idle,), bad = LedgerStore(store).idle_rows()
        assert not bad and idle.instance_id == warm.instance_id and idle.started_at == last.ended_at
        assert idle.billed_seconds == pytest.approx(120, abs=5) and idle.outcome == "idle"
    finally:
        backend.terminate([i.instance_id for i in backend.list_instances({})
                           if not InstanceState(i.state).is_terminal()])


def test_the_operator_probes_the_pools_a_move_waits_on_and_moves_once_they_have_settled(tmp_path):
    """On a warm instance in the dearest pool, the plan names the cheaper pools for a probe
    (``settle_probe``): SpotSegmentOperator._settle_probe launches and terminates one instance in each
    (probe-up, billed its minimum in the job's cost) and plans again; 45 min of such sightings later the
    plan moves. With ``probe_spot=False`` it tries them as move targets at once, as ``ours-no-probe``."""
    op, store, rec, market, backend, context = segment_operator(tmp_path)
    worst = make_plan(market).ranked[-1]
    try:
        warm, _, _ = op._launch_first(context, store, [worst], rec)

        def plan_at(now):
            return plan(market, GPUS, now=now, done_steps=10, total_steps=1000, job_started_at=T0, deadline=None,
                        ledger_rows=[], running=Market.SPOT, running_pool=worst.pool, job_events=rec.job_events())

        now = time.time()
        first = plan_at(now)
        assert first.move_to == [] and first.settle_probe
        after = op._settle_probe(context, store, first, rec, now, lambda: plan_at(now))
        probed = {e.pool for e in rec.job_events() if e.kind == "probe-up"}
        assert probed == {o.pool for o in first.settle_probe} and after.move_to == []
        assert len(LedgerStore(store).probe_rows()[0]) == len(probed)  # each billed in the job's cost
        assert all(InstanceState(i.state).is_terminal() for i in backend.list_instances({})
                   if i.instance_id != warm.instance_id)
        later = plan_at(now + 2700)  # seen up since the probe, 45 min on
        assert later.move_to and later.move_to[0].pool == first.settle_probe[0].pool
        op.probe_spot = False
        moved = op._settle_probe(context, store, first, rec, now, lambda: plan_at(now))
        assert moved.move_to == first.settle_probe and moved.settle_probe == []
    finally:
        backend.terminate([i.instance_id for i in backend.list_instances({})
                           if not InstanceState(i.state).is_terminal()])


def test_attempts_outside_the_checkpoint_stores_region_pay_the_transfer(market):
    cheapest = make_plan(market).ranked[0]
    assert cheapest.region != "us-east-1"
    # a restore and saves across regions dearer than what the cheaper regions save over the job's work
    p = make_plan(market, checkpoint_region="us-east-1", transfer_dollars=1.0)
    assert p.ranked[0].region == "us-east-1"
    # a transfer that is cheap against the work left changes nothing
    long_job = dict(total_steps=10**6, step_seconds=1.0)
    assert make_plan(market, checkpoint_region="us-east-1", transfer_dollars=0.01, **long_job).ranked[0] == \
        make_plan(market, **long_job).ranked[0]
    # the store's region alone prices nothing
    assert make_plan(market, checkpoint_region="us-east-1").ranked == make_plan(market).ranked
    # saves written back cost by the hour, whatever the work left: a long job with a free restore stays home
    # when running elsewhere costs more an hour than the cheaper region saves
    home = make_plan(market, checkpoint_region="us-east-1", remote_dollars_per_hour=5.0, **long_job).ranked[0]
    assert home.region == "us-east-1"


def test_the_ledger_row_carries_the_restore_and_the_saves_back_by_the_hour(tmp_path):
    from airflow_spot.operators import accounting
    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.policy.offers import Market, Offer
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import Outcome

    offer = Offer("p3.2xlarge", "us-west-2", "us-west-2b", Market.SPOT, 1.0, 3.0, "V100", 1, 16.0)
    launch = AttemptLaunch(attempt_id="a", segment_index=0, start_step=0, end_step=10, instance_id="i",
                           offer=offer.to_dict(), requested_at=100.0, billed_from=100.0, reused_instance=False,
                           try_number=1, task_id="t", transfer_dollars=0.5, remote_dollars_per_hour=3.6)
    row = accounting.record_attempt(open_store(str(tmp_path)), launch, Outcome.COMPLETED,
                                    {"ended_at": 1100.0}, steps_after=10, now=1100.0)
    # $0.5 of restore and 1000 s at $3.6 an hour of saves back
    assert row["transfer_dollars"] == pytest.approx(1.5)


# ------------------------------------------------------------------ the step time a segment start measures
def _beats(tmp_path, attempts: int, ewma=lambda i: 0.5):
    """A job of ``attempts`` one-after-another attempts, each with a heartbeat and a ledger row; a store
    that counts the heartbeats read."""
    from airflow_spot.storage.object_store import LocalStore
    from airflow_spot.storage.protocol import Heartbeat, JobLayout

    store = LocalStore(tmp_path)
    layout, rows = JobLayout(store), []
    for i in range(attempts):
        aid = f"train.segment_{i:03d}.try1"
        layout.write_heartbeat(Heartbeat(attempt_id=aid, step=i, time=T0 + 100 * i + 90, step_time_ewma=ewma(i)))
        rows.append(LedgerRow(aid, f"i-{i}", "g4dn.xlarge", "us-east-1a", "spot", 0.2, 0.5, T0 + 100 * i,
                              T0 + 100 * i + 95, 1, "completed"))
    read: list[str] = []
    get_many = store.get_many
    store.get_many = lambda keys: (read.extend(keys), get_many(keys))[1]
    return layout, rows, read


def test_the_step_time_is_the_newest_heartbeats_read_from_the_recent_attempts_only(tmp_path):
    from airflow_spot.operators.planning import RECENT_HEARTBEATS, measured_step_seconds
    from airflow_spot.storage.protocol import Heartbeat

    layout, rows, read = _beats(tmp_path, 40, ewma=lambda i: 0.5 + i / 100)
    assert measured_step_seconds(layout) == pytest.approx(0.89)  # every heartbeat read
    assert len(read) == 40
    read.clear()
    assert measured_step_seconds(layout, rows) == pytest.approx(0.89)
    assert len(read) == RECENT_HEARTBEATS
    # a running attempt (no ledger row yet) beats later: it is read, and it is the newest
    layout.write_heartbeat(Heartbeat(attempt_id="train.segment_040.try1", step=1, time=T0 + 5000, step_time_ewma=0.25))
    read.clear()
    assert measured_step_seconds(layout, rows) == 0.25 and len(read) == RECENT_HEARTBEATS + 1


def test_without_a_step_time_in_the_recent_attempts_every_heartbeat_is_read(tmp_path):
    from airflow_spot.operators.planning import measured_step_seconds

    # the last 10 attempts died before their first step: only an older one measured the step time
    layout, rows, read = _beats(tmp_path, 30, ewma=lambda i: 0.7 if i == 12 else (0.6 if i < 20 and i != 12 else None))
    assert measured_step_seconds(layout, rows) == measured_step_seconds(layout) == 0.6
    layout2, rows2, _ = _beats(tmp_path / "b", 30, ewma=lambda i: 0.7 if i == 19 else (0.6 if i < 19 else None))
    assert measured_step_seconds(layout2, rows2) == 0.7


def test_a_warm_instance_is_billed_at_its_pools_price_now_not_the_price_it_was_launched_at(tmp_path):
    """The cloud bills a running spot instance the price in effect; a warm instance reused by the next
    segment must not carry the price of its launch, hours ago, into that segment's ledger row."""
    from dataclasses import replace

    from airflow_spot.operators.planning import priced_now

    op, store, rec, market, backend, context = segment_operator(tmp_path)
    best = make_plan(market).ranked[0]
    try:
        launched, _, _ = op._launch_first(context, store, [best], rec)
        # launched when the pool cost half what it costs now
        warm = replace(launched, offer=replace(launched.offer, price_per_hour=best.price_per_hour / 2))
        p = plan(market, GPUS, now=time.time(), done_steps=10, total_steps=1000, job_started_at=T0, deadline=None,
                 ledger_rows=[], running=Market.SPOT, running_pool=best.pool, job_events=rec.job_events())
        assert not p.move_to
        kept, reused = op._get_instance(context, store, p, [warm], recorder=rec)
        assert reused and kept.instance_id == warm.instance_id
        assert kept.offer.price_per_hour == best.price_per_hour
        assert (kept.offer.pool, kept.offer.market) == (warm.offer.pool, warm.offer.market)
    finally:
        backend.terminate([i.instance_id for i in backend.list_instances({})
                           if not InstanceState(i.state).is_terminal()])
    # a pool the market no longer offers keeps the instance's own price; another market's offer is no match
    gone = replace(warm, offer=replace(warm.offer, zone="nowhere-1a"))
    assert priced_now(gone, p.ranked) is gone
    od = replace(best, market=Market.ON_DEMAND, price_per_hour=99.0)
    assert priced_now(warm, [od]).offer.price_per_hour == warm.offer.price_per_hour
    assert priced_now(warm, [od, best]).offer.price_per_hour == best.price_per_hour


def test_a_warm_instance_is_priced_from_every_offer_of_the_market_not_only_the_ones_the_request_accepts(market):
    """A pool whose price rose above the request's cap leaves the plan's ranking but the instance still
    bills at that price; an on-demand offer made per region prices an instance in any of its zones."""
    from dataclasses import replace

    from airflow_spot.operators.planning import priced_now

    best = make_plan(market).ranked[0]
    warm = InstanceInfo("i-1", InstanceState.RUNNING, replace(best, price_per_hour=best.price_per_hour / 2), "job")
    capped = GpuRequest(count=1, min_memory_gib=16, max_price_per_hour=best.price_per_hour * 0.9)
    p = plan(market, capped, now=T0, done_steps=0, total_steps=1000, job_started_at=T0, deadline=None,
             ledger_rows=[])
    assert best.pool not in {o.pool for o in p.ranked}
    assert priced_now(warm, p.market_offers).offer.price_per_hour == best.price_per_hour
    regional = replace(best, market=Market.ON_DEMAND, zone=best.region, price_per_hour=7.0)
    on_demand = InstanceInfo("i-2", InstanceState.RUNNING, replace(best, market=Market.ON_DEMAND, price_per_hour=1.0),
                             "job")
    assert priced_now(on_demand, [regional]).offer.price_per_hour == 7.0
    assert priced_now(on_demand, [regional]).offer.zone == best.zone  # its own zone, as the backend says
    assert priced_now(warm, [regional]) is warm  # an on-demand price never bills a spot instance


def test_a_bad_checkpoint_digest_setting_fails_the_segment_before_anything_is_recorded(tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.checkpoint import DIGEST_ENV

    def op(env=None):
        return SpotSegmentOperator(
            task_id="segment_000", command=["python", "train.py"], checkpoint_uri=f"file://{tmp_path}/job",
            start_step=0, end_step=10, total_steps=10, gpus=GPUS, env=env,
            backend_options={"state_dir": str(tmp_path / "state")})

    op()._check_command()
    op({DIGEST_ENV: "sha256"})._check_command()
    with pytest.raises(AirflowFailException, match="'fast' is not a checkpoint digest.*the operator's env="):
        op({DIGEST_ENV: "fast"})._check_command()
    monkeypatch.setenv(DIGEST_ENV, "md5")
    with pytest.raises(AirflowFailException, match="'md5' is not a checkpoint digest.*this Airflow worker's"):
        op()._check_command()


def test_a_warm_instance_whose_pool_rose_above_the_price_cap_is_not_reused(market):
    from dataclasses import replace

    best = make_plan(market).ranked[0]
    warm = InstanceInfo("i-1", InstanceState.RUNNING, replace(best, price_per_hour=best.price_per_hour / 2), "job")
    args = dict(now=T0, done_steps=0, total_steps=1000, job_started_at=T0, deadline=None, ledger_rows=[])
    under = plan(market, GpuRequest(count=1, min_memory_gib=16, max_price_per_hour=best.price_per_hour * 0.9), **args)
    assert pick_warm([warm], under) is None  # launched under the cap, above it now: let go
    at = plan(market, GpuRequest(count=1, min_memory_gib=16, max_price_per_hour=best.price_per_hour), **args)
    for p in (at, make_plan(market)):  # at the cap; no cap
        kept = pick_warm([warm], p)
        assert kept.instance_id == "i-1" and kept.offer.price_per_hour == best.price_per_hour


def test_warm_instances_are_ranked_at_todays_prices_and_one_the_request_no_longer_takes_is_let_go(market):
    from dataclasses import replace

    ranked = make_plan(market).ranked
    cheap_now, dear_now = ranked[0], ranked[-1]
    # A was launched for a cent in a pool that is the dearest now; B sits in the cheapest pool
    a = InstanceInfo("a", InstanceState.RUNNING, replace(dear_now, price_per_hour=0.01), "job")
    b = InstanceInfo("b", InstanceState.RUNNING, cheap_now, "job")
    chosen = pick_warm([a, b], make_plan(market))
    assert chosen.instance_id == "b" and chosen.offer.price_per_hour == cheap_now.price_per_hour
    alone = pick_warm([a], make_plan(market))
    assert alone.instance_id == "a" and alone.offer.price_per_hour == dear_now.price_per_hour  # billed today's
    # a type the request no longer takes (the DAG now asks for 8 GPUs)
    eight = GpuRequest(count=8, min_memory_gib=16)
    p8 = plan(market, eight, now=T0, done_steps=0, total_steps=1000, job_started_at=T0, deadline=None, ledger_rows=[])
    assert pick_warm([b], p8) is None


def test_the_tasks_own_digest_setting_wins_and_numbers_are_checked_as_sent(tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.checkpoint import DIGEST_ENV

    def op(env):
        return SpotSegmentOperator(
            task_id="segment_000", command=["python", "train.py"], checkpoint_uri=f"file://{tmp_path}/job",
            start_step=0, end_step=10, total_steps=10, gpus=GPUS, env=env,
            backend_options={"state_dir": str(tmp_path / "state")})

    monkeypatch.setenv(DIGEST_ENV, "block")
    p = make_plan(get_market("local"))
    assert op({DIGEST_ENV: " SHA256"})._request("a1", T0, p).env[DIGEST_ENV] == "sha256"
    assert op({})._request("a1", T0, p).env[DIGEST_ENV] == "block"
    for number in (0, 1, 0.0):
        with pytest.raises(AirflowFailException, match=f"'{number}' is not a checkpoint digest"):
            op({DIGEST_ENV: number})._check_command()


def test_where_every_spot_offer_costs_more_than_on_demand_the_plan_is_on_demand(market):
    """A market whose spot prices stand above on-demand (a price spike, or saves written back across
    regions): the operator plans on-demand, with a deadline or without, rather than launch dear spot."""
    from dataclasses import replace

    from airflow_spot.market.base import MarketSource

    class SpikedMarket(MarketSource):
        def offers(self, request):
            return [replace(o, price_per_hour=2 * o.on_demand_price_per_hour) if o.is_spot else o
                    for o in market.offers(request)]

        def on_demand_price(self, instance_type, region):
            return market.on_demand_price(instance_type, region)

        def preemption_rate_per_hour(self, instance_type, region, zone=""):
            return market.preemption_rate_per_hour(instance_type, region, zone)

    for deadline in (None, timedelta(hours=100)):
        p = make_plan(SpikedMarket(), deadline=deadline, step_seconds=18.0)
        assert p.market is Market.ON_DEMAND and p.ranked and not any(o.is_spot for o in p.ranked)
        assert "no spot offer costs less than on-demand of its type" in p.reason


def test_a_warm_spot_instance_whose_pool_now_costs_as_much_as_on_demand_is_let_go(market):
    """The plan says leave (decision.leave_running): the warm instance in that pool is not reused."""
    from dataclasses import replace

    from airflow_spot.operators.planning import Plan

    o = next(o for o in market.offers(GPUS) if o.is_spot)
    warm = InstanceInfo("i-warm", InstanceState.RUNNING, o, "file:///job")
    base = Plan(ranked=[o], market=Market.SPOT, reason="", mtbf_seconds=None)
    assert pick_warm([warm], base) is not None
    assert pick_warm([warm], replace(base, leave_running=True)) is None


def test_before_any_heartbeat_a_declared_step_profile_feeds_the_deadline_rule(market):
    """The first segment has no measured step time: without a profile only the Uniform Progress line
    decides (spot at the start); with a profile that says the work fills the window on the on-demand
    instance the rule falls back to, the rule sees no slack for a restart and starts on on-demand."""
    from airflow_spot.market.throughput import instance_throughput
    from airflow_spot.operators.planning import profile_step_seconds, work_reference

    offers = [o for o in market.offers(GPUS) if GPUS.matches(o)]
    ref = work_reference(offers)
    assert not ref.is_spot
    # 1000 steps at 35 s per step on the reference: 9.7 h of a 10 h window
    profile = {"V100": 35.0 * instance_throughput(ref.gpu_name, ref.gpu_count) / instance_throughput("V100", 1)}
    assert profile_step_seconds(profile, ref) == pytest.approx(35.0)
    assert profile_step_seconds({"NOT-A-GPU": 1.0}, ref) is None
    blind = make_plan(market, deadline=timedelta(hours=10))
    assert blind.market is Market.SPOT
    told = make_plan(market, deadline=timedelta(hours=10), step_profile=profile)
    assert told.market is Market.ON_DEMAND and "declared step_profile" in told.reason
    # a measured step time wins over the profile
    fast = make_plan(market, deadline=timedelta(hours=10), step_profile=profile, step_seconds=1.0)
    assert fast.market is Market.SPOT and "declared" not in fast.reason


def test_work_is_counted_at_the_pace_of_the_on_demand_instance_the_rule_falls_back_to(market):
    """A step time measured on a spot type twice as fast as the on-demand reference: the work left takes
    twice as long there. 5 of 10 h gone, 500 of 1000 steps done at 17 s/step measured on the fast type:
    2.4 h left at that pace (ahead: spot), 4.7 h of the 5 h on the reference (less than a restart and the
    floor's slack: on-demand)."""
    from airflow_spot.operators.planning import work_reference

    offers = [o for o in market.offers(GPUS) if GPUS.matches(o)]
    ref = work_reference(offers)
    args = dict(now=T0 + 5 * 3600, done_steps=500, deadline=timedelta(hours=10), step_seconds=17.0)
    same = make_plan(market, step_throughput=ref.relative_throughput, **args)
    assert same.market is Market.SPOT and "pace" not in same.reason
    fast = make_plan(market, step_throughput=2 * ref.relative_throughput, **args)
    assert fast.market is Market.ON_DEMAND
    assert f"work counted at {ref.instance_type}'s pace" in fast.reason


def test_the_operator_reads_which_instance_measured_the_step_time_from_its_launch_record(market, tmp_path):
    from dataclasses import asdict

    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.object_store import open_store

    store = open_store(f"file://{tmp_path}/job")
    fast = max((o for o in market.offers(GPUS) if GPUS.matches(o)), key=lambda o: o.relative_throughput)
    AttemptLaunch(attempt_id="a1", segment_index=0, start_step=0, end_step=10, instance_id="i-1",
                  offer=asdict(fast), requested_at=T0, billed_from=T0, reused_instance=False, try_number=1,
                  task_id="segment_000").write(store)
    assert SpotSegmentOperator._throughput_of(store, "a1") == fast.relative_throughput
    assert SpotSegmentOperator._throughput_of(store, "never-launched") is None
