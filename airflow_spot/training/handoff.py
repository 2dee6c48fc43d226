"""Warm training processes: handing the next segment to a process that is still running.

Without this, every segment starts a new training process (interpreter, ``import torch``, restore from
the store) after the previous one exited. With it, the training process stays alive across a segment
boundary on a warm instance:

1. ``SpotSession.steps()`` reaches ``end_step``, commits the end checkpoint as always, then writes
   ``done-<attempt>.json`` into the hand-off directory the agent gave it (``SPOT_HANDOFF_DIR``) and waits,
   bounded, for ``answer-<attempt>.json``.
2. The agent sees the done marker, writes the attempt's final status ``completed`` at once (the trigger
   fires without waiting for an exit) and keeps the process as its *warm process*.
3. The next request of the instance that is :func:`compatible` (same job, command, cwd and non-``SPOT_*``
   environment; the store's newest checkpoint is exactly where the process stands) is answered with
   ``{"action": "continue", ...}`` carrying the new attempt's ``SPOT_*`` values. The process writes
   ``ack-<new attempt>.json`` and keeps stepping from its in-memory state (no restore: it is already
   exactly at the committed step) under the new attempt id.
4. An incompatible request, no request within the agent's hand-off wait, or the agent stopping is
   answered with ``{"action": "exit"}``: ``steps()`` returns, the script's code after the loop runs and
   the process exits 0. A later request gets a fresh process as before.

A preemption notice (or SIGTERM) while the process waits: its state is committed, it exits with
``PREEMPTED_EXIT_CODE`` and no attempt is touched (the previous one already has its status, and the next
one was not handed over; if it was, the process acknowledged it and the exit counts for it).

Every file is written atomically (temporary name, then ``os.replace``), so a reader sees all or nothing.
The directory is local to the instance: no sockets, no store round trip. Never imports Airflow.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_spot.storage.protocol import PREEMPTED_EXIT_CODE, SegmentRequest, safe_id
from airflow_spot.training import env as E

log = logging.getLogger("airflow_spot.agent")

CONTINUE = "continue"
EXIT = "exit"
#: seconds between checks of the hand-off directory (a local stat: cheap)
POLL_SECONDS = 0.02
#: how long a process waits for the agent's answer beyond the agent's own hand-off wait
ANSWER_GRACE_SECONDS = 30.0


def _live_processes() -> list[tuple[int, int]] | None:
    """``(pid, process group)`` of every live (not zombie) process, read from ``/proc`` (the instance is
    Linux), where an orphaned zombie, which nobody may reap yet, does not count; None without ``/proc``."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    out = []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        if len(fields) > 2 and fields[0] != b"Z":
            out.append((int(entry), int(fields[2])))
    return out


def marked_processes(token: str | None, live: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """``(pid, process group)`` of the live processes started with ``SPOT_COMMAND_TOKEN=token`` in their
    environment (the agent's mark on a command): those a launcher moved out of the command's process group
    too. ``torchrun`` starts each rank in a session of its own, so a signal to the group reaches torchrun
    alone, and its ranks outlive it. ``live``: a scan of :func:`_live_processes` already made."""
    if not token:
        return []
    live = _live_processes() if live is None else live
    mark = f"{E.COMMAND_TOKEN}={token}".encode()
    out = []
    for pid, pgid in live or ():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    out.append((pid, pgid))
        except OSError:  # gone, or another user's
            continue
    return out


def group_alive(pgid: int, token: str | None = None) -> bool:
    """Whether a live (not zombie) process is left in process group ``pgid``, or marked with the command's
    ``token`` (:func:`marked_processes`); one scan of ``/proc``."""
    live = _live_processes()
    if live is None:  # no /proc: any member of the group, zombies included
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    return any(g == pgid for _, g in live) or bool(marked_processes(token, live))


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the command's whole process group (its own: a wrapper script, the workers it started), the
    process alone when the group is gone, and the processes marked with its token (``proc.spot_token``, see
    :func:`marked_processes`) outside the group."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    for pid, pgid in marked_processes(getattr(proc, "spot_token", None)):
        if pgid != proc.pid:  # the group's members had it: each process gets it once
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def write_json_atomic(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(json.dumps(body, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # only ever written atomically: a torn file is not expected, treat it as absent
        return None


class HandoffDir:
    """The files of one warm process, for both sides. ``path`` is created by the agent."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def _file(self, kind: str, attempt_id: str) -> Path:
        return self.path / f"{kind}-{safe_id(attempt_id)}.json"

    # process -> agent
    def write_done(self, attempt_id: str, step: int) -> None:
        write_json_atomic(self._file("done", attempt_id),
                          {"attempt_id": attempt_id, "step": int(step), "pid": os.getpid(), "time": time.time()})

    def read_done(self, attempt_id: str) -> dict[str, Any] | None:
        return read_json(self._file("done", attempt_id))

    def write_ack(self, attempt_id: str) -> None:
        write_json_atomic(self._file("ack", attempt_id), {"attempt_id": attempt_id, "pid": os.getpid(),
                                                          "time": time.time()})

    def acked(self, attempt_id: str) -> bool:
        return self._file("ack", attempt_id).exists()

    # agent -> process
    def answer(self, done_attempt_id: str, body: dict[str, Any]) -> None:
        write_json_atomic(self._file("answer", done_attempt_id), body)

    def read_answer(self, done_attempt_id: str) -> dict[str, Any] | None:
        return read_json(self._file("answer", done_attempt_id))

    def wait_answer(self, done_attempt_id: str, timeout: float, should_stop: Callable[[], bool]) -> dict | None:
        """Poll for the answer to ``done_attempt_id`` until it comes, ``should_stop()`` or ``timeout``."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            answer = self.read_answer(done_attempt_id)
            if answer is not None or should_stop():
                return answer
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_SECONDS)


def continue_answer(request: SegmentRequest, env: dict[str, str]) -> dict[str, Any]:
    """The agent's answer that hands ``request`` to the warm process; ``env`` is the attempt's full
    environment (only its ``SPOT_*`` values are sent: the rest is the process's already)."""
    return {
        "action": CONTINUE,
        "attempt_id": request.attempt_id,
        "start_step": int(request.start_step),
        "end_step": int(request.end_step),
        "spot_env": {k: v for k, v in env.items() if k.startswith("SPOT_")},
    }


def _user_env(request: SegmentRequest) -> dict[str, str]:
    return {str(k): str(v) for k, v in (request.env or {}).items() if not str(k).startswith("SPOT_")}


def incompatible(
    running: SegmentRequest, done_step: int, nxt: SegmentRequest, latest_committed: int | None
) -> str | None:
    """Why ``nxt`` cannot continue in the warm process that ran ``running`` up to ``done_step``, or None.

    The process must be the same program in the same place with the same environment, and it must stand
    exactly at the job's newest committed checkpoint (else a restore would start somewhere else).
    """
    if opted_out(nxt):
        return "the request opts out of the warm process"
    if nxt.job_uri != running.job_uri:
        return "another job"
    if list(nxt.command or []) != list(running.command or []):
        return "another command"
    if (nxt.cwd or None) != (running.cwd or None):
        return "another working directory"
    if _user_env(nxt) != _user_env(running):
        return "another environment"
    if latest_committed != done_step:
        return f"the job's newest checkpoint is at step {latest_committed}, the process at {done_step}"
    if not (nxt.start_step <= done_step < nxt.end_step):
        return f"the request's range [{nxt.start_step}, {nxt.end_step}) does not continue from step {done_step}"
    return None


def opted_out(request: SegmentRequest) -> bool:
    """The request's ``warm_process`` flag is off, or its environment sets ``SPOT_WARM_PROCESS=0``."""
    flag = str((request.env or {}).get(E.WARM_PROCESS, "1")).strip().lower()
    return not request.warm_process or flag in ("0", "false", "no", "off")


def wants_handoff(request: SegmentRequest) -> bool:
    """Whether the agent offers a hand-off directory to this request's process: not when it opts out,
    and not for the job's last segment (nothing can follow it)."""
    if opted_out(request):
        return False
    return request.total_steps is None or request.end_step < request.total_steps


class WarmProcess:
    """The agent's view of a training process that finished a segment and waits for the next one.

    :param proc: the process (a ``subprocess.Popen``).
    :param channel: its hand-off directory.
    :param request: the request it ran last (the one its done marker answers).
    :param done_step: the step it committed and stands at.
    :param log_path: the file its output goes to (the log of the attempt that started it).
    """

    def __init__(self, proc: Any, channel: HandoffDir, request: SegmentRequest, done_step: int,
                 log_path: Path) -> None:
        self.proc, self.channel, self.request = proc, channel, request
        self.done_step, self.log_path = int(done_step), Path(log_path)
        self.done_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def hand_over(self, request: SegmentRequest, env: dict[str, str], timeout: float) -> bool:
        """Answer "continue with ``request``" and wait (bounded) for the process to acknowledge it.

        False when the process ended (e.g. its own wait ran out, or a notice) or did not acknowledge in
        time: the request then needs a fresh process, and this one is not running anything.
        """
        self.channel.answer(self.request.attempt_id, continue_answer(request, env))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.channel.acked(request.attempt_id):
                return True
            if not self.alive():
                return self.channel.acked(request.attempt_id)
            time.sleep(POLL_SECONDS)
        return self.channel.acked(request.attempt_id)

    def dismiss(self, grace: float) -> int | None:
        """Answer "exit", wait up to ``grace`` seconds for the process to end, then kill it.
        Returns its exit code."""
        if self.alive():
            try:
                self.channel.answer(self.request.attempt_id, {"action": EXIT})
            except OSError:
                pass  # it is killed below if it does not end on its own
        try:
            code = self.proc.wait(timeout=max(0.0, grace))
        except subprocess.TimeoutExpired:  # a process that ignores its answer
            signal_group(self.proc, signal.SIGKILL)
            code = self.proc.wait(timeout=30)
        if group_alive(self.proc.pid):  # what it started (a wrapper's child, workers) goes with it
            signal_group(self.proc, signal.SIGKILL)
        return code


class WarmAgentMixin(ABC):
    """The agent's side of warm processes (mixed into :class:`~airflow_spot.training.agent.Agent`, which
    provides ``warm``, ``child``, ``stopping``, ``notice_file``, ``term_grace``, ``handoff_wait``,
    ``_latest_committed_step()`` and ``_handoff_env()``)."""

    warm: WarmProcess | None
    child: Any
    stopping: bool
    notice_file: str | None
    term_grace: float
    handoff_wait: float

    @abstractmethod
    def _latest_committed_step(self) -> int | None:
        """The job's newest committed checkpoint step (None if none or unreadable)."""

    @abstractmethod
    def _handoff_env(self, request: SegmentRequest, channel: HandoffDir) -> dict[str, str]:
        """The ``SPOT_*`` values a continued process takes over for ``request``."""

    def _take_warm(self, request: SegmentRequest) -> WarmProcess | None:
        """The warm process, if it took ``request`` (then it runs it); else it is told to exit."""
        warm = self.warm
        if warm is None:
            return None
        if not warm.alive():
            self._tend_warm()
            return None
        if self.stopping:
            reason = "the instance is stopping"
        elif self.notice_file and os.path.exists(self.notice_file):
            reason = "the instance is under a preemption notice"
        else:
            reason = incompatible(warm.request, warm.done_step, request, self._latest_committed_step())
        if reason is None:
            env = self._handoff_env(request, warm.channel)
            if warm.hand_over(request, env, timeout=max(5.0, self.term_grace)):
                self.warm = None
                log.info("attempt %s continues in the warm process %d at step %d", request.attempt_id,
                         warm.proc.pid, warm.done_step)
                return warm
            reason = "the process did not take the segment"
        self._end_warm(reason)
        return None

    def _tend_warm(self) -> None:
        """Between requests: forget a warm process that ended, dismiss one that waited too long."""
        warm = self.warm
        if warm is None:
            return
        if not warm.alive():
            self._log_warm_exit(warm, warm.proc.returncode, "it ended on its own")
            self.warm = self.child = None
        elif time.monotonic() - warm.done_at >= self.handoff_wait:
            self._end_warm(f"no next request within {self.handoff_wait:.0f} s")

    def _end_warm(self, reason: str) -> None:
        warm = self.warm
        if warm is None:
            return
        code = warm.dismiss(self.term_grace)
        self._log_warm_exit(warm, code, reason)
        self.warm = self.child = None

    @staticmethod
    def _log_warm_exit(warm: WarmProcess, code: int | None, reason: str) -> None:
        # Its last attempt is already completed (statuses are written once): the exit code is only logged.
        level = logging.INFO if code in (0, PREEMPTED_EXIT_CODE) else logging.WARNING
        log.log(level, "warm process %d (after attempt %s, step %d) exited with %s: %s", warm.proc.pid,
                warm.request.attempt_id, warm.done_step, code, reason)

