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
