"""The agent's side of a segment's command process: starting it, watching it, ending what it leaves behind.

Split out of :mod:`airflow_spot.training.agent` (mixed into its :class:`~airflow_spot.training.agent.Agent`;
the agent module re-exports the module-level names that moved here) so that module keeps the request loop,
the classification of exits and the reporting, and this one the process handling: the command runs in a
process group of its own (its processes also carry a ``SPOT_COMMAND_TOKEN`` mark), so that SIGTERM on stop
reaches the training process behind any wrapper, the agent can SIGKILL what outlives the grace, and
whatever an ended attempt left running is ended before the next one starts.

The mixin relies on these attributes of the agent: ``child`` (the running ``Popen``, or None), ``warm``,
``stopping``, ``work_dir``, ``outcome_file``, ``notice_file``, ``term_grace``, ``heartbeat_seconds``,
``_processes`` (hand-off directories made so far), ``_sigterm_forwarded`` and ``_killed_child``; and on its
methods ``_handoff_env()`` (the environment of a command that may stay warm), ``_forward_sigterm()`` and
``_liveness()``.

Never imports Airflow.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path

from airflow_spot.storage.protocol import SegmentRequest
from airflow_spot.training import env as E
from airflow_spot.training.handoff import HandoffDir, WarmProcess, group_alive, signal_group, wants_handoff

log = logging.getLogger("airflow_spot.agent")

#: characters of a command's output kept in the status object
TAIL_CHARS = 4000

#: seconds the processes a finished command left behind get after SIGTERM before SIGKILL
LEFTOVER_GRACE_SECONDS = 10.0

#: ``Popen`` arguments that start a command in a process group of its own, inside the agent's session
#: (``process_group`` is Python 3.11's; on 3.10 the child calls ``setpgid`` itself before its exec)
OWN_PROCESS_GROUP: dict = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def segment_env(
    request: SegmentRequest,
    notice_file: str | None,
    base: dict[str, str] | None = None,
    handoff_dir: str | None = None,
    handoff_wait: float | None = None,
    outcome_file: str | None = None,
) -> dict[str, str]:
    """Environment of one attempt: the agent's own, the request's extras, then the protocol variables
    (which win, so a request cannot point the session at another job or range)."""
    env = dict(os.environ if base is None else base)
    env.update({str(k): str(v) for k, v in (request.env or {}).items()})
    env.setdefault("PYTHONUNBUFFERED", "1")  # so the tail of a crash reaches the log
    env[E.JOB_URI] = request.job_uri
    env[E.ATTEMPT_ID] = request.attempt_id
    env[E.START_STEP] = str(int(request.start_step))
    env[E.END_STEP] = str(int(request.end_step))
    optional = {
        E.NOTICE_FILE: notice_file,
        E.MTBF_SECONDS: request.mtbf_seconds,
        E.CKPT_MIN_INTERVAL: request.min_interval_seconds,
        E.CKPT_MAX_INTERVAL: request.max_interval_seconds,
        E.NOTICE_WINDOW_SECONDS: request.notice_window_seconds,
        E.CKPT_KEEP: request.keep_checkpoints,
        E.WARM_START_URI: request.warm_start_uri,
        E.TOTAL_STEPS: request.total_steps,
        E.HANDOFF_DIR: handoff_dir,
        E.HANDOFF_WAIT: handoff_wait,
        E.OUTCOME_FILE: outcome_file,
    }
    for name, value in optional.items():
        if value is not None and value != "":
            env[name] = str(value)
        else:
            env.pop(name, None)
    return env


def read_tail(path: Path, chars: int = TAIL_CHARS, start: int = 0) -> str:
    """The last ``chars`` characters of a log, not looking before byte ``start`` (where an attempt
    handed to a warm process began writing into the log of the process)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(start, size - chars * 4))
            return f.read().decode("utf-8", errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


class CommandProcessMixin(ABC):
    """Runs an attempt's command (or continues a warm process) and ends what its process group leaves
    behind. Mixed into :class:`~airflow_spot.training.agent.Agent`; see the module docstring."""

    child: subprocess.Popen | None
    warm: WarmProcess | None
    stopping: bool
    work_dir: Path
    outcome_file: Path
    notice_file: str | None
    term_grace: float
    heartbeat_seconds: float
    _processes: int
    _sigterm_forwarded: bool
    _killed_child: bool

    @abstractmethod
    def _handoff_env(self, request: SegmentRequest, channel: HandoffDir) -> dict[str, str]:
        """The environment of a command started with a hand-off directory (it may stay warm)."""

    @abstractmethod
    def _forward_sigterm(self) -> None:
        """Pass SIGTERM on to the running command, once."""

    @abstractmethod
    def _liveness(self, state: str, attempt_id: str | None, force: bool = False,
                  exit_reason: str | None = None) -> None:
        """Write the agent's liveness object (at a bounded rate unless ``force``)."""

    def _run_command(
        self, request: SegmentRequest, log_path: Path, warm: WarmProcess | None = None
    ) -> tuple[int | None, str]:
        """Run the command (or continue ``warm``, which took the request) to its end or to its "segment
        done" marker; returns (exit code, 0 at a done marker, or None if it never started; output tail)."""
        with contextlib.suppress(OSError):  # an earlier attempt's word is not this one's
            self.outcome_file.unlink(missing_ok=True)
        if warm is not None:
            self.child = warm.proc
            channel, out_path = warm.channel, warm.log_path
            offset = out_path.stat().st_size if out_path.exists() else 0
            with contextlib.suppress(OSError):  # a note for whoever reads the logs; a full disk may refuse it
                log_path.write_text(f"[agent] attempt {request.attempt_id} continues in the warm training process "
                                    f"{warm.proc.pid}; its output is in {out_path.name} from byte {offset}\n")
        else:
            offset, out_path = 0, log_path
            channel = None
            if wants_handoff(request):
                self._processes += 1
                channel = HandoffDir(self.work_dir / "handoff" / f"{self._processes:05d}")
                try:
                    channel.path.mkdir(parents=True, exist_ok=True)
                except OSError as exc:  # a full disk: the process ends with its segment instead
                    log.warning("no hand-off for %s (%s): the process ends with its segment", request.attempt_id, exc)
                    channel = None
            env = (self._handoff_env(request, channel) if channel
                   else segment_env(request, self.notice_file, outcome_file=str(self.outcome_file)))
            try:
                out = open(log_path, "ab")  # noqa: SIM115 - closed when the command is started
            except OSError as exc:  # the instance's disk is full (or read-only): no command can run well
                return None, f"[agent] cannot open the attempt's log {log_path}: {exc}; the instance's disk is full?"
            # every process of the command carries it, also those a launcher starts in sessions of their own
            token = env[E.COMMAND_TOKEN] = uuid.uuid4().hex
            with out:
                self._sigterm_forwarded = self._killed_child = False
                try:
                    proc = subprocess.Popen(
                        request.command,
                        cwd=request.cwd or None,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        **OWN_PROCESS_GROUP,  # signals and the clean-up reach all it starts
                    )
                except OSError as exc:  # missing program, not executable, bad cwd: the user's to fix
                    where = f" in {request.cwd!r}" if request.cwd else ""
                    message = f"cannot start command {request.command!r}{where}: {exc.strerror or exc}"
                    out.write((message + "\n").encode())
                    return None, message
                # marked before the agent's SIGTERM handler can see it: a signal in between would otherwise
                # reach the group alone, not the marked processes a launcher starts in sessions of their own
                proc.spot_token = token  # type: ignore[attr-defined]  # read by signal_group
                self.child = proc
        child = self.child
        assert child is not None
        # A process that may report "segment done" is watched closely: that marker ends the attempt.
        tick = min(0.05 if channel else 0.5, self.heartbeat_seconds)
        term_deadline: float | None = None
        while True:
            try:
                code = child.wait(timeout=tick)
                break
            except subprocess.TimeoutExpired:
                pass
            done = channel.read_done(request.attempt_id) if channel is not None else None
            if done is not None and not self.stopping:
                self.warm = WarmProcess(child, channel, request, int(done["step"]), out_path)
                tail = read_tail(out_path, start=offset) + (
                    f"\n[agent] segment done at step {done['step']}; the process (pid {child.pid}) stays warm "
                    "for the next segment"
                )
                return 0, tail
            self._liveness("running", request.attempt_id)
            if self.stopping and term_deadline is None:
                self._forward_sigterm()  # SIGTERM may have come before the child existed
                term_deadline = time.monotonic() + self.term_grace
            if term_deadline is not None and time.monotonic() > term_deadline:
                log.warning("attempt %s did not exit %.0f s after SIGTERM: killing it",
                            request.attempt_id, self.term_grace)
                self._killed_child = True
                signal_group(child, signal.SIGKILL)
        # what the command left running: while the instance stops, a wrapper's training process may still be
        # committing its emergency save (waited for up to the grace, so the status counts it); otherwise
        # background processes of an attempt that ended must not run into the next one
        if self.stopping:
            left = (term_deadline or time.monotonic() + self.term_grace) - time.monotonic()
            self._wait_group(child.pid, max(0.0, left), getattr(child, "spot_token", None))
        self._end_group(child, "its command ended")
        self.child = None
        tail = read_tail(out_path, start=offset)
        if code < 0:
            tail += f"\n[agent] command killed by signal {-code}"
        return code, tail

    @staticmethod
    def _wait_group(pgid: int, timeout: float, token: str | None = None) -> bool:
        """Wait up to ``timeout`` seconds for process group ``pgid`` (and the processes marked ``token``) to
        end; whether they did."""
        deadline = time.monotonic() + timeout
        while group_alive(pgid, token):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _end_group(self, proc: subprocess.Popen, why: str) -> None:
        """End what is left of ``proc``'s process group (and of its marked processes): SIGTERM, then SIGKILL
        after a grace."""
        token = getattr(proc, "spot_token", None)
        if not group_alive(proc.pid, token):
            return
        log.warning("process group %d: processes left running after %s; ending them", proc.pid, why)
        signal_group(proc, signal.SIGTERM)
        if not self._wait_group(proc.pid, min(self.term_grace, LEFTOVER_GRACE_SECONDS), token):
            signal_group(proc, signal.SIGKILL)
            self._wait_group(proc.pid, 5.0, token)
