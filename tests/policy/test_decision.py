"""The one decision function (policy/decision.py) and what it derives from observed pool events."""
from __future__ import annotations

from dataclasses import replace

import pytest

from airflow_spot.policy.deadline import WAIT, DeadlineParams, DeadlineState, Observation, slack_budget
from airflow_spot.policy.decision import DecisionParams, decide_attempt
from airflow_spot.policy.observations import JobObservation, PoolEvent, expected_outage_seconds, pool_views
from airflow_spot.policy.offers import Market, Offer

H = 3600.0
R = 0.2 * H  # one restart


def spot(zone: str, price: float = 1.0, region: str | None = None) -> Offer:
    return Offer("p3.2xlarge", region or zone[:-1], zone, Market.SPOT, price, 3.0, "V100", 1, 16.0,
                 relative_throughput=1.0, preemption_rate_per_hour=0.25)


ON_DEMAND = Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, 3.0, 3.0, "V100", 1, 16.0)
A, B, C = spot("us-west-2a"), spot("us-west-2b"), spot("us-west-2c")
PARAMS = DecisionParams(deadline=DeadlineParams(restart_overhead_seconds=R))


def job(now, events=(), *, work_done=0.0, work_h=48.0, deadline_h=52.0, offers=(A, B, C, ON_DEMAND), **kw):
    return JobObservation(now=now, started_at=0.0, deadline_at=None if deadline_h is None else deadline_h * H,
                          work_done=work_done,
                          work_total=work_h * H, offers=list(offers), events=list(events), **kw)


# ---------------------------------------------------------------- what events say


def test_a_pool_is_up_after_a_launch_down_after_a_refusal_and_worth_a_new_try_later():
    ev = [PoolEvent(A.pool, "launched", 0.0), PoolEvent(B.pool, "refused", 100.0)]
    v = pool_views(ev, 150.0, [A.pool, B.pool, C.pool], recheck_seconds=120.0)
    assert (v[A.pool].state, v[B.pool].state, v[C.pool].state) == ("up", "down", "unknown")
    assert v[A.pool].up_seconds(150.0) == 150.0
    assert pool_views(ev, 221.0, [B.pool], recheck_seconds=120.0)[B.pool].state == "unknown"
    # the future is not seen
    assert pool_views(ev, 50.0, [B.pool])[B.pool].state == "unknown"


def test_up_time_counts_from_the_first_up_event_after_the_last_loss():
    ev = [PoolEvent(A.pool, "launched", 0.0), PoolEvent(A.pool, "preempted", 1000.0),
          PoolEvent(A.pool, "refused", 1100.0), PoolEvent(A.pool, "probe-up", 1300.0),
          PoolEvent(A.pool, "probe-up", 2400.0)]
    v = pool_views(ev, 3000.0, [A.pool])[A.pool]
    assert v.state == "up" and v.up_since == 1300.0
    # an outage is measured from the loss to the next up-event seen shortly after someone looked
    assert v.outages == (300.0,)


def test_an_outage_nobody_watched_is_not_measured():
    ev = [PoolEvent(A.pool, "preempted", 0.0), PoolEvent(A.pool, "probe-up", 5 * H)]
    assert pool_views(ev, 6 * H, [A.pool], watch_seconds=900.0)[A.pool].outages == ()


@pytest.mark.parametrize("gap", [880.0, 900.0, 928.0, 1100.0])
def test_an_outage_seen_only_between_two_probes_is_not_measured_whatever_their_spacing(gap):
    # an on-demand job probes every probe_every_seconds; such an outage is known only to within a probe
    # interval, so it never counts, however the probes happen to fall
    params = DecisionParams()
    assert params.watch_seconds < params.probe_every_seconds
    ev = [PoolEvent(A.pool, "refused", 0.0), PoolEvent(A.pool, "probe-down", gap),
          PoolEvent(A.pool, "probe-up", 2 * gap)]
    v = pool_views(ev, 3 * gap, [A.pool], params.recheck_seconds, params.watch_seconds)[A.pool]
    assert v.state == "up" and v.outages == ()
    # an idle job retrying every recheck_seconds measures one
    ev = [PoolEvent(A.pool, "refused", 0.0), PoolEvent(A.pool, "refused", 60.0), PoolEvent(A.pool, "launched", 120.0)]
    assert pool_views(ev, 200.0, [A.pool], params.recheck_seconds, params.watch_seconds)[A.pool].outages == (120.0,)


def test_expected_outage_blends_the_prior_with_what_was_seen():
    v = pool_views([PoolEvent(A.pool, "refused", 0.0), PoolEvent(A.pool, "refused", 400.0),
                    PoolEvent(A.pool, "launched", 600.0)], 700.0, [A.pool])
    assert expected_outage_seconds(v.values(), prior_seconds=1800.0, prior_weight=2.0) == pytest.approx(
        (2 * 1800.0 + 600.0) / 3)
    assert expected_outage_seconds([], prior_seconds=1800.0) == 1800.0


def test_bad_events_are_refused_with_the_valid_kinds():
    with pytest.raises(ValueError, match="valid kinds"):
        PoolEvent(A.pool, "gone", 0.0)


# ---------------------------------------------------------------- the decision


def all_refused(at):
    return [PoolEvent(o.pool, "refused", at) for o in (A, B, C)]


def test_an_early_short_outage_of_every_zone_is_waited_out_when_outages_were_seen_short():
    """48 h of work, 52 h deadline, 6 minutes in, every zone refuses: 3.9 h of slack is less than the fixed
    waiting reserve (0.10 x 48 h), which sent slack-budget to on-demand at once. The deployment's log holds
    two watched outages, of 1500 s and 1200 s: the expected outage, shrunk towards the 0 s prior (weight 2),
    is (1500 + 1200) / 4 = 675 s; 120 s have been waited, and the slack after the floor, a restart and the
    spot reserve (14040 - 1080 - 720 - 0.03 x 172800 = 7056 s) pays the 555 s left: the job waits."""
    seen = [PoolEvent(A.pool, "preempted", -2 * H, job="other"), PoolEvent(A.pool, "refused", -2 * H + 1300, job="other"),
            PoolEvent(A.pool, "launched", -2 * H + 1500, job="other"),
            PoolEvent(B.pool, "preempted", -H, job="other"), PoolEvent(B.pool, "refused", -H + 1000, job="other"),
            PoolEvent(B.pool, "launched", -H + 1200, job="other")]
    now = 0.1 * H
    refusals = all_refused(now - 120) + all_refused(now)
    d = decide_attempt(job(now, seen + refusals), params=PARAMS)
    assert d.expected_outage_seconds == pytest.approx(675.0)
    assert d.market == WAIT and "expected" in d.reason
    # once the expected outage has been waited out, on-demand
    later = refusals + all_refused(now - 120 + 700)
    assert decide_attempt(job(now - 120 + 700, seen + later), params=PARAMS).market == Market.ON_DEMAND.value
    # no outage seen anywhere: no evidence that waiting pays, on-demand once the 60 s grace is over
    d = decide_attempt(job(now, refusals), params=PARAMS)
    assert d.expected_outage_seconds == 0.0 and d.market == Market.ON_DEMAND.value
    # the same moment without an expected outage length (the fixed reserve alone): on-demand too
    obs = Observation(0.0, 52 * H, 0.0, 48 * H, spot_available=False, no_spot_seconds=120.0)
    assert slack_budget(DeadlineState(), obs, now, PARAMS.deadline).market == Market.ON_DEMAND.value
    # a prior can still be given (a deployment that knows its outages are short)
    p = DecisionParams(deadline=DeadlineParams(restart_overhead_seconds=R), prior_outage_seconds=1800.0)
    assert decide_attempt(job(now, refusals), params=p).market == WAIT


def test_an_outage_longer_than_expected_goes_on_demand_when_the_slack_is_tight():
    # refused since 0.1 h, still refused 40 minutes later: past the expected 30 min (a 30 min prior)
    ev = all_refused(0.1 * H) + all_refused(0.1 * H + 40 * 60)
    p = DecisionParams(deadline=DeadlineParams(restart_overhead_seconds=R), prior_outage_seconds=1800.0)
    d = decide_attempt(job(0.1 * H + 40 * 60, ev), params=p)
    assert d.market == Market.ON_DEMAND.value


def test_a_tight_job_does_not_wait_an_outage_it_cannot_afford():
    # 48 h of work, 49 h deadline: after the restart and the spot reserve no slack is left to wait
    now = 0.1 * H
    d = decide_attempt(job(now, all_refused(now - 120) + all_refused(now), deadline_h=49.0), params=PARAMS)
    assert d.market == Market.ON_DEMAND.value


def test_spot_offers_are_ranked_by_price_observed_state_and_up_time_not_list_order():
    cheap, unseen = spot("us-west-2d", price=0.9), spot("us-west-2e")
    cheap_refused = spot("us-west-2f", price=0.8)
    ev = [PoolEvent(A.pool, "launched", 0.0), PoolEvent(B.pool, "probe-up", 3 * H),
          PoolEvent(C.pool, "refused", 4 * H - 10), PoolEvent(cheap_refused.pool, "refused", 4 * H - 10)]
    for offers in ([A, B, C, cheap, unseen, cheap_refused, ON_DEMAND],
                   [cheap_refused, unseen, cheap, C, B, A, ON_DEMAND]):
        d = decide_attempt(job(4 * H, ev, offers=offers, deadline_h=None), params=PARAMS)
        # the cheaper pool not known to be down first (a try costs a refusal); at the same price believed
        # up before unknown, A (up 4 h) before B (up 1 h); the pools that just refused last, cheapest first
        assert [o.pool for o in d.ranked] == [cheap.pool, A.pool, B.pool, unseen.pool, cheap_refused.pool, C.pool]


def test_leaving_on_demand_needs_a_pool_seen_up_long_enough():
    base = dict(work_done=10 * H, work_h=20.0, deadline_h=40.0, running="on-demand")
    fresh = [PoolEvent(A.pool, "probe-up", 10 * H - 600)]
    settled = [PoolEvent(A.pool, "probe-up", 9 * H), PoolEvent(A.pool, "probe-up", 10 * H - 60)]
    assert decide_attempt(job(10 * H, fresh, **base), params=PARAMS).market == Market.ON_DEMAND.value
    assert decide_attempt(job(10 * H, settled, **base), params=PARAMS).market == Market.SPOT.value


def test_a_settled_pool_refused_a_moment_ago_still_lets_the_job_leave_on_demand():
    """A lone job that decides to leave on-demand for a pool it saw up an hour and is refused there takes
    the next pool that accepts. A job that saw that refusal a moment before deciding (another job's, from
    the deployment's log) must decide the same, or reading the log would change what a job does for the
    timing of an event alone; once the refusal is older than a recheck, no pool counts as settled."""
    base = dict(work_done=10 * H, work_h=20.0, deadline_h=40.0, running="on-demand")
    now = 10 * H
    seen = [PoolEvent(A.pool, "probe-up", 9 * H), PoolEvent(A.pool, "probe-up", now - 900),
            PoolEvent(B.pool, "probe-down", now - 900)]
    lone = decide_attempt(job(now, seen, **base), params=PARAMS)
    assert lone.market == Market.SPOT.value and lone.ranked[0] == A
    refused = seen + [PoolEvent(A.pool, "refused", now - 10, job="other-job")]
    d = decide_attempt(job(now, refused, **base), params=PARAMS)
    assert d.market == Market.SPOT.value and d.spot_up_seconds == pytest.approx(H - 10)
    assert d.ranked[-1] == A  # it is not tried first: it just refused
    assert f"the up-time of {A.pool}, down a moment ago" in d.reason
    later = decide_attempt(job(now + PARAMS.recheck_seconds, refused, **base), params=PARAMS)
    assert later.market == Market.ON_DEMAND.value and later.spot_up_seconds == 0.0
    # a pool that refused after a short run is no evidence of a settled market
    short = [PoolEvent(A.pool, "probe-up", now - 900), PoolEvent(A.pool, "refused", now - 10)]
    assert decide_attempt(job(now, short, **base), params=PARAMS).market == Market.ON_DEMAND.value


def test_on_demand_with_stale_spot_knowledge_asks_for_a_probe_only_when_it_could_leave():
    base = dict(work_done=10 * H, work_h=20.0, running="on-demand")
    stale = [PoolEvent(A.pool, "refused", 8 * H)]
    assert decide_attempt(job(10 * H, stale, deadline_h=40.0, **base), params=PARAMS).probe
    recent = [PoolEvent(A.pool, "probe-down", 10 * H - 60)]
    assert not decide_attempt(job(10 * H, recent, deadline_h=40.0, **base), params=PARAMS).probe
    # 10 h of work left and 10.6 h to the deadline: 0.6 h of slack pays no switch (restart + floor +
    # spot reserve = 0.8 h), so no probe either
    assert not decide_attempt(job(10 * H, stale, deadline_h=20.6, **base), params=PARAMS).probe


def test_a_pool_in_another_region_pays_for_moving_the_checkpoint():
    east = spot("us-east-1a", price=0.95)
    p = DecisionParams(deadline=DeadlineParams(restart_overhead_seconds=R), transfer_dollars=5.0,
                       home_region="us-west-2")
    d = decide_attempt(job(0.0, offers=[east, A, ON_DEMAND], deadline_h=None), params=p)
    assert d.ranked[0].pool == A.pool  # 5 % cheaper per hour does not pay a $5 move for 48 h of work
    cheap_move = DecisionParams(deadline=DeadlineParams(restart_overhead_seconds=R), transfer_dollars=0.5,
                                home_region="us-west-2")
    d = decide_attempt(job(0.0, offers=[east, A, ON_DEMAND], deadline_h=None), params=cheap_move)
    assert d.ranked[0].pool == east.pool


def test_the_job_sees_its_own_running_instance_as_up():
    d = decide_attempt(job(5 * H, [PoolEvent(A.pool, "launched", 0.0)], work_done=5 * H, running="spot",
                           running_pool=A.pool), params=PARAMS)
    assert d.market == Market.SPOT.value and d.spot_up_seconds == 5 * H


def test_a_pool_last_seen_down_ranks_by_the_most_it_can_have_been_up():
    """A refused 20 min ago and B 3 h ago (both older than the 60 s recheck: unknown now); C was never
    seen. If A is back, it came back within the last 20 min: priced as a pool up at most 1200 s (risk x
    (1 + 1800 / (1200 + 450)) = 2.09 with the 1800 s cool-down), B as up at most 3 h (x 1.16), C at its
    long-run rate (x 1): C, B, A, not the names' order (which tried A, the pool that just refused, first)."""
    now = 5 * H
    ev = [PoolEvent(A.pool, "refused", now - 1200), PoolEvent(B.pool, "preempted", now - 3 * H)]
    views = pool_views(ev, now, [A.pool, B.pool, C.pool], recheck_seconds=60.0)
    assert [views[o.pool].state for o in (A, B, C)] == ["unknown"] * 3
    assert views[A.pool].up_seconds_at_most(now) == 1200.0 and views[C.pool].up_seconds_at_most(now) is None
    for offers in ([A, B, C, ON_DEMAND], [C, B, A, ON_DEMAND]):
        d = decide_attempt(job(now, ev, offers=offers, deadline_h=None), params=PARAMS)
        assert [o.pool for o in d.ranked] == [C.pool, B.pool, A.pool]
    # seen up again: the observed up-time counts, not the bound
    assert pool_views(ev + [PoolEvent(A.pool, "probe-up", now - 60)], now, [A.pool])[A.pool].up_seconds_at_most(now) is None


def test_leaving_on_demand_keeps_less_slack_for_a_pool_up_longer():
    """On on-demand, 20 h of work left (72000 s), 3400 s of slack; restart 720 s, floor 1080 s; reserve
    0.015 per second of work scaled by 1 + 3600 / (age + 900): a pool up 1 h needs
    720 + 1080 + 0.015 x 1.8 x 72000 = 3744 s (stay), one up 6 h 720 + 1080 + 0.015 x 1.16 x 72000 =
    3052.8 s (switch)."""
    from airflow_spot.policy.deadline import spot_reserve_per_work

    p = DeadlineParams(restart_overhead_seconds=R, spot_reserve_per_work=0.015, spot_reserve_age_seconds=3600.0)
    assert spot_reserve_per_work(p, 2700.0) == pytest.approx(0.03)
    assert spot_reserve_per_work(p, 6 * H) == pytest.approx(0.015 * 1.16)
    assert spot_reserve_per_work(p, None) == 0.015
    assert spot_reserve_per_work(DeadlineParams(spot_reserve_per_work=0.05), 6 * H) == 0.05  # off: flat
    params = DecisionParams(deadline=p)
    deadline_h = (36000 + 72000 + 3400) / H
    for age, market in ((1 * H, Market.ON_DEMAND.value), (6 * H, Market.SPOT.value)):
        ev = [PoolEvent(A.pool, "probe-up", 10 * H - age), PoolEvent(A.pool, "probe-up", 10 * H - 30)]
        d = decide_attempt(job(10 * H, ev, work_done=10 * H, work_h=30.0, deadline_h=deadline_h,
                               running="on-demand"), params=params)
        assert d.market == market, (age, d.reason)
    with pytest.raises(ValueError, match="spot_reserve_age_seconds"):
        DeadlineParams(spot_reserve_age_seconds=0.0)


def test_the_job_s_own_preemption_rate_counts_its_instances_time_and_losses_only():
    """A ran 0-2 h and was preempted (2 h, 1 loss); B ran 2-3 h and left unharmed (refused later: 1 h);
    C runs since 5 h, seen running at 6 h (1 h); another job's preemption does not count. Prior 0.1/h
    worth 10 h: (0.1 x 10 + 1) / (10 + 4) per hour."""
    from airflow_spot.policy.observations import own_pool_losses, own_preemption_rate

    ev = [PoolEvent(A.pool, "launched", 0.0), PoolEvent(A.pool, "preempted", 2 * H),
          PoolEvent(B.pool, "launched", 2 * H), PoolEvent(B.pool, "running", 3 * H),
          PoolEvent(B.pool, "refused", 5 * H), PoolEvent(C.pool, "launched", 5 * H),
          PoolEvent(C.pool, "running", 6 * H),
          PoolEvent(B.pool, "launched", 0.0, job="other"), PoolEvent(B.pool, "preempted", 0.5 * H, job="other")]
    assert own_preemption_rate(ev, 6 * H, 0.1, 10.0) == pytest.approx(2.0 / 14.0)
    assert own_preemption_rate([], 6 * H, 0.1, 10.0) == pytest.approx(0.1)
    assert own_preemption_rate(ev, 1 * H, 0.1, 10.0) == pytest.approx(1.0 / 10.0)  # the future is not read
    # two instances in one pool, 0-1 h (unharmed) and 5-6 h (preempted): 2 h, not the 6 h between
    again = [PoolEvent(A.pool, "launched", 0.0), PoolEvent(A.pool, "running", 1 * H),
             PoolEvent(A.pool, "launched", 5 * H), PoolEvent(A.pool, "preempted", 6 * H)]
    assert own_preemption_rate(again, 6 * H, 0.1, 10.0) == pytest.approx(2.0 / 12.0)
    # the same per pool, which the move rule reads
    assert own_pool_losses(ev, 6 * H) == {A.pool: (1, 2 * H), B.pool: (0, 1 * H), C.pool: (0, 1 * H)}


def test_leaving_on_demand_keeps_more_slack_when_the_job_s_own_instances_were_preempted_often():
    """On on-demand, 20 h of work left, 4500 s of slack, a pool up 1 h; restart 720 s, floor 1080 s,
    reserve 0.03 per second of work left (2160 s at the market's 0.25/h). Four preemptions in 4 h of the
    job's own spot time: rate (0.25 x 20 + 4) / 24 = 0.375/h, the reserve x 1.5 = 3240 s, so the switch
    needs 5040 s: stay. The same history from another job of the deployment does not scale it."""
    now, work = 10 * H, 20 * H
    deadline_h = (now + work + 4500) / H
    probes = [PoolEvent(A.pool, "probe-up", now - H), PoolEvent(A.pool, "probe-up", now - 30)]
    mine = []
    for i, pool in enumerate((A.pool, B.pool, C.pool, B.pool)):
        mine += [PoolEvent(pool, "launched", i * H), PoolEvent(pool, "preempted", (i + 1) * H)]
    theirs = [PoolEvent(e.pool, e.kind, e.at, job="other") for e in mine]
    base = dict(work_done=now, work_h=30.0, deadline_h=deadline_h, running="on-demand")
    d = decide_attempt(job(now, mine + probes, **base), params=PARAMS)
    assert d.market == Market.ON_DEMAND.value and d.preemption_rate_per_hour == pytest.approx(0.375)
    d = decide_attempt(job(now, theirs + probes, **base), params=PARAMS)
    assert d.market == Market.SPOT.value and d.preemption_rate_per_hour == pytest.approx(0.25)
    no_scaling = DecisionParams(deadline=DeadlineParams(restart_overhead_seconds=R), rate_prior_hours=None)
    d = decide_attempt(job(now, mine + probes, **base), params=no_scaling)
    assert d.market == Market.SPOT.value and d.preemption_rate_per_hour is None
    with pytest.raises(ValueError, match="rate_prior_hours"):
        DecisionParams(rate_prior_hours=0.0)


def test_a_job_without_slack_for_the_reserve_still_takes_one_more_spot_run_on_a_settled_pool():
    """On on-demand, 20 h of work left, 2160 s of slack: the reserve (0.03 x 72000 = 2160 s) cannot be
    kept, but the slack pays the switch's restart (720 s) and the floor (1080 s). With
    ``last_shot_up_seconds`` 2 h a pool up 3 h is worth one more spot run; one up 1 h is not, nor is any
    pool when the slack is below restart + floor. After that run's preemption the slack left (1440 s) no
    longer pays a restart above the floor: on-demand, not another spot start."""
    p = DeadlineParams(restart_overhead_seconds=R, last_shot_up_seconds=2 * H)

    def obs(slack_s, age, running="on-demand"):
        return Observation(started_at=0.0, deadline_at=10 * H + 20 * H + slack_s, work_done=10 * H,
                           work_total=30 * H, spot_available=True, running=running, spot_up_seconds=age)

    assert slack_budget(DeadlineState(), obs(2160, 3 * H), 10 * H, p).market == Market.SPOT.value
    assert slack_budget(DeadlineState(), obs(2160, 1 * H), 10 * H, p).market == Market.ON_DEMAND.value
    assert slack_budget(DeadlineState(), obs(1700, 3 * H), 10 * H, p).market == Market.ON_DEMAND.value
    off = DeadlineParams(restart_overhead_seconds=R)
    assert slack_budget(DeadlineState(), obs(2160, 3 * H), 10 * H, off).market == Market.ON_DEMAND.value
    after = slack_budget(DeadlineState(), obs(2160 - 720, 0.0, running=None), 10 * H, p)
    assert after.market == Market.ON_DEMAND.value, after.reason
    with pytest.raises(ValueError, match="last_shot_up_seconds"):
        DeadlineParams(last_shot_up_seconds=-1.0)


# ---------------------------------------------------------------- moving a running job to a cheaper pool


def worth(d):
    """The pools a move is worth to: the targets seen settled and those due a probe to settle first."""
    return [o.pool for o in d.move_to + d.settle_probe]


def running_on_a(now, *events, **kw):
    return job(now, [PoolEvent(A.pool, "launched", 0.0), *events], running="spot", running_pool=A.pool, **kw)


def test_a_running_spot_job_moves_to_a_pool_whose_saving_pays_the_move_twice():
    # B is 30 % cheaper: over the target's expected lifetime (1 / 0.25 per h = 4 h) the saving is
    # 0.3 x (1 + 0.25 x 600 s / 1 h) x 4 h = 1.25 $, against a move of 0.2 h at 0.7 $/h = 0.14 $ (x2)
    cheap = spot("us-west-2b", price=0.7)
    d = decide_attempt(running_on_a(2 * H, offers=(A, cheap, C, ON_DEMAND), deadline_h=None), params=PARAMS)
    assert d.market == Market.SPOT.value and worth(d) == [cheap.pool]
    # equal prices never move a job, however much younger its own pool is than another
    d = decide_attempt(running_on_a(2 * H, PoolEvent(B.pool, "probe-up", 0.0), deadline_h=None), params=PARAMS)
    assert worth(d) == []
    # nor does a job with a few minutes of work left: the saving cannot pay the restart
    d = decide_attempt(running_on_a(2 * H, offers=(A, cheap, C, ON_DEMAND), deadline_h=None,
                                    work_done=48 * H - 300.0), params=PARAMS)
    assert worth(d) == []


def test_a_pool_that_came_back_a_moment_ago_is_not_worth_a_move_a_settled_one_is():
    # 10 % cheaper: worth it only over most of the prior lifetime (0.1 x 1.042 x 3.6 h >= 2 x 0.2 h x 0.9)
    cheap = spot("us-west-2b", price=0.9)
    offers = (A, cheap, C, ON_DEMAND)
    settled = running_on_a(6 * H, PoolEvent(cheap.pool, "probe-up", 1 * H), offers=offers, deadline_h=None)
    assert worth(decide_attempt(settled, params=PARAMS)) == [cheap.pool]
    fresh = running_on_a(6 * H, PoolEvent(cheap.pool, "probe-up", 6 * H - 60.0), offers=offers, deadline_h=None)
    assert worth(decide_attempt(fresh, params=PARAMS)) == []
    # refused a moment ago: believed down, not a target
    down = running_on_a(6 * H, PoolEvent(cheap.pool, "refused", 6 * H - 10.0), offers=offers, deadline_h=None)
    assert worth(decide_attempt(down, params=PARAMS)) == []


def test_a_move_needs_slack_for_its_restart_and_a_checkpoint_transfer_is_priced():
    cheap = spot("us-west-2b", price=0.7)
    offers = (A, cheap, C, ON_DEMAND)
    assert worth(decide_attempt(running_on_a(1 * H, offers=offers, work_done=1 * H), params=PARAMS))
    # 2.1 h in, nothing done: the slack pays the move's restart (it did until 2.2 h) but not a second one
    # should the target go soon, on top of the floor and the reserve: no move (the last one is at 1.99 h)
    assert worth(decide_attempt(running_on_a(1.9 * H, offers=offers), params=PARAMS))
    assert worth(decide_attempt(running_on_a(2.1 * H, offers=offers), params=PARAMS)) == []
    # 3.4 h in, nothing done: 0.6 h of slack cannot pay a restart, the floor and the reserve
    late = decide_attempt(running_on_a(3.4 * H, offers=offers), params=PARAMS)
    assert late.market == Market.SPOT.value and worth(late) == []
    # the same pool in another region, with 2 $ of egress per move: no longer worth it
    far = spot("eu-west-1a", price=0.7)
    params = DecisionParams(deadline=PARAMS.deadline, transfer_dollars=2.0, home_region="us-west-2")
    d = decide_attempt(running_on_a(1 * H, offers=(A, far, ON_DEMAND), work_done=1 * H), params=params)
    assert worth(d) == []
    # and never from on-demand: leaving it is the deadline rule's decision
    od = job(1 * H, offers=offers, running="on-demand")
    assert worth(decide_attempt(od, params=PARAMS)) == []


def test_a_job_writing_its_saves_back_across_regions_moves_to_the_stores_region():
    # one price everywhere; the store is in eu-west-1, where pool E is. Running in the west costs $1 an
    # hour more (its saves written back): the saving, $1/h over E's expected 4 h, pays the move twice over
    home = spot("eu-west-1a", price=1.0)
    offers = (A, home, ON_DEMAND)
    store = DecisionParams(deadline=PARAMS.deadline, home_region="eu-west-1")
    assert worth(decide_attempt(running_on_a(1 * H, offers=offers, work_done=1 * H), params=store)) == []
    saves = replace(store, remote_dollars_per_hour=1.0)
    d = decide_attempt(running_on_a(1 * H, offers=offers, work_done=1 * H), params=saves)
    assert worth(d) == [home.pool]
    # and a job starting anew takes the store's region first
    assert decide_attempt(job(0.0, offers=offers), params=saves).ranked[0] == home
    with pytest.raises(ValueError, match="remote_dollars_per_hour must be >= 0"):
        replace(saves, remote_dollars_per_hour=-1.0)


def test_a_region_whose_pools_keep_preempting_the_job_is_not_worth_a_move_into_until_that_passes():
    """Target T (us-east-1a) is 30 % cheaper than A, where the job runs: over the prior lifetime (4 h)
    the saving pays the move twice over (see above). But the job's own instances in us-east-1b, the same
    region, were preempted six times in its first hour, 5 min each. Each loss and its seconds weigh
    exp(-age / 8 h) (two prior lifetimes): at 1.5 h about 5.3 losses and 22 min; with the market's rate as a
    prior worth one preemption the region's lifetime is about (4 h + 22 min) / 6.3 = 0.69 h, and
    0.3125 $/h x 0.69 h < 2 x 0.2 h x 0.7 $/h."""
    target, lossy, far = spot("us-east-1a", price=0.7), spot("us-east-1b"), spot("eu-west-1a")
    offers = (A, target, lossy, far, ON_DEMAND)

    def moves_after_losses_in(pool, now, n=6, lived=300.0):
        events = []
        for i in range(n):
            events += [PoolEvent(pool.pool, "launched", i * 600.0), PoolEvent(pool.pool, "preempted", i * 600.0 + lived)]
        events.append(PoolEvent(A.pool, "launched", max(1 * H, (n - 1) * 600.0 + lived)))
        obs = job(now, events, offers=offers, deadline_h=None, running="spot", running_pool=A.pool)
        return worth(decide_attempt(obs, params=PARAMS))

    assert moves_after_losses_in(lossy, 1.5 * H, n=0) == [target.pool]
    assert moves_after_losses_in(lossy, 1.5 * H) == []
    # the same losses in another region say nothing about us-east-1
    assert moves_after_losses_in(far, 1.5 * H) == [target.pool]
    # a day later they weigh about 0.04 each: the region is worth a move again
    assert moves_after_losses_in(lossy, 25.5 * H) == [target.pool]
    # one preemption after a 3 h run is no sign of flapping: (4 h + 2.8 h) / 1.94 = 3.5 h, worth the move
    assert moves_after_losses_in(lossy, 3.5 * H, n=1, lived=3 * H) == [target.pool]


def test_a_job_whose_own_instances_lasted_expects_the_same_of_a_region_it_has_not_tried():
    """T (us-east-1a) is 7 % cheaper: the saving, 0.0729 $/h, pays the move twice (0.372 $) over 5.1 h.
    The market's prior lifetime is 4 h, worth 5 losses in 20 h: a job an hour in expects (20 + 1) / 5 =
    4.2 h of T, not worth it. A job whose instance has run 10 h without a loss expects (20 + 10) / 5 = 6 h;
    one preempted twice in its first hour, 9.9 h of instances in all, (20 + 9.9) / 7 = 4.3 h."""
    target = spot("us-east-1a", price=0.93)

    def moves(now_h, events=()):
        obs = job(now_h * H, [*events, PoolEvent(A.pool, "launched", (now_h - 9.0 if events else 0.0) * H)],
                  offers=(A, target, C, ON_DEMAND), deadline_h=None, running="spot", running_pool=A.pool,
                  work_done=(now_h - 0.2) * H)
        return worth(decide_attempt(obs, params=PARAMS))

    assert moves(1.0) == []
    assert moves(10.0) == [target.pool]
    # the losses were in us-west-2c, not T's region: only the job's rate, not T's region's record, moves
    lossy = [PoolEvent(C.pool, "launched", 0.0), PoolEvent(C.pool, "preempted", 0.5 * H),
             PoolEvent(C.pool, "launched", 0.6 * H), PoolEvent(C.pool, "preempted", 1.0 * H)]
    assert moves(10.0, lossy) == []


def test_a_move_waits_until_its_target_has_been_seen_up_as_long_as_leaving_on_demand_asks():
    """B is 30 % cheaper, worth a move (above). A pool the job has not seen up is named for a probe
    (``settle_probe``), not moved to; once probes have seen it up ``min_spot_up_seconds`` (45 min) without
    a loss the job moves. Between probes (one each ``probe_every_seconds``, 15 min) nothing is asked.
    A pool that went down between two probes starts again: the mechanism of the futile round trips at the
    catalog's prices (results_simulate.md, "The default replay")."""
    cheap = spot("us-west-2b", price=0.7)

    def decide(*events):
        return decide_attempt(running_on_a(10 * H, *events, offers=(A, cheap, ON_DEMAND), deadline_h=None,
                                           work_done=9 * H), params=PARAMS)

    d = decide()
    assert [o.pool for o in d.settle_probe] == [cheap.pool] and d.move_to == ()
    probed = lambda minutes_ago: PoolEvent(cheap.pool, "probe-up", 10 * H - minutes_ago * 60.0)  # noqa: E731
    d = decide(probed(10))  # seen up 10 min ago: the next probe is due at 15 min
    assert d.move_to == () and d.settle_probe == ()
    d = decide(probed(30), probed(15))  # up 30 min: one more probe
    assert d.move_to == () and [o.pool for o in d.settle_probe] == [cheap.pool]
    d = decide(probed(45), probed(30), probed(15), probed(0))
    assert [o.pool for o in d.move_to] == [cheap.pool] and d.settle_probe == ()
    # down between two probes: seen up again only 15 min
    d = decide(probed(60), PoolEvent(cheap.pool, "probe-down", 10 * H - 30 * 60.0), probed(15))
    assert d.move_to == () and [o.pool for o in d.settle_probe] == [cheap.pool]


def test_move_margin_none_never_moves_and_a_bad_margin_is_refused():
    cheap = spot("us-west-2b", price=0.5)
    params = DecisionParams(deadline=PARAMS.deadline, move_margin=None)
    assert decide_attempt(running_on_a(2 * H, offers=(A, cheap, ON_DEMAND), deadline_h=None), params=params).move_to == ()
    with pytest.raises(ValueError, match="move_margin"):
        DecisionParams(move_margin=0.0)


def test_a_spot_offer_dearer_than_on_demand_per_unit_of_work_is_no_spot_opportunity():
    """Spot at $3.5/h against $3/h on demand, or $1/h spot whose saves written back to a store in another
    region cost $2.5/h more: neither is taken. With no cheaper spot offered the job runs on demand, with
    a deadline or without; a cheaper pool that is down is waited for as any outage. A cheap pool next to
    them is taken as before."""
    dear = spot("us-west-2a", price=3.5)
    for deadline_h in (52.0, None):
        d = decide_attempt(job(0.0, offers=(dear, ON_DEMAND), deadline_h=deadline_h), params=PARAMS)
        assert d.market == Market.ON_DEMAND.value and [o.pool for o in d.ranked] == [ON_DEMAND.pool]
        assert d.reason == "no spot offer costs less than on-demand of its type"
    home = spot("eu-west-1a", price=1.0)
    home_on_demand = replace(ON_DEMAND, region="eu-west-1", zone="eu-west-1")  # no saves written back from it
    saves = replace(PARAMS, home_region="eu-west-1", remote_dollars_per_hour=2.5)
    d = decide_attempt(job(0.0, offers=(A, home_on_demand)), params=saves)
    assert d.market == Market.ON_DEMAND.value and list(d.ranked) == [home_on_demand]
    d = decide_attempt(job(0.0, offers=(A, home, home_on_demand)), params=saves)
    assert d.market == Market.SPOT.value and d.ranked[0] == home and A not in d.ranked
    # the store's region refused a moment ago: an outage of the only cheap pool, waited out with slack
    d = decide_attempt(job(0.0, [PoolEvent(home.pool, "refused", 0.0)], offers=(A, home, home_on_demand)),
                       params=saves)
    assert d.market == WAIT and A not in d.ranked
    # a pool of another type dearer per unit of work by the catalog's throughput estimate stays: only
    # prices of one type are compared, no estimate decides
    other = Offer("g5.xlarge", "us-west-2", "us-west-2b", Market.SPOT, 0.9, 1.0, "A10G", 1, 24.0,
                  relative_throughput=0.25, preemption_rate_per_hour=0.25)
    d = decide_attempt(job(0.0, offers=(other, ON_DEMAND), deadline_h=None), params=PARAMS)
    assert d.market == Market.SPOT.value and list(d.ranked) == [other]
    # at $2/h more the west pool is still cheaper than on demand: taken when the store's region is down
    cheaper = replace(saves, remote_dollars_per_hour=1.5)
    d = decide_attempt(job(0.0, [PoolEvent(home.pool, "refused", 0.0)], offers=(A, home, home_on_demand)),
                       params=cheaper)
    assert d.market == Market.SPOT.value and d.ranked[0] == A


def test_a_job_whose_running_pool_became_dearer_than_on_demand_leaves_it():
    """A's price rose to $3.2/h, above on-demand's $3: the job leaves A for the cheaper pool B (the
    operator does not reuse the warm instance, the replay lets it go); with every cheaper pool down it
    decides as an idle job would (wait with slack, else on-demand), never stays on A."""
    dear_a = spot("us-west-2a", price=3.2)
    cheap_b = spot("us-west-2b", price=1.0)
    d = decide_attempt(running_on_a(2 * H, offers=(dear_a, cheap_b, ON_DEMAND)), params=PARAMS)
    assert d.leave_running and d.market == Market.SPOT.value and d.ranked[0] == cheap_b
    assert dear_a not in d.ranked and "leaving p3.2xlarge@us-west-2a" in d.reason
    down = running_on_a(2 * H, PoolEvent(cheap_b.pool, "refused", 2 * H), offers=(dear_a, cheap_b, ON_DEMAND))
    d = decide_attempt(down, params=PARAMS)
    assert d.leave_running and d.market in (WAIT, Market.ON_DEMAND.value)
    # at its old price it stays, as before
    assert not decide_attempt(running_on_a(2 * H, offers=(A, cheap_b, ON_DEMAND)), params=PARAMS).leave_running
