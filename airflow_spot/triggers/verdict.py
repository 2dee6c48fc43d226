"""What one poll of an attempt saw (:class:`Observation`) and what it means (:func:`classify`).

Pure decisions, no I/O: :class:`~airflow_spot.triggers.segment.SegmentTrigger` gathers an ``Observation``
each round (:mod:`airflow_spot.triggers.observing`) and ends the wait on the first verdict ``classify``
returns. Kept apart so the rules about statuses, absences, silences and stalls read (and are tested) on
their own; both names are re-exported from :mod:`airflow_spot.triggers.segment`.
"""
from __future__ import annotations

from dataclasses import dataclass

from airflow_spot.backends.base import InstanceInfo, InstanceState, TerminationReason
from airflow_spot.storage.protocol import AttemptStatus, Heartbeat, Outcome


@dataclass
class Observation:
    """What one poll saw. ``now`` is wall-clock seconds (heartbeats carry wall-clock times too)."""

    now: float
    status: AttemptStatus | None
    heartbeat: Heartbeat | None
    instance: InstanceInfo | None
    instance_known: bool
    #: the describe of this round failed (throttled, network): the instance is unknown, not gone
    instance_error: str | None = None
    #: reading the status/heartbeat failed this round: they are unknown, not absent (``status`` and
    #: ``heartbeat`` then hold the last ones read), and the store has failed for ``store_failing_for`` s
    store_error: str | None = None
    store_failing_for: float = 0.0
    #: seconds the instance has been absent from every describe that answered, since the first such
    #: round of this wait (0 while the backend knows it; a failed describe neither starts nor ends it)
    instance_unknown_for: float = 0.0
    #: when this trigger first read the heartbeat as it is now, and its step, by the triggerer's clock
    #: (None: not tracked). Silence and stalls are judged by them, not by the instance's clock in ``hb.time``
    beat_seen_at: float | None = None
    step_seen_at: float | None = None


def classify(
    obs: Observation,
    *,
    requested_at: float,
    startup_timeout: float,
    heartbeat_timeout: float,
    max_attempt_seconds: float,
    stall_timeout: float | None = None,
) -> tuple[Outcome, str] | None:
    """Decide whether the attempt has ended and how; ``None`` means "keep waiting".

    The status object wins over everything else: an agent that wrote ``preempted`` after its emergency
    save and was then killed by the market is a clean preemption, not a lost instance.

    :param stall_timeout: seconds a heartbeating attempt may stay at one step (a hung collective or data
        loader keeps the heartbeat going); None: never judged. Stretched to 20 of its steps and 3 saves.
    """
    if obs.status is not None:
        try:
            outcome = Outcome(obs.status.outcome)
        except ValueError:
            # written by an agent of a newer release: the attempt has ended, but how is unknown here. A clear
            # failure, not a crash (the trigger would fail the same way on every try) nor a retry as lost
            return Outcome.FAILED, (
                f"agent reported outcome {obs.status.outcome!r} (exit code {obs.status.exit_code}), which this "
                "airflow-spot does not know: the agent is newer; upgrade airflow-spot on the workers and the "
                "triggerer")
        return outcome, f"agent reported {outcome.value} (exit code {obs.status.exit_code})"
    if obs.store_error is not None:
        # A store read error is not silence: a status may be there unseen, so neither a terminal instance
        # nor an old heartbeat decides, until the store has stayed unreadable past the heartbeat window.
        if obs.store_failing_for > heartbeat_timeout:
            return Outcome.LOST, (
                f"the job's store was unreadable for {obs.store_failing_for:.0f}s (window {heartbeat_timeout:.0f}s): "
                f"{obs.store_error}"
            )
        if obs.now - requested_at > max_attempt_seconds:
            return Outcome.LOST, f"attempt ran longer than max_attempt_seconds={max_attempt_seconds:.0f}"
        return None
    inst = obs.instance
    hb = obs.heartbeat
    # the heartbeat's age by this trigger's clock where it has watched it change (an instance whose clock is
    # ahead would look alive forever, one behind would look silent), else by the heartbeat's own time
    beat_at = None if hb is None else (hb.time if obs.beat_seen_at is None else obs.beat_seen_at)
    if obs.instance_error is not None:
        pass  # a failed describe says nothing about the instance: only the timeouts below can decide
    elif not obs.instance_known or inst is None:
        # Absent from a describe that answered is not the cloud saying the instance is gone: EC2's describe
        # lags RunInstances for a while (eventual consistency) and one answer may miss an id. The absence
        # decides only once it has lasted past the heartbeat window with no heartbeat inside that window
        # either (a fresh heartbeat means the agent runs: the silence rules below decide, as always).
        silent = hb is None or obs.now - max(beat_at, requested_at) > heartbeat_timeout
        if silent and obs.instance_unknown_for > heartbeat_timeout:
            return Outcome.LOST, (
                f"instance unknown to the backend for {obs.instance_unknown_for:.0f}s (window "
                f"{heartbeat_timeout:.0f}s) and no heartbeat in that window; the attempt has no status"
            )
    elif InstanceState(inst.state).is_terminal():
        if TerminationReason(inst.reason) is TerminationReason.PREEMPTED:
            return Outcome.PREEMPTED, "instance was reclaimed by the market before the agent wrote a status"
        reason = TerminationReason(inst.reason).value or "unknown"
        return Outcome.LOST, f"instance terminated (reason: {reason}) without a status for this attempt"
    if hb is None:
        if obs.now - requested_at > startup_timeout:
            return Outcome.LOST, (
                f"no heartbeat within {startup_timeout:.0f}s of the request (agent or command never started)"
            )
    elif obs.now - max(beat_at, requested_at) > heartbeat_timeout:
        return Outcome.LOST, (
            f"no heartbeat for {obs.now - beat_at:.0f}s (timeout {heartbeat_timeout:.0f}s) at step {hb.step}"
        )
    elif (stall_timeout is not None and obs.step_seen_at is not None and hb.notice_at is None
          and hb.first_step_at is not None):  # start-up (restore, data preparation) is not judged
        window = max(stall_timeout, 20 * (hb.step_time_ewma or 0.0) + 3 * (hb.save_cost_seconds or 0.0))
        if obs.now - obs.step_seen_at > window:
            return Outcome.LOST, (
                f"the process heartbeats but has stayed at step {hb.step} for {obs.now - obs.step_seen_at:.0f}s "
                f"(stall_timeout {window:.0f}s): a hung collective, data loader or step; the instance is let go "
                "and the next try resumes from the last checkpoint (a step that really takes this long needs a "
                "larger segment_options['stall_timeout'], or None)"
            )
    if obs.now - requested_at > max_attempt_seconds:
        return Outcome.LOST, f"attempt ran longer than max_attempt_seconds={max_attempt_seconds:.0f}"
    return None
