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


def test_default_is_slack_reserve():
    params = DeadlineParams(restart_overhead_seconds=0.2 * H, reserve_per_work=0.1)
    o = obs(9, spot=False)
    assert decide(DeadlineState(), o, 10 * H, params) == decide(DeadlineState(), o, 10 * H, params, "slack-reserve")


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
    assert decide(DeadlineState(), ok, now, params).market == WAIT
    d = decide(DeadlineState(), obs(48 - 22 + 0.4, spot=True), now, params)
    assert d.market == "on-demand" and d.state.committed
