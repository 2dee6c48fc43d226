"""The agent: the small process on an instance that runs segment requests and reports their outcome.

Started by a backend as ``python -m airflow_spot.training.agent --job-uri URI --instance-id ID ...``. It
polls ``control/instances/<id>/requests/`` in the job's store, runs each new request's command (oldest
``created_at`` first) as a child process with the segment's ``SPOT_*`` environment, keeps the full output
of each attempt in ``<work-dir>/attempts/<attempt>.log`` and writes exactly one final
:class:`~airflow_spot.storage.protocol.AttemptStatus` per attempt:

* exit 0 -> ``completed``; exit 75 (``PREEMPTED_EXIT_CODE``) -> ``preempted``; a SIGTERM death while the
  instance is stopping or under a preemption notice, or the agent's own SIGKILL after the grace ->
  ``preempted``; anything else, or a command that cannot be started -> ``failed`` with the tail of its output.

A warm instance runs several segments in a row; an attempt that already has a status is never run
again. Its training process may stay warm too (:mod:`airflow_spot.training.handoff`): a command started
with ``SPOT_HANDOFF_DIR`` that reports "segment done" gets its ``completed`` status at once, and the next
compatible request of the instance continues in it instead of a new process; an incompatible request, or
none within ``--handoff-wait`` seconds, tells it to exit. With no request for ``--idle-timeout`` seconds
the agent writes ``agent_exit.json`` (reason ``idle``) in its work dir and exits 0. On SIGTERM it
forwards the signal to the running command, waits up to ``--term-grace`` seconds, writes the status,
and exits. It also writes a liveness object
``control/instances/<id>/agent.json`` (state, current attempt, time) at a bounded rate.

Never imports Airflow: only ``storage`` and the environment contract of ``training.env``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore, open_store, store_errors
from airflow_spot.storage.protocol import (
    PREEMPTED_EXIT_CODE,
    AttemptStatus,
    JobLayout,
    Outcome,
    SchemaError,
    SegmentRequest,
    safe_id,
)
from airflow_spot.training import env as E
from airflow_spot.training.command_process import (  # noqa: F401 - those not used here: re-exported
    LEFTOVER_GRACE_SECONDS, OWN_PROCESS_GROUP, TAIL_CHARS, CommandProcessMixin, read_tail, segment_env,
)
from airflow_spot.training.handoff import ANSWER_GRACE_SECONDS, HandoffDir, WarmAgentMixin, WarmProcess, signal_group

log = logging.getLogger("airflow_spot.agent")

AGENT_EXIT_FILE = "agent_exit.json"
#: longest pause between request polls while the store keeps failing
MAX_ERROR_BACKOFF_SECONDS = 5.0


#: what a store call raises when the store is unreachable or refuses: the agent waits those out
STORE_ERRORS = store_errors()


def agent_key(instance_id: str) -> str:
    """Key of the agent's liveness object in the job's store."""
    return JobLayout.agent_key(instance_id)


def outcome_for_exit(code: int, *, stop_signalled: bool = False, notice_issued: bool = False,
                     killed_by_agent: bool = False) -> Outcome:
    """The outcome of an attempt whose command exited with ``code`` (negative: killed by that signal).

    A death by signal is the user's code failing (a segfault, an abort, the OOM killer), except when the
    signal is the instance being taken: a SIGTERM while the agent is stopping (it forwarded the SIGTERM, or
    the whole instance got it) or after a preemption notice was issued (it may reach the command before its
    session installed the notice handler: nothing is lost, the newest checkpoint stands), and the SIGKILL
    the agent itself sends to a command that outlived the grace after SIGTERM.
    """
    if code == 0:
        return Outcome.COMPLETED
    if code == PREEMPTED_EXIT_CODE:
        return Outcome.PREEMPTED
    # -15 from the command itself, 128 + 15 from a wrapper that reports its child's death the shell's way
    if code in (-signal.SIGTERM, 128 + signal.SIGTERM) and (stop_signalled or notice_issued):
        return Outcome.PREEMPTED
    if code == -signal.SIGKILL and killed_by_agent:
        return Outcome.PREEMPTED
    return Outcome.FAILED


def latest_committed_step(store: ObjectStore) -> int | None:
    """Newest committed checkpoint step of the job, or None (no checkpoint, or the store is unreadable:
    the status must still be written, so a read failure is reported in the log and not raised)."""
    from airflow_spot.storage.checkpoint import CheckpointError

    try:
        return JobLayout(store).latest_step()
    except (ValueError, ObjectNotFound, CheckpointError, *STORE_ERRORS) as exc:  # broken checkpoints: the
        log.warning("cannot read the job's latest checkpoint: %s", exc)  # status says so; Airflow decides
        return None


class Agent(WarmAgentMixin, CommandProcessMixin):
    """Runs the segment requests of one instance. See the module docstring."""

    def __init__(
        self,
        job_uri: str,
        instance_id: str,
        *,
        idle_timeout: float,
        work_dir: str | os.PathLike,
        notice_file: str | None = None,
        poll_interval: float = 0.2,
        term_grace: float = 30.0,
        heartbeat_seconds: float = 5.0,
        handoff_wait: float | None = None,
    ) -> None:
        # a heartbeat of 0 would spin the wait for the command without a pause (it ticks at most that long)
        if not (idle_timeout > 0 and poll_interval > 0 and heartbeat_seconds > 0 and term_grace >= 0):
            raise ValueError("idle_timeout, poll_interval and heartbeat_seconds must be positive, term_grace >= 0 "
                             f"(got {idle_timeout!r}, {poll_interval!r}, {heartbeat_seconds!r}, {term_grace!r})")
        self.store = open_store(job_uri)
        self.layout = JobLayout(self.store)
        self.instance_id = instance_id
        self.idle_timeout = idle_timeout
        self.work_dir = Path(work_dir)
        (self.work_dir / "attempts").mkdir(parents=True, exist_ok=True)
        #: where the session records that a notice ended its attempt (cleared before each attempt)
        self.outcome_file = self.work_dir / "outcome"
        self.notice_file = notice_file
        self.poll_interval = poll_interval
        self.term_grace = term_grace
        self.heartbeat_seconds = heartbeat_seconds
        self.handled: set[str] = set()
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self._sigterm_forwarded = False
        self._killed_child = False  # the agent SIGKILLed the command (it outlived the grace after SIGTERM)
        self._last_liveness = 0.0
        #: seconds a warm process waits for the next request before it is told to exit
        self.handoff_wait = idle_timeout if handoff_wait is None else max(0.0, float(handoff_wait))
        self.warm: WarmProcess | None = None
        self._processes = 0
        #: final statuses the store refused (an outage): written as soon as it answers again
        self._unwritten: list[AttemptStatus] = []

    # ------------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        def on_term(signum, frame):
            self.stopping = True
            self._forward_sigterm()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)

    def _forward_sigterm(self) -> None:
        """Pass SIGTERM on to the running command, once: a second SIGTERM can land after a Python
        command restored its default handler on the way out and kill it after a clean emergency save."""
        child = self.child
        if child is None or self._sigterm_forwarded or child.poll() is not None:
            return
        self._sigterm_forwarded = True
        # the whole group: a wrapper (bash train.sh, sh -c "cd ... && python ...") would die of it at once and
        # leave the training process, which saves on SIGTERM, unwarned; each process gets it once
        signal_group(child, signal.SIGTERM)

    # ------------------------------------------------------------------ main loop
    def run(self) -> str:
        """Serve requests until idle or told to stop. Returns the exit reason (``idle`` or ``sigterm``)."""
        idle_since = time.monotonic()
        failures = 0
        self._liveness("idle", None, force=True)
        while not self.stopping:
            ran = False
            self._write_unwritten()
            try:
                requests = self.new_requests()
            except STORE_ERRORS as exc:
                # An unreachable store is waited out (with backoff) up to the idle timeout, like silence.
                failures += 1
                log.warning("cannot read requests from the store (%s: %s); retrying", type(exc).__name__, exc)
                if time.monotonic() - idle_since >= self.idle_timeout:
                    self._write_exit("idle")
                    return "idle"
                time.sleep(min(MAX_ERROR_BACKOFF_SECONDS, self.poll_interval * 2 ** min(failures, 6)))
                continue
            failures = 0
            for request in requests:
                if self.stopping:
                    break
                self._serve(request)
                ran = True
            if ran:
                idle_since = time.monotonic()
                continue
            self._tend_warm()
            if time.monotonic() - idle_since >= self.idle_timeout:
                self._end_warm("the agent is going idle")
                self._write_exit("idle")
                # A request may have landed while deciding: serve it instead of leaving it stranded.
                if self._new_requests_or_none():
                    os.unlink(self.work_dir / AGENT_EXIT_FILE)
                    idle_since = time.monotonic()
                    continue
                log.info("no request for %.1f s: shutting down", self.idle_timeout)
                # when the instance went idle: its idle time is billed to here (``accounting.bill_idle_exits``),
                # as is an instance's ended under an idle agent (``sigterm`` below) that no task billed
                self._liveness("exited", None, force=True, exit_reason="idle")
                return "idle"
            self._liveness("idle", None)
            time.sleep(self.poll_interval)
        self._end_warm("the agent is stopping")  # it got the SIGTERM too: it exits preempted, state committed
        self._write_unwritten()
        self._write_exit("sigterm")
        self._liveness("exited", None, force=True, exit_reason="sigterm")
        return "sigterm"

    def _serve(self, request: SegmentRequest) -> None:
        """Run one request; an error of the agent's own (a full disk, a bug) ends that request with a status
        saying so instead of ending the agent, which would leave the attempt without one (lost)."""
        try:
            self.run_request(request)
        except Exception as exc:  # noqa: BLE001 - the agent serves on; the attempt says what happened
            log.exception("attempt %s: the agent failed serving it", request.attempt_id)
            if self.child is not None and self.child.poll() is None:
                self._end_group(self.child, "the agent failed serving its attempt")
            self.child = None
            status = AttemptStatus(
                attempt_id=request.attempt_id, outcome=Outcome.FAILED.value, exit_code=None, started_at=time.time(),
                ended_at=time.time(), last_committed_step=None, instance_id=self.instance_id,
                error_tail=f"[agent] the agent failed serving this attempt: {type(exc).__name__}: {exc}")
            if not self._write_status_once(status):
                self._unwritten.append(status)

    def _new_requests_or_none(self) -> list[SegmentRequest]:
        try:
            return self.new_requests()
        except STORE_ERRORS:
            return []

    def new_requests(self) -> list[SegmentRequest]:
        """Requests of this instance not yet handled and without a status, oldest first."""
        prefix = self.layout.request_prefix(self.instance_id)
        out = []
        for key in self.store.list(prefix):
            name = key[len(prefix):] if key.startswith(prefix) else key.rsplit("/", 1)[-1]
            if not name.endswith(".json") or "/" in name or name[: -len(".json")] in self.handled:
                continue
            try:
                request = SegmentRequest.from_json(self.store.get_bytes(key))
            except ObjectNotFound:
                continue
            except SchemaError as exc:
                log.error("ignoring unreadable request %s: %s", key, exc)
                self.handled.add(name[: -len(".json")])
                continue
            if self._has_status(request.attempt_id):
                self.handled.add(request.attempt_id)
                continue
            out.append(request)
        return sorted(out, key=lambda r: (r.created_at, r.attempt_id))

    def _has_status(self, attempt_id: str) -> bool:
        try:
            return self.layout.read_status(attempt_id) is not None
        except SchemaError:  # a status this agent cannot read is still a status: never run it again
            return True

    def run_request(self, request: SegmentRequest) -> AttemptStatus:
        self.handled.add(request.attempt_id)
        started_at = time.time()
        log.info("attempt %s: steps [%d, %d) command %s", request.attempt_id, request.start_step,
                 request.end_step, request.command)
        self._liveness("running", request.attempt_id, force=True)
        log_path = self.work_dir / "attempts" / f"{safe_id(request.attempt_id)}.log"
        exit_code: int | None = None
        warm = self._take_warm(request)
        if warm is not None:
            exit_code, tail = self._run_command(request, log_path, warm)
            outcome, tail = self._classify(exit_code, tail)
        elif self.notice_file and os.path.exists(self.notice_file):
            outcome, tail = Outcome.PREEMPTED, "instance is under a preemption notice; the request was not started"
        elif self.stopping:
            outcome, tail = Outcome.PREEMPTED, "the instance is stopping; the request was not started"
        elif not isinstance(request.command, list) or not request.command or not all(
            isinstance(a, str) for a in request.command
        ):
            outcome = Outcome.FAILED
            tail = f"the request's command must be a non-empty list of strings, got {request.command!r}"
        else:
            exit_code, tail = self._run_command(request, log_path)
            outcome, tail = self._classify(exit_code, tail)
        status = AttemptStatus(
            attempt_id=request.attempt_id,
            outcome=outcome.value,
            exit_code=exit_code,
            started_at=started_at,
            ended_at=time.time(),
            last_committed_step=latest_committed_step(self.store),
            error_tail=tail,
            instance_id=self.instance_id,
            kill_seen=self._kill_seen(request.attempt_id),
        )
        if not self._write_status_once(status):
            self._unwritten.append(status)  # retried at every turn of the main loop until the store answers
        log.info("attempt %s: %s (exit %s, last committed step %s)", request.attempt_id, outcome.value,
                 exit_code, status.last_committed_step)
        self._liveness("idle", None, force=True)
        return status

    def _kill_seen(self, attempt_id: str) -> bool | None:
        """Whether the attempt's task was killed before this status: its killer records the kill before it
        ends the instance, so a status the termination brought about finds the record (no clock compared).
        None when the store does not answer: the readers then compare times."""
        try:
            return self.layout.read_kill(attempt_id) is not None
        except STORE_ERRORS as exc:
            log.warning("cannot read the kill record of %s (%s: %s)", attempt_id, type(exc).__name__, exc)
            return None

    def _classify(self, exit_code: int | None, tail: str) -> tuple[Outcome, str]:
        """Outcome of a command that ran (``exit_code`` None: it never started), see ``outcome_for_exit``."""
        if exit_code is None:
            return Outcome.FAILED, tail
        notice = bool(self.notice_file and os.path.exists(self.notice_file))
        outcome = outcome_for_exit(exit_code, stop_signalled=self.stopping, notice_issued=notice,
                                   killed_by_agent=self._killed_child)
        if outcome is Outcome.FAILED and self._session_said_preempted():
            return Outcome.PREEMPTED, tail + (f"\n[agent] exit {exit_code}, but the training session ended the attempt "
                                              "for a preemption notice (its launcher did not pass exit code 75 on)")
        if (exit_code < 0 or exit_code == 128 + signal.SIGTERM) and outcome is Outcome.PREEMPTED:
            why = "the instance was stopping" if self.stopping else "a preemption notice was issued"
            tail += f"\n[agent] {why}; the attempt counts as preempted"
        return outcome, tail

    def _session_said_preempted(self) -> bool:
        try:
            return self.outcome_file.read_text().startswith("preempted")
        except OSError:
            return False

    # ------------------------------------------------------------------ warm process (see WarmAgentMixin)
    def _latest_committed_step(self) -> int | None:
        return latest_committed_step(self.store)

    def _handoff_env(self, request: SegmentRequest, channel: HandoffDir) -> dict[str, str]:
        return segment_env(request, self.notice_file, handoff_dir=str(channel.path),
                           handoff_wait=self.handoff_wait + ANSWER_GRACE_SECONDS, outcome_file=str(self.outcome_file))

    # ------------------------------------------------------------------ reporting
    def _liveness(self, state: str, attempt_id: str | None, force: bool = False,
                  exit_reason: str | None = None) -> None:
        now = time.time()
        if not force and now - self._last_liveness < self.heartbeat_seconds:
            return
        self._last_liveness = now
        body = {"schema": 1, "instance_id": self.instance_id, "pid": os.getpid(), "state": state,
                "attempt_id": attempt_id, "time": now}
        if exit_reason is not None:
            body["exit_reason"] = exit_reason
        try:
            self.store.put_bytes(agent_key(self.instance_id), json.dumps(body).encode())
        except STORE_ERRORS as exc:  # liveness is best effort; statuses are retried
            log.warning("cannot write agent liveness: %s", exc)

    def _write_exit(self, reason: str) -> None:
        path = self.work_dir / AGENT_EXIT_FILE
        tmp = path.with_name(".tmp-" + path.name)
        tmp.write_text(json.dumps({"reason": reason, "time": time.time(), "pid": os.getpid()}))
        os.replace(tmp, path)

    def _write_unwritten(self) -> None:
        """Write the statuses an outage of the store held back, oldest first (one try each per turn)."""
        while self._unwritten:
            if not self._write_status_once(self._unwritten[0], attempts=1):
                return
            log.info("wrote the held-back status of %s", self._unwritten[0].attempt_id)
            self._unwritten.pop(0)

    def _write_status_once(self, status: AttemptStatus, attempts: int = 6) -> bool:
        """Write the final status unless one exists (written once, never overwritten), retrying a failing
        store for about 15 s; if the store stays down the trigger will call the attempt lost."""
        for i in range(attempts):
            try:
                if not self._has_status(status.attempt_id):
                    self.layout.write_status(status)
                return True
            except STORE_ERRORS as exc:
                log.warning("cannot write the status of %s (%s: %s); retrying", status.attempt_id,
                            type(exc).__name__, exc)
                if i + 1 < attempts:
                    time.sleep(0.5 * (i + 1))
        log.error("could not write the status of %s: the store is unreachable; it is written when the store "
                  "answers again", status.attempt_id)
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m airflow_spot.training.agent", description=__doc__.splitlines()[0])
    p.add_argument("--job-uri", required=True, help="the job's store (checkpoint_uri)")
    p.add_argument("--instance-id", default=None,
                   help="the id to serve as; default: ask the instance metadata service at --imds-url (EC2)")
    p.add_argument("--imds-url", default=None,
                   help="EC2 instance metadata base URL (IMDSv2): the instance id comes from it and the training "
                        "command polls it for spot notices, e.g. http://169.254.169.254")
    p.add_argument("--idle-timeout", type=float, default=300.0, help="exit after this many seconds without a request")
    p.add_argument("--work-dir", default=None, help="logs and the exit marker (default: a temporary directory)")
    p.add_argument("--notice-file", default=None, help="preemption notice file handed to commands as SPOT_NOTICE_FILE")
    p.add_argument("--poll-interval", type=float, default=0.2, help="seconds between request polls")
    p.add_argument("--term-grace", type=float, default=30.0, help="seconds a command gets after SIGTERM")
    p.add_argument("--heartbeat-seconds", type=float, default=5.0, help="seconds between liveness writes")
    p.add_argument("--handoff-wait", type=float, default=None,
                   help="seconds a warm training process waits for the next request (default: --idle-timeout)")
    p.add_argument("--boot-seconds", type=float, default=0.0, help="simulated boot time before serving")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s", stream=sys.stdout)
    if args.imds_url:
        # commands inherit the agent's environment: the session then polls the same IMDS for notices
        os.environ[E.IMDS_URL] = args.imds_url
    if args.instance_id is None:
        if not args.imds_url:
            p.error("give --instance-id, or --imds-url to learn it from the instance metadata service")
        from airflow_spot.training.notices import instance_identity

        args.instance_id, region = instance_identity(args.imds_url)
        log.info("instance metadata: this is %s in %s", args.instance_id, region)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix=f"airflow-spot-agent-{safe_id(args.instance_id)}-")
    agent = Agent(
        args.job_uri, args.instance_id, idle_timeout=args.idle_timeout, work_dir=work_dir,
        notice_file=args.notice_file, poll_interval=args.poll_interval, term_grace=args.term_grace,
        heartbeat_seconds=args.heartbeat_seconds, handoff_wait=args.handoff_wait,
    )
    agent.install_signal_handlers()
    if args.boot_seconds > 0:
        deadline = time.monotonic() + args.boot_seconds
        while time.monotonic() < deadline and not agent.stopping:
            time.sleep(min(0.1, args.boot_seconds))
    reason = agent.run()
    log.info("agent exiting: %s", reason)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
