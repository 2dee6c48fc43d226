from __future__ import annotations

import pytest

from airflow_spot.policy.deadline import (
    WAIT, DeadlineParams, DeadlineState, Observation, choose_market, decide, planned_progress, slack,
)

H = 3600.0
P = DeadlineParams(restart_overhead_seconds=0.2 * H, safety_restarts=2.0)


def up(state, o, now, params=P):
    return decide(state, o, now, params, "uniform-progress")


def obs(done_h: float, *, spot: bool, running=None, deadline_h: float | None = 52.0, total_h: float = 48.0):
    return Observation(started_at=0.0, deadline_at=None if deadline_h is None else deadline_h * H,
                       work_done=done_h * H, work_total=total_h * H, spot_available=spot, running=running)


def test_without_deadline_spot_only_and_wait_when_none():
    assert up(DeadlineState(), obs(0, spot=True, deadline_h=None), 0.0, P).market == "spot"
    assert up(DeadlineState(), obs(0, spot=False, deadline_h=None), 10 * H, P).market == WAIT


def test_line_ends_one_restart_before_the_deadline():
    o = obs(0, spot=True)
    assert planned_progress(o, 0.0, P) == 0.0
    assert planned_progress(o, (52 - 0.2) * H, P) == pytest.approx(48 * H)
    assert planned_progress(o, 25.9 * H, P) == pytest.approx(24 * H)


def test_no_spot_waits_when_ahead_and_goes_on_demand_when_behind():
    # at 10 h the line asks for 10 * 48 / 51.8 = 9.266 h of work
    assert up(DeadlineState(), obs(9.3, spot=False), 10 * H, P).market == WAIT
    assert up(DeadlineState(), obs(9.2, spot=False), 10 * H, P).market == "on-demand"


def test_on_spot_stays_on_spot_even_behind_the_line():
    # 8.5 h done at 10 h: behind the line (9.27 h) but 2.5 h of slack left
    assert up(DeadlineState(), obs(8.5, spot=True, running="spot"), 10 * H, P).market == "spot"
    assert up(DeadlineState(), obs(8.5, spot=False), 10 * H, P).market == "on-demand"


def test_back_to_spot_only_with_hysteresis():
    line = 10 * 48 / 51.8
    hyst = P.hysteresis / H  # two restarts
    assert up(DeadlineState(), obs(line + hyst - 0.01, spot=True, running="on-demand"), 10 * H, P).market == "on-demand"
    assert up(DeadlineState(), obs(line + hyst + 0.01, spot=True, running="on-demand"), 10 * H, P).market == "spot"


def test_safety_net_switches_exactly_when_the_slack_runs_out_and_latches():
    # slack = time left - work left; the net fires at 2 restarts = 0.4 h
    now = 30 * H
    just_enough = obs(48 - (52 - 30) + 0.4 + 0.001, spot=True, running="spot")
    assert slack(just_enough, now) > 0.4 * H
    d = up(DeadlineState(), just_enough, now, P)
    assert d.market == "spot" and not d.state.committed
    out = obs(48 - (52 - 30) + 0.4, spot=True, running="spot")
    d = up(DeadlineState(), out, now, P)
    assert d.market == "on-demand" and d.state.committed
    # once committed, on-demand to the end even when spot is back and slack looks fine
    assert up(d.state, obs(40, spot=True), now, P).market == "on-demand"


def test_slack_reserve_keeps_slack_per_work_left():
    params = DeadlineParams(restart_overhead_seconds=0.2 * H, reserve_per_work=0.1, hysteresis_seconds=0.0)
    # at 10 h with 9 h done: slack = 42 - 39 = 3 h; reserve = 0.4 + 0.1 * 39 = 4.3 h -> on-demand
    assert decide(DeadlineState(), obs(9, spot=False), 10 * H, params, "slack-reserve").market == "on-demand"
    # with 12 h done at 10 h: slack = 42 - 36 = 6 h; reserve = 0.4 + 3.6 = 4.0 h -> wait for spot
    assert decide(DeadlineState(), obs(12, spot=False), 10 * H, params, "slack-reserve").market == WAIT
    # on on-demand with spot back: leave only when the spare slack reaches the hysteresis
    params2 = DeadlineParams(restart_overhead_seconds=0.2 * H, reserve_per_work=0.1, hysteresis_seconds=2.5 * H)
    assert decide(DeadlineState(), obs(12, spot=True, running="on-demand"), 10 * H, params2, "slack-reserve").market == "on-demand"
    assert decide(DeadlineState(), obs(12, spot=True, running="on-demand"), 10 * H, params, "slack-reserve").market == "spot"


def test_default_is_slack_budget():
    params = DeadlineParams(restart_overhead_seconds=0.2 * H, reserve_per_work=0.1)
    o = obs(9, spot=False)
    assert decide(DeadlineState(), o, 10 * H, params) == decide(DeadlineState(), o, 10 * H, params, "slack-budget")


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError, match="uniform-progress"):
        decide(DeadlineState(), obs(0, spot=True), 0.0, P, "nope")


def test_choose_market_from_steps():
    # no deadline: spot
    assert choose_market(now=5.0, started_at=0.0, deadline_seconds=None, done_steps=0, total_steps=10).market == "spot"
    # known step time: 100 steps of 36 s = 1 h of work, 2 h deadline -> plenty of slack -> spot
    d = choose_market(now=0.0, started_at=0.0, deadline_seconds=2 * H, done_steps=0, total_steps=100, step_seconds=36.0)
    assert d.market == "spot"
    # 1.5 h later with 10 steps done: 0.9 h of work left in 0.5 h -> on-demand
    d = choose_market(now=1.5 * H, started_at=0.0, deadline_seconds=2 * H, done_steps=10, total_steps=100, step_seconds=36.0)
    assert d.market == "on-demand"
    # unknown speed: the line alone; not waiting: ``wait`` is reported as spot for the operator
    d = choose_market(now=0.5 * H, started_at=0.0, deadline_seconds=2 * H, done_steps=90, total_steps=100,
                      spot_available=False)
    assert d.market == "spot"
    with pytest.raises(ValueError):
        choose_market(now=0.0, started_at=0.0, deadline_seconds=None, done_steps=0, total_steps=0)


def test_slack_reserve_has_the_same_safety_net():
    params = DeadlineParams(restart_overhead_seconds=0.2 * H, reserve_per_work=0.0)
    now = 30 * H
    ok = obs(48 - 22 + 0.401, spot=False)
    assert decide(DeadlineState(), ok, now, params, "slack-reserve").market == WAIT
    d = decide(DeadlineState(), obs(48 - 22 + 0.4, spot=True), now, params, "slack-reserve")
    assert d.market == "on-demand" and d.state.committed


# slack-budget: r = 0.2 h, floor 1.5 r = 0.3 h, waiting reserve 0.1 / spot reserve 0.03 per hour of work left
SB = DeadlineParams(restart_overhead_seconds=0.2 * H)


def sb(o, now, state=DeadlineState(), params=SB):
    return decide(state, o, now, params, "slack-budget")


def at_slack(slack_h: float, work_left_h: float, *, now_h: float = 20.0, **kw) -> Observation:
    """An observation at ``now_h`` whose slack and work left are exactly the given hours (deadline 52 h)."""
    total = 48.0
    done = total - work_left_h
    deadline = now_h + work_left_h + slack_h
    return Observation(started_at=0.0, deadline_at=deadline * H, work_done=done * H, work_total=total * H, **kw)


def test_slack_budget_waits_only_while_the_waiting_budget_lasts():
    # 20 h of work left: the waiting reserve is 0.3 + 0.1 * 20 = 2.3 h of slack
    assert sb(at_slack(2.31, 20, spot_available=False), 20 * H).market == WAIT
    assert sb(at_slack(2.29, 20, spot_available=False), 20 * H).market == "on-demand"


def test_slack_budget_stays_on_demand_through_an_outage():
    # plenty of slack: idle it would wait, but on on-demand it keeps running (stopping pays a second restart)
    assert sb(at_slack(3.5, 5, spot_available=False), 20 * H).market == WAIT
    assert sb(at_slack(3.5, 5, spot_available=False, running="on-demand"), 20 * H).market == "on-demand"


def test_slack_budget_leaves_on_demand_exactly_when_the_switch_is_paid_for():
    # 10 h left: a switch needs floor 0.3 + its restart 0.2 + 0.03 * 10 future restarts = 0.8 h of slack
    ok = at_slack(0.81, 10, running="on-demand", spot_up_seconds=2 * H)
    assert sb(ok, 20 * H).market == "spot"
    short = at_slack(0.79, 10, running="on-demand", spot_up_seconds=2 * H)
    assert sb(short, 20 * H).market == "on-demand"


def test_slack_budget_leaves_on_demand_only_for_a_pool_up_long_enough():
    fresh = at_slack(3.0, 10, running="on-demand", spot_up_seconds=0.74 * H)
    settled = at_slack(3.0, 10, running="on-demand", spot_up_seconds=0.76 * H)
    unknown = at_slack(3.0, 10, running="on-demand")
    assert sb(fresh, 20 * H).market == "on-demand"
    assert sb(settled, 20 * H).market == "spot"
    assert sb(unknown, 20 * H).market == "spot"  # the operators cannot tell yet: no settling wait
    # idle, a fresh pool is taken at once (nothing is running, every start pays the same restart)
    assert sb(at_slack(3.0, 10, spot_up_seconds=60.0), 20 * H).market == "spot"


def test_slack_budget_floor_keeps_a_restart_for_a_preempted_spot_instance():
    # on spot above the floor: stay, even with no waiting budget at all
    assert sb(at_slack(0.31, 10, running="spot"), 20 * H).market == "spot"
    # idle: starting spot needs floor + its own restart (0.5 h); else on-demand
    assert sb(at_slack(0.51, 10), 20 * H).market == "spot"
    assert sb(at_slack(0.49, 10), 20 * H).market == "on-demand"
    # nearly done, with waiting budget left but spot unaffordable: on-demand now, not a pointless wait
    assert sb(at_slack(0.45, 0.5), 20 * H).market == "on-demand"
    # at the floor: on-demand to the end, latched
    d = sb(at_slack(0.3, 10, running="spot"), 20 * H)
    assert d.market == "on-demand" and d.state.committed
    assert sb(at_slack(5.0, 10, running="on-demand", spot_up_seconds=5 * H), 20 * H, d.state).market == "on-demand"


def test_slack_budget_without_deadline_is_spot_only():
    o = Observation(started_at=0.0, deadline_at=None, work_done=0.0, work_total=H, spot_available=False)
    assert sb(o, 0.0).market == WAIT


def test_choose_market_passes_the_pool_age():
    # 1 h of work (100 steps of 36 s) in 3 h, on on-demand: plenty of slack, so only the pool's age decides
    kw = dict(now=0.0, started_at=0.0, deadline_seconds=3 * H, done_steps=0, total_steps=100, step_seconds=36.0,
              running="on-demand")
    assert choose_market(**kw, spot_up_seconds=600.0).market == "on-demand"
    assert choose_market(**kw, spot_up_seconds=2 * H).market == "spot"


def test_choose_market_without_the_pool_age_is_slack_reserve():
    kw = dict(now=1.5 * H, started_at=0.0, deadline_seconds=3 * H, done_steps=30, total_steps=100, step_seconds=36.0)
    # on on-demand, 0.7 h of work left in 1.5 h (slack 0.8 h, restarts of 600 s): slack-reserve's spare
    # 0.8 - 0.33 - 0.06 * 0.7 = 0.43 h clears its 0.33 h hysteresis -> spot; slack-budget can pay the
    # switch (0.8 - 0.17 - 0.25 - 0.03 * 0.7 = 0.36 h) but a pool up one minute is not settled
    od = dict(kw, running="on-demand")
    assert choose_market(**od).market == "spot"
    assert choose_market(**od, spot_up_seconds=60.0).market == "on-demand"
    assert choose_market(**od, policy="slack-budget").market == "spot"  # explicit: no age, no settling wait


def test_slack_budget_params_are_validated():
    with pytest.raises(ValueError, match="floor_restarts"):
        DeadlineParams(floor_restarts=-1.0)


def test_slack_budget_confirms_an_outage_before_starting_on_demand():
    # no waiting budget (0.6 h of slack, 10 h left): on-demand, but only once no spot has been seen for 60 s
    def o(gone):
        return at_slack(0.6, 10, spot_available=False, no_spot_seconds=gone)

    assert sb(o(30.0), 20 * H).market == WAIT
    assert sb(o(60.0), 20 * H).market == "on-demand"
    assert sb(o(None), 20 * H).market == "on-demand"  # unknown: no grace
    # the grace never spends the restart an on-demand start needs
    assert sb(at_slack(0.45, 10, spot_available=False, no_spot_seconds=0.0), 20 * H).market == "on-demand"
