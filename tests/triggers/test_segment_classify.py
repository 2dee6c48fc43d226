"""The trigger's verdict on one observation of an attempt (no clock, no I/O: the observation is given)."""
from __future__ import annotations

import pytest

from airflow_spot.backends.base import InstanceInfo, InstanceState, TerminationReason
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.protocol import AttemptStatus, Heartbeat, Outcome
from airflow_spot.triggers.segment import Observation, classify

OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.5, 1.0, "A10G", 1, 24.0)
T0 = 1_000_000.0
LIMITS = dict(requested_at=T0, startup_timeout=60.0, heartbeat_timeout=20.0, max_attempt_seconds=3600.0)


def inst(state=InstanceState.RUNNING, reason=TerminationReason.NONE):
    return InstanceInfo("i-1", state, OFFER, "file:///job", reason=reason)


def status(outcome: Outcome, code: int):
    return AttemptStatus("a", outcome.value, code, T0, T0 + 5, last_committed_step=7, error_tail="boom")


def obs(now, *, st=None, hb=None, instance=None, known=True):
    return Observation(now=now, status=st, heartbeat=hb, instance=instance, instance_known=known)


@pytest.mark.parametrize("outcome, code", [(Outcome.COMPLETED, 0), (Outcome.PREEMPTED, 75), (Outcome.FAILED, 1)])
def test_status_object_decides_even_when_the_instance_is_gone(outcome, code):
    gone = inst(InstanceState.TERMINATED, TerminationReason.PREEMPTED)
    assert classify(obs(T0 + 6, st=status(outcome, code), instance=gone), **LIMITS)[0] is outcome


def test_running_with_fresh_heartbeat_keeps_waiting():
    hb = Heartbeat("a", step=3, time=T0 + 50)
    assert classify(obs(T0 + 60, hb=hb, instance=inst()), **LIMITS) is None


def test_reclaimed_without_status_is_a_preemption():
    gone = inst(InstanceState.TERMINATED, TerminationReason.PREEMPTED)
    assert classify(obs(T0 + 10, instance=gone), **LIMITS)[0] is Outcome.PREEMPTED


@pytest.mark.parametrize("reason", [TerminationReason.USER, TerminationReason.IDLE, TerminationReason.FAILED])
def test_terminated_for_another_reason_without_status_is_lost(reason):
    verdict = classify(obs(T0 + 10, instance=inst(InstanceState.TERMINATED, reason)), **LIMITS)
    assert verdict[0] is Outcome.LOST and reason.value in verdict[1]


def test_unknown_instance_is_lost_only_after_the_heartbeat_window_without_heartbeats():
    def unknown(now, unknown_for, hb=None):
        return Observation(now=now, status=None, heartbeat=hb, instance=None, instance_known=False,
                           instance_unknown_for=unknown_for)

    # one describe that missed the id (EC2's eventual consistency right after RunInstances): keep waiting
    assert classify(unknown(T0 + 1, 0.0), **LIMITS) is None
    assert classify(unknown(T0 + 19, 19.0), **LIMITS) is None
    # absent past the window (20 s) and no heartbeat: lost, before the 60 s startup window
    verdict = classify(unknown(T0 + 21, 21.0), **LIMITS)
    assert verdict[0] is Outcome.LOST and "unknown to the backend for 21s (window 20s)" in verdict[1]
    # absent as long, but the agent heartbeats: it runs, so keep waiting ...
    assert classify(unknown(T0 + 40, 40.0, Heartbeat("a", step=5, time=T0 + 35)), **LIMITS) is None
    # ... until the heartbeats stop past the window
    verdict = classify(unknown(T0 + 60, 60.0, Heartbeat("a", step=5, time=T0 + 35)), **LIMITS)
    assert verdict[0] is Outcome.LOST


def test_startup_timeout_without_any_heartbeat():
    assert classify(obs(T0 + 59, instance=inst()), **LIMITS) is None
    verdict = classify(obs(T0 + 61, instance=inst()), **LIMITS)
    assert verdict[0] is Outcome.LOST and "no heartbeat within 60s" in verdict[1]


def test_silent_heartbeat_is_lost():
    hb = Heartbeat("a", step=12, time=T0 + 100)
    assert classify(obs(T0 + 119, hb=hb, instance=inst()), **LIMITS) is None
    verdict = classify(obs(T0 + 121, hb=hb, instance=inst()), **LIMITS)
    assert verdict[0] is Outcome.LOST and "step 12" in verdict[1]


def test_hard_bound_on_the_attempt():
    hb = Heartbeat("a", step=1, time=T0 + 3600)
    assert classify(obs(T0 + 3601, hb=hb, instance=inst()), **LIMITS)[0] is Outcome.LOST


def test_silence_is_judged_by_the_triggers_clock_not_the_instances():
    """A heartbeat's age is when this trigger first read it, not its own time: an instance clock an hour
    ahead would hide a dead agent for an hour, one 400 s behind would call a healthy attempt lost."""
    ahead = Heartbeat("a", step=50, time=T0 + 100 + 3600)  # read at T0 + 100, then nothing new
    hung = Observation(now=T0 + 130, status=None, heartbeat=ahead, instance=inst(), instance_known=True,
                       beat_seen_at=T0 + 100)
    assert classify(hung, **LIMITS)[0] is Outcome.LOST  # 30 s of silence > the 20 s window
    behind = Heartbeat("a", step=500, time=T0 + 1000 - 400)  # written a second ago by a clock 400 s slow
    fresh = Observation(now=T0 + 1000, status=None, heartbeat=behind, instance=inst(), instance_known=True,
                        beat_seen_at=T0 + 999)
    assert classify(fresh, **LIMITS) is None


def test_a_heartbeating_attempt_stuck_at_one_step_is_lost_after_the_stall_timeout():
    """A hung collective or data loader keeps the heartbeat thread going; the step does not move."""
    beat = Heartbeat("a", step=40, time=T0 + 500, step_time_ewma=2.0, save_cost_seconds=10.0, first_step_at=T0 + 9)

    def at(now, step_seen_at, hb=beat, stall=100.0):
        o = Observation(now=now, status=None, heartbeat=hb, instance=inst(), instance_known=True,
                        beat_seen_at=now - 1, step_seen_at=step_seen_at)
        return classify(o, **LIMITS, stall_timeout=stall)

    assert at(T0 + 500, T0 + 401) is None  # 99 s at step 40
    verdict = at(T0 + 500, T0 + 399)
    assert verdict[0] is Outcome.LOST and "stayed at step 40 for 101s" in verdict[1] and "stall_timeout" in verdict[1]
    assert at(T0 + 500, T0 + 399, stall=None) is None  # turned off
    slow = Heartbeat("a", step=40, time=T0 + 500, step_time_ewma=30.0, first_step_at=T0 + 9)  # 20 steps: 600 s
    assert at(T0 + 500, T0 + 399, hb=slow) is None
    noticed = Heartbeat("a", step=40, time=T0 + 500, notice_at=T0 + 450, first_step_at=T0 + 9)  # the status decides
    assert at(T0 + 500, T0 + 399, hb=noticed) is None
    starting = Heartbeat("a", step=40, time=T0 + 500)  # no step yet: restoring, preparing data; not judged
    assert at(T0 + 500, T0 + 399, hb=starting) is None
