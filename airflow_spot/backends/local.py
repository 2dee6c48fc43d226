"""The ``local`` backend, the embedded default: an instance is a process group on this machine.

``launch`` starts ``python -m airflow_spot.training.agent`` as the leader of a new session (the instance: the
agent's process group and the groups of the training commands it runs; ``local_state.kill_group`` reaches
them all) and, when the preemption injector plans
a preemption for it, a supervisor process outside that group (see :mod:`airflow_spot.backends.preemption`).
All state lives in a directory shared by every process (see :mod:`airflow_spot.backends.local_state`), so
the operator, a trigger in another process and ``airflow-spot reap`` see the same instances.

Termination reasons reported by ``describe``: ``preempted`` (the injector killed it), ``user`` (we
terminated it), ``idle`` (the agent exited after its idle timeout), ``failed`` (anything else: the agent
crashed or was killed by someone else). When the agent is found dead, whatever is left of its process
group is killed, so no training process outlives its instance.

Example::

    backend = get_backend("local", preemption={"mode": "schedule", "after_seconds": [6, 9, 7]},
                          notice_window_seconds=5)
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from airflow_spot.backends.base import (
    Backend,
    InstanceInfo,
    InstanceState,
    LaunchError,
    TAG_JOB_URI,
    LaunchSpec,
    TerminationReason,
)
from airflow_spot.backends.bootstrap import agent_argv
from airflow_spot.backends.local_state import (
    InstanceRecord,
    LocalState,
    ProcessRef,
    default_state_dir,
    group_alive,
    kill_group,
    read_json,
)
from airflow_spot.backends.preemption import (
    PreemptionConfig,
    preemption_delay,
    spawn_supervisor_command,
    spot_capacity_available,
)

log = logging.getLogger(__name__)


#: agents and supervisors started by this process that have not exited yet
_CHILDREN: list[subprocess.Popen] = []
_CHILDREN_LOCK = threading.Lock()


def _adopt(proc: subprocess.Popen) -> None:
    with _CHILDREN_LOCK:
        _CHILDREN.append(proc)


def _reap_children() -> None:
    """Collect the exit status of children that have ended, so they do not linger as zombies while
    this process lives. Polled on every backend call rather than waited on in a thread: a process that
    launched instances must stay thread-free for callers that fork (and once it exits, its children are
    re-parented and no longer ours)."""
    with _CHILDREN_LOCK:
        _CHILDREN[:] = [p for p in _CHILDREN if p.poll() is None]


def _number(name: str, value, *, minimum: float = 0.0, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"local backend: {name} must be a number of seconds, got {value!r}")
    if value < minimum or (positive and value <= 0):
        raise ValueError(f"local backend: {name} must be {'> 0' if positive else f'>= {minimum}'}, got {value!r}")
    return float(value)


class LocalBackend(Backend):
    """Instances as local process groups running the agent.

    :param state_dir: shared state directory (default ``$AIRFLOW_SPOT_LOCAL_DIR`` or ``~/.airflow-spot/local``).
    :param preemption: preemption injector config, e.g. ``{"mode": "rate", "mtbf_seconds": 30, "seed": 1}``
        (see :mod:`airflow_spot.backends.preemption`); default: no preemptions.
    :param notice_window_seconds: time between a preemption notice and the kill.
    :param boot_seconds: simulated boot time: the instance is ``pending`` and serves no request before it.
    :param terminate_grace_seconds: how long ``terminate`` waits after SIGTERM before SIGKILL (the training
        command uses it for an emergency checkpoint).
    :param poll_interval_seconds: how often the agent looks for new requests.
    :param python: interpreter that runs the agent (default: this one).
    """

    name = "local"
    notice_source = "file"

    @classmethod
    def command_problem(cls, command: list[str]) -> str | None:
        # Instances are processes of this machine: a missing program is knowable before any launch.
        if command and "{{" not in command[0] and shutil.which(command[0]) is None:
            return (f"command {command[0]!r} was not found on PATH of this machine; "
                    "give the full path of the program or install it")
        return None

    #: the numeric options and what ``__init__`` requires of them
    _NUMBERS = {"notice_window_seconds": {}, "boot_seconds": {}, "terminate_grace_seconds": {},
                "poll_interval_seconds": {"positive": True}}

    @classmethod
    def options_problem(cls, options: dict) -> str | None:
        # the checks __init__ makes of the values, without creating the state directory
        try:
            PreemptionConfig.from_kwargs(options.get("preemption"))
            for name, rule in cls._NUMBERS.items():
                if name in options:
                    _number(name, options[name], **rule)
        except (ValueError, TypeError) as exc:
            return str(exc)
        return None

    def __init__(
        self,
        state_dir: str | None = None,
        preemption: dict | None = None,
        notice_window_seconds: float = 5.0,
        boot_seconds: float = 0.0,
        terminate_grace_seconds: float = 10.0,
        poll_interval_seconds: float = 0.2,
        python: str | None = None,
    ) -> None:
        self.state = LocalState(state_dir or default_state_dir())
        self.preemption = PreemptionConfig.from_kwargs(preemption)
        given = {"notice_window_seconds": notice_window_seconds, "boot_seconds": boot_seconds,
                 "terminate_grace_seconds": terminate_grace_seconds, "poll_interval_seconds": poll_interval_seconds}
        numbers = {name: _number(name, given[name], **rule) for name, rule in self._NUMBERS.items()}
        self.notice_window_seconds = numbers["notice_window_seconds"]
        self.boot_seconds = numbers["boot_seconds"]
        self.terminate_grace_seconds = numbers["terminate_grace_seconds"]
        self.poll_interval_seconds = numbers["poll_interval_seconds"]
        self.python = python or sys.executable
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"local backend: python={self.python!r} is not an executable interpreter")

    def serialize(self) -> dict:
        return {
            "state_dir": str(self.state.root),
            "preemption": self.preemption.to_kwargs(),
            "notice_window_seconds": self.notice_window_seconds,
            "boot_seconds": self.boot_seconds,
            "terminate_grace_seconds": self.terminate_grace_seconds,
            "poll_interval_seconds": self.poll_interval_seconds,
            "python": self.python,
        }

    # ------------------------------------------------------------------ launch
    def launch(self, spec: LaunchSpec) -> InstanceInfo:
        _reap_children()
        if not spec.idempotency_token:
            raise LaunchError("local backend: LaunchSpec.idempotency_token must not be empty", capacity=False)
        if not spec.job_uri:
            raise LaunchError("local backend: LaunchSpec.job_uri must not be empty", capacity=False)
        if not spec.idle_timeout_seconds or spec.idle_timeout_seconds <= 0:
            raise LaunchError(
                f"local backend: idle_timeout_seconds must be > 0, got {spec.idle_timeout_seconds!r}", capacity=False
            )
        with self.state.launch_lock():
            known = self.state.token_instance(spec.idempotency_token)
            if known is not None:
                record = self.state.read(known)
                if record is not None:
                    info = self._refresh(record).info
                    if not InstanceState(info.state).is_terminal():
                        log.info("launch token %s already launched %s", spec.idempotency_token, known)
                        return info
                    # it ended: a fresh one, as EC2's backend does (a run made again with the same run_id
                    # repeats its tokens, and an ended instance serves no attempt)
                    log.info("launch token %s launched %s, which has ended: launching anew", spec.idempotency_token,
                             known)
            now = time.time()
            if spec.offer.is_spot and self.preemption.capacity:
                since = now + self.boot_seconds - self.state.job_clock(spec.job_uri, now)
                if not spot_capacity_available(self.preemption, since):
                    raise LaunchError(
                        f"no spot capacity for {spec.offer.pool} now (the replayed trace is down)",
                        capacity=True, tried=[spec.offer.pool],
                    )
            record = self._start(spec, now)
            self.state.remember_token(spec.idempotency_token, record.info.instance_id)
        log.info("launched %s (pid %d, launch %d of job %s%s)", record.info.instance_id, record.agent.pid,
                 record.launch_index, spec.job_uri,
                 f", preemption notice in {record.preempt_at - time.time():.1f} s" if record.preempt_at else "")
        return record.info

    def _start(self, spec: LaunchSpec, now: float) -> InstanceRecord:
        launch_index, spot_index, job_t0 = self.state.next_launch(spec.job_uri, now, spot=spec.offer.is_spot)
        instance_id = f"local-{uuid.uuid4().hex[:12]}"
        instance_dir = self.state.instance_dir(instance_id)
        instance_dir.mkdir(parents=True)
        running_at = now + self.boot_seconds
        delay = None
        if spot_index >= 0:  # the market takes back spot capacity only
            delay = preemption_delay(self.preemption, launch_index=spot_index,
                                     seconds_since_job_start=running_at - job_t0,
                                     preemption_rate_per_hour=spec.offer.preemption_rate_per_hour)
        command = agent_argv(spec, python=self.python, instance_id=instance_id, options={
            "work-dir": str(instance_dir),
            "notice-file": str(self.state.notice_path(instance_id)),
            "poll-interval": self.poll_interval_seconds,
            # the agent must give up on its command before we give up on the agent, to write a status
            "term-grace": max(0.5 * self.terminate_grace_seconds, self.terminate_grace_seconds - 1.0),
            "boot-seconds": self.boot_seconds,
        })
        env = {**os.environ, **{str(k): str(v) for k, v in spec.env.items()}}
        try:
            with open(instance_dir / "agent.log", "ab") as out:
                agent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        except OSError as exc:
            raise LaunchError(f"local backend cannot start the agent ({exc})", capacity=False) from exc
        _adopt(agent)
        info = InstanceInfo(
            instance_id=instance_id,
            state=InstanceState.PENDING if self.boot_seconds > 0 else InstanceState.RUNNING,
            offer=spec.offer,
            job_uri=spec.job_uri,
            tags={**spec.tags, TAG_JOB_URI: spec.job_uri},
            launched_at=now,
        )
        record = InstanceRecord(
            info=info, agent=ProcessRef.of(agent.pid), pgid=agent.pid, token=spec.idempotency_token,
            launch_index=launch_index, spot_launch_index=spot_index, running_at=running_at,
            preempt_at=None if delay is None else running_at + delay,
        )
        record.extra["notice_window_seconds"] = self.notice_window_seconds
        self.state.write(record)
        if record.preempt_at is not None:
            with open(instance_dir / "preemption.log", "ab") as out:
                supervisor = subprocess.Popen(
                    spawn_supervisor_command(str(self.state.root), instance_id, record.preempt_at,
                                             self.notice_window_seconds),
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                )
            _adopt(supervisor)
            record = self.state.update(instance_id, lambda r: setattr(r, "supervisor", ProcessRef.of(supervisor.pid)))
        return record

    # ------------------------------------------------------------------ describe / list
    def describe(self, instance_ids: list[str]) -> dict[str, InstanceInfo]:
        _reap_children()
        out = {}
        for instance_id in dict.fromkeys(instance_ids):
            record = self.state.read(instance_id)
            if record is not None:
                out[instance_id] = self._refresh(record).info
        return out

    def list_instances(self, tags: dict[str, str] | None = None) -> list[InstanceInfo]:
        _reap_children()
        wanted = dict(tags or {})
        out = []
        for instance_id in self.state.instance_ids():
            record = self.state.read(instance_id)
            # a record from before the store's tag has its job_uri all the same
            have = {TAG_JOB_URI: record.info.job_uri, **record.info.tags} if record is not None else {}
            if record is None or any(have.get(k) != v for k, v in wanted.items()):
                continue
            out.append(self._refresh(record).info)
        return sorted(out, key=lambda i: (i.launched_at or 0.0, i.instance_id))

    def _refresh(self, record: InstanceRecord) -> InstanceRecord:
        """Bring the record up to date with the processes; persist a newly observed termination."""
        info = record.info
        if InstanceState(info.state).is_terminal():
            return record
        if record.agent.alive():
            booted = record.running_at is None or time.time() >= record.running_at
            if info.state is InstanceState.PENDING and booted:
                info.state = InstanceState.RUNNING
            return record
        updated = self.state.update(info.instance_id, self._mark_dead)
        return updated or record

    def _mark_dead(self, record: InstanceRecord) -> None:
        """Under the instance lock: the agent is gone; decide why, and clean up what is left."""
        info = record.info
        if InstanceState(info.state).is_terminal():
            return
        exit_marker = read_json(self.state.agent_exit_path(info.instance_id)) or {}
        if record.preempt_kill:
            reason = TerminationReason.PREEMPTED
        elif record.terminate_requested:
            reason = TerminationReason.USER
        elif exit_marker.get("reason") == "idle":
            reason = TerminationReason.IDLE
        else:
            reason = TerminationReason.FAILED
        # The agent may have died alone (killed by someone else): its command must not outlive it.
        kill_group(record.pgid, signal.SIGKILL, leader=record.agent)
        self._stop_supervisor(record)
        info.state = InstanceState.TERMINATED
        info.reason = reason
        info.terminated_at = float(exit_marker.get("time") or time.time())

    # ------------------------------------------------------------------ terminate
    def terminate(self, instance_ids: list[str]) -> None:
        """Stop each instance: SIGTERM to its agent (which forwards it to the running command and writes
        the attempt's status), wait up to ``terminate_grace_seconds`` for all of them, SIGKILL whatever
        is left of their process groups. Idempotent: terminated or unknown instances are skipped."""
        _reap_children()
        targets: list[InstanceRecord] = []
        for instance_id in dict.fromkeys(instance_ids):
            record = self.state.read(instance_id)
            if record is None:
                continue
            if InstanceState(record.info.state).is_terminal():
                if group_alive(record.pgid, leader=record.agent):  # a record written by a killed process
                    kill_group(record.pgid, signal.SIGKILL, leader=record.agent)
                continue

            def request(r: InstanceRecord) -> None:
                if not InstanceState(r.info.state).is_terminal():
                    r.terminate_requested = True

            record = self.state.update(instance_id, request)
            if record is not None and not InstanceState(record.info.state).is_terminal():
                targets.append(record)
        for record in targets:
            # SIGTERM goes to the agent alone, which forwards it to its command: a second SIGTERM sent to
            # the whole group could reach the command after its handler is gone (Python restores the
            # default handler while exiting) and kill it after a clean emergency save.
            if not self._signal_agent(record, signal.SIGTERM):
                kill_group(record.pgid, signal.SIGTERM, leader=record.agent)
        deadline = time.monotonic() + self.terminate_grace_seconds
        pending = [r for r in targets if group_alive(r.pgid, leader=r.agent)]
        while pending and time.monotonic() < deadline:
            time.sleep(0.05)
            pending = [r for r in pending if group_alive(r.pgid, leader=r.agent)]
        for record in pending:
            log.warning("%s did not stop %.0f s after SIGTERM: SIGKILL", record.info.instance_id,
                        self.terminate_grace_seconds)
            kill_group(record.pgid, signal.SIGKILL, leader=record.agent)
        kill_deadline = time.monotonic() + 5.0  # SIGKILL cannot be ignored; bounded all the same
        while any(group_alive(r.pgid, leader=r.agent) for r in pending) and time.monotonic() < kill_deadline:
            time.sleep(0.02)
        for record in targets:
            self.state.update(record.info.instance_id, self._mark_dead)
            log.info("terminated %s", record.info.instance_id)

    @staticmethod
    def _signal_agent(record: InstanceRecord, sig: int) -> bool:
        if not record.agent.alive():
            return False
        try:
            os.kill(record.agent.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def _stop_supervisor(self, record: InstanceRecord) -> None:
        if record.supervisor is not None and record.supervisor.alive():
            # It runs in a process group of its own (it must survive the instance's kill).
            kill_group(record.supervisor.pid, signal.SIGTERM, leader=record.supervisor)

    # ------------------------------------------------------------------ housekeeping
    def purge(self, older_than_seconds: float = 0.0) -> list[str]:
        """Delete the records of instances terminated more than ``older_than_seconds`` ago."""
        import shutil

        removed = []
        now = time.time()
        for instance_id in self.state.instance_ids():
            record = self.state.read(instance_id)
            if record is None:
                continue
            record = self._refresh(record)
            info = record.info
            if InstanceState(info.state).is_terminal() and now - (info.terminated_at or now) >= older_than_seconds:
                if record.supervisor is not None and record.supervisor.alive():
                    continue
                with self.state.launch_lock():
                    self.state.forget_token(record.token, instance_id)
                with contextlib.suppress(FileNotFoundError):
                    shutil.rmtree(self.state.instance_dir(instance_id))
                removed.append(instance_id)
        return removed

    def instance_dir(self, instance_id: str) -> Path:
        """Where an instance keeps its logs (``agent.log``, ``attempts/<attempt>.log``)."""
        return self.state.instance_dir(instance_id)

    def record(self, instance_id: str) -> InstanceRecord | None:
        """The full on-disk record (process ids, planned preemption) of an instance, refreshed."""
        record = self.state.read(instance_id)
        return None if record is None else self._refresh(record)
