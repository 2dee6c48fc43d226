"""``SpotSession``: the API a training script uses to survive preemptions.

    with SpotSession.from_env(total_steps=1000) as spot:
        spot.track(model=model, optimizer=opt, scheduler=sched, sampler=sampler)   # restores if saved
        for step in spot.steps():
            ...                                   # one training step
            spot.report(loss=loss.item())

Between steps the session takes periodic saves at the interval the checkpoint policy gives (staged to
host memory, written in the background), an insurance save when risk rises, and on a preemption notice
an emergency save, after which the process exits with ``PREEMPTED_EXIT_CODE``. At the end of the segment
it commits a checkpoint at ``end_step`` and the ``with`` block ends normally.

**Warm process.** Under the agent, ``steps()`` does not necessarily end at ``end_step``: after committing
the end checkpoint it tells the agent "segment done" and waits for the next segment of the job on the
same instance; when one comes it keeps yielding steps from the in-memory state (no restore) under the new
attempt id (``spot.attempt_id``, ``spot.end_step`` and the ``SPOT_*`` variables are updated). Only when no
compatible segment follows (or it was the job's last) does ``steps()`` return, so code after the loop
runs once per *process*, not once per segment. A script that does per-segment work after its loop opts
out with ``SpotSession.from_env(..., warm_process=False)`` (or the operator's ``warm_process=False``, or
``SPOT_WARM_PROCESS=0`` in the request's env). See :mod:`airflow_spot.training.handoff`.
"""
from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from airflow_spot.storage.checkpoint import CheckpointStore, save_block_bytes
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import PREEMPTED_EXIT_CODE, JobLayout
from airflow_spot.training import env as E
from airflow_spot.training.async_save import AsyncCheckpointer
from airflow_spot.training.handoff import ANSWER_GRACE_SECONDS, HandoffDir
from airflow_spot.training.payload import save_payload
from airflow_spot.training.ranks import Ranks
from airflow_spot.training.notices import (
    PREEMPTION,
    REBALANCE,
    FileNotice,
    ImdsNotice,
    NoticeSource,
    SigtermNotice,
)
from airflow_spot.training.session_handoff import SessionHandoff
from airflow_spot.training.session_restore import SessionRestore
from airflow_spot.training.session_timing import SessionTiming
from airflow_spot.training.sharded import ShardedObjects
from airflow_spot.training.state import Stager, capture_rng

log = logging.getLogger("airflow_spot.session")

DEFAULT_MTBF_SECONDS = 3 * 3600.0  # measured on the bundled AWS V100 traces: 3.0-4.3 h
EWMA_ALPHA = 0.1


class SpotSession(SessionHandoff, SessionRestore, SessionTiming):
    """One segment of one job, as seen from inside the training process.

    :param job_uri: the job's root in the object store (``file://`` or ``s3://``).
    :param end_step: exclusive end of this segment; a checkpoint at ``end_step`` is committed on reaching it.
    :param start_step: where the segment was planned to start (the session resumes from the newest
        committed checkpoint, which may be further along after an emergency save).
    :param attempt_id: identity of this attempt: heartbeat key and checkpoint writer name.
    :param notice_sources: defaults to SIGTERM only.
    :param mtbf_seconds: prior mean time between preemptions of the pool (market data).
    :param min_interval_seconds: floor of the checkpoint interval.
    :param max_interval_seconds: ceiling of the checkpoint interval.
    :param keep: committed checkpoints to keep.
    :param interval_policy: name of a checkpoint-interval policy (daly, young, fixed).
    :param notice_window_seconds: the backend's preemption notice window (None: unknown). An emergency
        save that cannot commit inside it covers nothing, so the interval then insures every preemption.
    :param heartbeat_seconds: at most one heartbeat write per this many seconds.
    :param warm_start_uri: another job's root whose newest checkpoint seeds this job's tracked objects
        (``warm_start_keys``) when this job has no checkpoint yet; steps then count from 0.
    :param total_steps: length of the whole job; a segment ending there never waits for a next one.
    :param handoff_dir: the agent's hand-off directory for this process (``SPOT_HANDOFF_DIR``); None
        means the process ends with its segment.
    :param handoff_wait: seconds to wait there for the next segment before ending.
    :param warm_process: False opts out of the warm process: ``steps()`` always returns at ``end_step``
        (for scripts that do per-segment work after their loop).
    :param ranks: the processes of a data parallel attempt (``torchrun``); ``"auto"`` takes them from
        ``torch.distributed`` when it is initialised with more than one process (see :mod:`.ranks`).
    :param outcome_file: where the session records that it ended the attempt for a preemption (``torchrun``
        and shell wrappers do not pass exit code 75 on); the agent reads it.
    """

    def __init__(
        self,
        job_uri: str,
        end_step: int,
        *,
        start_step: int = 0,
        attempt_id: str = "manual",
        notice_sources: list[NoticeSource] | None = None,
        mtbf_seconds: float | None = None,
        min_interval_seconds: float = 30.0,
        max_interval_seconds: float = 3600.0,
        keep: int = 3,
        interval_policy: str | None = None,
        notice_window_seconds: float | None = None,
        heartbeat_seconds: float = 2.0,
        warm_start_uri: str | None = None,
        warm_start_keys: tuple[str, ...] = ("model",),
        total_steps: int | None = None,
        handoff_dir: str | None = None,
        handoff_wait: float = 300.0 + ANSWER_GRACE_SECONDS,
        warm_process: bool = True,
        ranks: Ranks | None | str = "auto",
        outcome_file: str | None = None,
    ) -> None:
        if end_step < 1 or start_step < 0 or start_step >= end_step:
            raise ValueError(f"need 0 <= start_step < end_step, got start={start_step}, end={end_step}")
        self.job_store = open_store(job_uri)
        self.layout = JobLayout(self.job_store)
        self.checkpoints = CheckpointStore(self.job_store.child(JobLayout.CHECKPOINTS), writer=attempt_id)
        save_block_bytes()  # a bad digest setting fails now, not at the first save
        self.writer = AsyncCheckpointer(self.checkpoints, save_payload, keep=keep)
        self.start_step, self.end_step, self.attempt_id = start_step, end_step, attempt_id
        self.notice_sources = notice_sources if notice_sources is not None else [SigtermNotice()]
        self.prior_mtbf = mtbf_seconds or DEFAULT_MTBF_SECONDS
        self.min_interval, self.max_interval = min_interval_seconds, max_interval_seconds
        self.interval_policy = interval_policy
        self.notice_window = notice_window_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.warm_start_uri, self.warm_start_keys = warm_start_uri, warm_start_keys
        self.total_steps = total_steps
        self.ranks: Ranks | None = Ranks.detect() if ranks == "auto" else ranks  # type: ignore[assignment]
        #: this process writes the attempt's checkpoints and heartbeats (rank 0, or the only process)
        self.is_writer = self.ranks is None or self.ranks.writer
        if self.ranks is not None and handoff_dir and warm_process:
            log.info("%d ranks: each segment ends its processes (a warm process is one process)",
                     self.ranks.world_size)
        self.handoff = HandoffDir(handoff_dir) if handoff_dir and warm_process and self.ranks is None else None
        self.outcome_file = outcome_file
        self.handoff_wait = float(handoff_wait)
        self.segments = 1  # segments this process has trained (more than one when kept warm)

        self.tracked: dict[str, Any] = {}
        #: the tracked objects whose state is sharded (FSDP): saved and restored through DCP (see :mod:`.sharded`)
        self.sharded = ShardedObjects(self.ranks)
        self._warned: set[str] = set()  # bit-exactness warnings already logged
        self.stager = Stager()
        self.step = 0
        self.restored_step: int | None = None
        self.metrics: dict[str, float] = {}
        self.step_time_ewma: float | None = None
        #: wall time this attempt finished its first step, and that step (its start-up ends there)
        self.first_step_at: float | None = None
        self.first_step: int | None = None
        self.save_cost_ewma: float | None = None  # seconds training stalls per save (staging)
        self.interval = float(min_interval_seconds)
        self.mtbf = self.prior_mtbf
        #: the job's preemptions so far: (notice covered them, notice missed or the save lost steps)
        self.notice_evidence = (0, 0)
        self.notice_coverage = 0.0
        self.saves = {"periodic": 0, "insurance": 0, "emergency": 0, "final": 0}
        self.notice: str | None = None  # detail of the preemption notice, once seen
        self.notice_at: float | None = None  # wall-clock time it was seen (rides along with heartbeats)
        self._insurance = False
        self._lock = threading.Lock()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._between_segments = False
        self._last_save_at = time.monotonic()
        self._entered = False  # inside the ``with`` block: notices are heard, heartbeats written
        self._stepping = False  # inside the loop's body: the current step is not done yet
        self._save_requested = False  # save() called in the body: taken once the step is done
        self._saved_step: int | None = None  # the step of the last save started (the same on every rank)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, *, total_steps: int | None = None, job_uri: str | None = None, **kwargs) -> SpotSession:
        """Build the session from the agent's ``SPOT_*`` variables (see ``training/env.py``).

        Run by hand without them, the script trains ``total_steps`` steps with checkpoints in ``job_uri``
        (default ``./spot-job``), which is handy for trying a script before scheduling it.
        """
        e = os.environ
        end = int(e[E.END_STEP]) if E.END_STEP in e else total_steps
        if end is None:
            raise ValueError(f"{E.END_STEP} is not set: pass total_steps= when running outside airflow-spot")
        if E.END_STEP not in e:
            try:  # an int or an integer type (numpy's), not a float or a bool
                end = operator.index(end) if not isinstance(end, bool) else None
            except TypeError:
                end = None
            if end is None or end < 1:
                raise ValueError(f"total_steps must be a positive number of training steps, got {total_steps!r}")
        sources: list[NoticeSource] = [SigtermNotice()]
        poll = float(e.get(E.NOTICE_POLL_SECONDS, "0") or 0)
        if e.get(E.NOTICE_FILE):
            sources.append(FileNotice(e[E.NOTICE_FILE], interval=poll or 0.1))
        if e.get(E.IMDS_URL):
            sources.append(ImdsNotice(e[E.IMDS_URL], interval=poll or 1.0))

        def num(name: str, default: float | None) -> float | None:
            if not e.get(name):
                return default
            try:
                return float(e[name])
            except ValueError:
                raise ValueError(f"{name}={e[name]!r} is not a number of seconds; set it to e.g. 120, "
                                 "or unset it for the default") from None

        opts = dict(
            start_step=int(e.get(E.START_STEP, "0")),
            attempt_id=e.get(E.ATTEMPT_ID, "manual"),
            notice_sources=sources,
            mtbf_seconds=num(E.MTBF_SECONDS, None),
            min_interval_seconds=num(E.CKPT_MIN_INTERVAL, 30.0),
            max_interval_seconds=num(E.CKPT_MAX_INTERVAL, 3600.0),
            keep=int(e.get(E.CKPT_KEEP, "3")),
            interval_policy=e.get(E.CKPT_POLICY) or None,
            notice_window_seconds=num(E.NOTICE_WINDOW_SECONDS, None),
            heartbeat_seconds=num(E.HEARTBEAT_SECONDS, 2.0),
            warm_start_uri=e.get(E.WARM_START_URI) or None,
            total_steps=int(e[E.TOTAL_STEPS]) if e.get(E.TOTAL_STEPS) else total_steps,
            handoff_dir=e.get(E.HANDOFF_DIR) or None,
            handoff_wait=num(E.HANDOFF_WAIT, 300.0 + ANSWER_GRACE_SECONDS),
            outcome_file=e.get(E.OUTCOME_FILE) or None,
        )
        opts.update(kwargs)
        return cls(e.get(E.JOB_URI) or job_uri or os.path.abspath("spot-job"), end, **opts)

    def __enter__(self) -> SpotSession:
        self._entered = True
        for src in self.notice_sources:
            src.start(self._on_notice)
        self._observe_preemptions()
        if self.is_writer:
            self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="spot-heartbeat", daemon=True)
            self._hb_thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._entered = False
        for src in self.notice_sources:
            src.stop()
        try:
            self.writer.close()
        finally:
            self._hb_stop.set()
            if self._hb_thread is not None:
                self._hb_thread.join(timeout=self.heartbeat_seconds + 5)
            self._write_heartbeat()

    # ------------------------------------------------------------------ notices
    def _on_notice(self, kind: str, detail: str) -> None:
        if kind == PREEMPTION and self.notice is None:
            self.notice = detail or "preemption notice"
            self.notice_at = time.time()
            log.warning("preemption notice: %s; saving at the end of this step", self.notice)
        elif kind == REBALANCE:
            log.warning("rebalance recommendation: taking an insurance checkpoint")
            self._insurance = True

    @property
    def preempted(self) -> bool:
        return self.notice is not None

    # ------------------------------------------------------------------ state
    def track(self, **objects: Any) -> int:
        """Register objects with ``state_dict``/``load_state_dict`` (model, optimizer, LR scheduler,
        grad scaler, sampler, :class:`~airflow_spot.training.data.ResumableLoader`, ...) and restore them
        from the newest valid checkpoint. Also accepted: RNG objects (``torch.Generator``, numpy
        generators, ``random.Random``) and a plain ``DataLoader`` (see
        :func:`~airflow_spot.training.data.adopt_data_loader`). Feeding that cannot resume bit-exactly is
        reported once, as a warning, here.

        Objects are restored when tracked before ``steps()`` begins (each call restores the objects it is
        given). One tracked once the loop runs (an EMA model, a second optimizer) is only registered: it is
        saved from the next checkpoint on, and the live state is never rolled back to an older checkpoint.

        Returns the step training resumes from.
        """
        objects = self._checkpointable(objects)
        self.sharded.classify(objects, {**self.tracked, **objects})
        self.tracked.update(objects)
        if self._stepping or self.first_step_at is not None or self.segments > 1:
            for name in objects:
                log.warning("%s tracked after steps() began: saved from the next checkpoint on, not restored now; a "
                            "resumed run restores it only if the script tracks it before steps()", name)
        else:
            self._restore(objects)
        # Allocate the staging buffers before training starts (fresh pages fault in several times slower
        # than a copy); optimizer state that appears only after the first step is allocated at first save.
        # Only the writer stages: under several ranks the others would hold copies (pinned) never used.
        for name, obj in objects.items() if self.is_writer else ():
            if name not in self.sharded:  # DCP saves those from the live state, on every rank
                self.stager.stage(obj.state_dict(), (name,))
        return self.step

    def _stage(self) -> tuple[dict | None, float]:
        """The state to save, staged to host memory (None on ranks other than 0, which send rank 0 their
        random state and tracked random generators: data parallel ranks hold the same model and optimizer,
        not the same random streams)."""
        from airflow_spot.training.data import GeneratorState

        started = time.monotonic()
        rng = capture_rng()
        per_rank = None
        if self.ranks is not None:
            own = {"rng": rng, "objects": {name: obj.state_dict() for name, obj in self.tracked.items()
                                           if isinstance(obj, GeneratorState)}}
            per_rank = self.ranks.to_writer(own)
        if not self.is_writer:
            return None, 0.0
        staged = {
            "objects": {name: self.stager.stage(obj.state_dict(), (name,)) for name, obj in self.tracked.items()
                        if name not in self.sharded},
            "rng": rng,
            "step": self.step,
        }
        if per_rank is not None:
            staged["rank_state"] = per_rank
        stall = time.monotonic() - started
        if not self.sharded:  # a sharded save's stall also stages the shards: _save measures that
            self._count_stall(stall)
        return staged, stall

    def _count_stall(self, stall: float) -> None:
        self.save_cost_ewma = stall if self.save_cost_ewma is None else (
            (1 - EWMA_ALPHA) * self.save_cost_ewma + EWMA_ALPHA * stall
        )

    def _meta(self, reason: str) -> dict:
        return {"reason": reason, "attempt": self.attempt_id, "metrics": dict(self.metrics)}

    def _save(self, reason: str, wait: bool) -> bool:
        if not wait and self.writer.busy:
            return False  # coalesced: try again after the next step
        # The stager reuses its buffers, so the previous write must be finished before staging again.
        self.writer.wait()
        started = time.monotonic()
        staged, _ = self._stage()
        try:
            if self.sharded:  # every rank writes its shards; a periodic save in the background, after staging them
                if self.sharded.save(self.checkpoints, self.writer, self.step, staged, self._meta(reason), not wait):
                    self._count_stall(time.monotonic() - started)  # the foreground part only
            elif staged is None:
                pass  # a rank other than 0: rank 0 writes
            elif wait:
                self.writer.save_sync(self.step, staged, self._meta(reason))
            else:
                self.writer.save_async(self.step, staged, self._meta(reason))
        finally:
            if wait and self.ranks is not None:
                self.ranks.barrier()  # no rank goes on (or exits) before the checkpoint is committed
        self.saves[reason] += 1
        self._saved_step = self.step
        self._last_save_at = time.monotonic()
        self._recompute_interval()
        return True

    def save(self) -> None:
        """Commit a checkpoint of the current state (blocking). Called in the loop's body, it is taken once
        the current step is done (the checkpoint at step N holds the state after N steps, so a resume never
        runs a step twice), before the next one starts. Under several ranks, a save asked for in the body by
        any rank is taken by all; outside the loop every rank must call it (the save is collective)."""
        if not self.tracked:
            raise RuntimeError("call spot.track(model=..., optimizer=...) before spot.save(): nothing is tracked, "
                               "and an empty checkpoint would be what every later attempt restores")
        if self._stepping:
            self._save_requested = True
            return
        self._save("final", wait=True)

    # ------------------------------------------------------------------ the loop
    def steps(self) -> Iterator[int]:
        """Yield this segment's remaining steps, and those of the segments handed to this warm process
        after it; handles saves between them (see module doc)."""
        if not self.tracked:
            raise RuntimeError("call spot.track(model=..., optimizer=...) before spot.steps()")
        if not self._entered:
            raise RuntimeError("iterate spot.steps() inside `with SpotSession.from_env(...) as spot:`: only there "
                               "are preemption notices heard (the emergency save) and heartbeats written")
        while True:
            yield from self._segment_steps()
            if not self._next_segment():
                return

    def _segment_steps(self) -> Iterator[int]:
        while self.step < self.end_step:
            self._between_steps()
            last = time.monotonic()  # the step's time leaves the saves out
            self._stepping = True
            try:
                yield self.step
            except GeneratorExit:  # the body left the loop (break, return, an exception)
                self._stepping = False
                requested, self._save_requested = self._save_requested, False
                if self.ranks is not None:
                    requested = self._leave_together(requested)
                if requested:  # asked for in the body: the step is done
                    self.step += 1
                    self._save("final", wait=True)
                raise
            self._stepping = False
            self.step += 1
            if self.first_step_at is None:
                self.first_step_at, self.first_step = time.time(), self.step
            dt = time.monotonic() - last
            self.step_time_ewma = dt if self.step_time_ewma is None else (
                (1 - EWMA_ALPHA) * self.step_time_ewma + EWMA_ALPHA * dt
            )
        if not self._committed_at_step():  # a save the body asked for at the last step is this one
            self._save_requested = False
            self._save("final", wait=True)
        self._write_heartbeat()

    def _between_steps(self) -> None:
        """Before each step: the save the loop's body asked for, the emergency exit on a notice, else an
        insurance or periodic save that came due. Under several ranks every rank acts on the same flags,
        agreed in one all-reduce: saves are collective, and a rank that left for its emergency save while
        the others stepped on would hang them."""
        requested, self._save_requested = self._save_requested, False
        notice, insurance = self.notice is not None, self._insurance
        periodic = time.monotonic() - self._last_save_at >= self.interval
        busy = self.writer.busy  # a periodic save still writing: the next one waits (coalesced)
        if self.ranks is not None:
            if not self.ranks.writer:  # the writer's clock decides; busy is any rank's (each writes its shards)
                periodic = False
            notice, requested, insurance, periodic, busy, leaving, _ = self.ranks.agree(
                notice, requested, insurance, periodic, busy, False, True)
            if leaving:  # waiting for that rank in the next collective would hang this one until the timeout
                raise RuntimeError("another rank left the training loop (an exception or a break on that rank: its "
                                   "log says which) while this one went on; ending this rank too")
            if notice and self.notice is None:
                self.notice, self.notice_at = "preemption notice (heard by another rank)", time.time()
                log.warning("%s; saving at the end of this step", self.notice)
        if requested:
            self._save("final", wait=True)
        if notice:
            self._emergency_exit()
        if busy or self.step in (self.restored_step, self._saved_step, self.start_step):
            return  # nothing new to save before the first step, or right after a save
        if insurance:
            self._save("insurance", wait=False)
            self._insurance = False
        elif periodic:
            self._save("periodic", wait=False)

    def _leave_together(self, requested: bool) -> bool:
        """A rank leaves the loop: it tells the others in the same all-reduce as :meth:`_between_steps` (a
        rank that goes on ends too, rather than wait for this one). Whether to take the save the body asked
        for: only when every rank leaves (a save is collective)."""
        _, requested, _, _, _, _, staying = self.ranks.agree(False, requested, False, False, False, True, False)
        if staying and requested:
            log.error("this rank left the training loop while another went on: the save asked for at step %d is "
                      "not taken (a save needs every rank)", self.step + 1)
        return requested and not staying

    def _committed_at_step(self) -> bool:
        """The state at this step is committed already (saved, or restored from there): rank 0's word."""
        self.writer.wait()
        done = self.step in (self.writer.last_committed_step, self.restored_step)
        return done if self.ranks is None else bool(self.ranks.from_writer(done))

    def _emergency_exit(self) -> None:
        started = time.monotonic()
        self._write_heartbeat()  # the notice reaches the Airflow side now, not after the save
        # before the save: once the ranks leave, a launcher may end rank 0 before it gets further
        self._record_preempted()
        try:
            if not self._committed_at_step():
                self._save("emergency", wait=True)
        except Exception as exc:  # noqa: BLE001 - the instance is going either way: still a preemption
            # A save that could not commit (the store refused it, the disk filled) leaves the committed
            # checkpoints as they were; failing the attempt as the user's code would spend the code-retry
            # budget and wait retry_delay for what is the instance being reclaimed.
            log.error(
                "emergency checkpoint at step %d failed (%s: %s); the next attempt resumes from step %s; "
                "exiting with code %d", self.step, type(exc).__name__, exc, self.writer.last_committed_step,
                PREEMPTED_EXIT_CODE,
            )
            raise SystemExit(PREEMPTED_EXIT_CODE) from exc
        log.warning(
            "emergency checkpoint at step %d committed in %.2fs; exiting with code %d",
            self.step, time.monotonic() - started, PREEMPTED_EXIT_CODE,
        )
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _record_preempted(self) -> None:
        """Tell the agent this attempt ended for a preemption, for launchers that do not pass exit code 75
        on (``torchrun`` exits 1 when its workers exit 75; ``bash train.sh`` may exit with its own code)."""
        if self.outcome_file and self.is_writer:
            try:
                with open(self.outcome_file, "w") as f:
                    f.write(f"preempted {self.attempt_id}\n")
            except OSError as exc:  # the exit code still says it where nothing wraps the process
                log.warning("cannot record the preemption in %s: %s", self.outcome_file, exc)
