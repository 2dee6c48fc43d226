"""The warm process: after a segment's end checkpoint a :class:`~airflow_spot.training.session.SpotSession` under
the agent offers its process for the job's next segment and, when one is handed over, becomes that attempt
with its state in memory (no restore). A mixin of ``SpotSession`` (it uses the session's ``handoff``,
``writer``, ``notice``, the interval settings and the heartbeat); the protocol is
:mod:`airflow_spot.training.handoff`'s."""
from __future__ import annotations

import logging
import os
import time

from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.protocol import PREEMPTED_EXIT_CODE, JobLayout
from airflow_spot.training import env as E
from airflow_spot.training.handoff import CONTINUE

log = logging.getLogger("airflow_spot.session")


class SessionHandoff:
    """Offer this process for the next segment, and adopt the one handed over."""

    def _next_segment(self) -> bool:
        """After the end checkpoint: offer this process to the agent for the job's next segment.

        Returns True when a segment was handed over (the session now is that attempt), False when the
        process should end. A notice while waiting exits with ``PREEMPTED_EXIT_CODE``: the state is
        committed, and no attempt is running in this process, so nothing is lost or mis-attributed.
        """
        if self.handoff is None or self.notice is not None:
            return False
        if self.total_steps is not None and self.step >= self.total_steps:
            return False
        done = self.attempt_id
        try:
            self.handoff.write_done(done, self.step)
        except OSError as exc:  # no hand-off, then: the agent sees a plain exit 0, as without it
            log.warning("cannot offer this process for the next segment (%s); ending", exc)
            return False
        log.info("segment done at step %d; waiting up to %.0f s for the next segment", self.step, self.handoff_wait)
        self._between_segments = True  # the finished attempt's heartbeat stops: it is not running any more
        try:
            answer = self.handoff.wait_answer(done, self.handoff_wait, lambda: self.notice is not None)
        finally:
            self._between_segments = False
        if self.notice is not None:
            log.warning("preemption notice between segments (%s): state is committed at step %d; exiting with "
                        "code %d", self.notice, self.step, PREEMPTED_EXIT_CODE)
            self._record_preempted()
            raise SystemExit(PREEMPTED_EXIT_CODE)
        if answer is None or answer.get("action") != CONTINUE:
            log.info("no next segment for this process (%s); ending",
                     "timeout" if answer is None else "the agent said exit")
            return False
        self.handoff.write_ack(str(answer["attempt_id"]))
        self._adopt(answer)
        return True

    def _adopt(self, answer: dict) -> None:
        """Become the attempt the agent handed over: new id, range and SPOT_* values; state stays."""
        spot_env = {str(k): str(v) for k, v in (answer.get("spot_env") or {}).items()}
        for name in [k for k in os.environ if k.startswith("SPOT_") and k not in spot_env]:
            del os.environ[name]
        os.environ.update(spot_env)  # code that reads SPOT_* sees the current segment
        self.writer.wait()
        self.attempt_id = str(answer["attempt_id"])
        self.first_step_at = self.first_step = None  # the new attempt's start-up ends at its first step
        self.start_step, self.end_step = int(answer["start_step"]), int(answer["end_step"])
        self.checkpoints = CheckpointStore(self.job_store.child(JobLayout.CHECKPOINTS), writer=self.attempt_id)
        self.writer.checkpoints = self.checkpoints
        if spot_env.get(E.CKPT_KEEP):
            self.writer.keep = int(spot_env[E.CKPT_KEEP])
        if spot_env.get(E.MTBF_SECONDS):
            self.prior_mtbf = float(spot_env[E.MTBF_SECONDS])
        if spot_env.get(E.CKPT_MIN_INTERVAL):
            self.min_interval = float(spot_env[E.CKPT_MIN_INTERVAL])
        if spot_env.get(E.CKPT_MAX_INTERVAL):
            self.max_interval = float(spot_env[E.CKPT_MAX_INTERVAL])
        if spot_env.get(E.NOTICE_WINDOW_SECONDS):
            self.notice_window = float(spot_env[E.NOTICE_WINDOW_SECONDS])
        if spot_env.get(E.TOTAL_STEPS):
            self.total_steps = int(spot_env[E.TOTAL_STEPS])
        if spot_env.get(E.HANDOFF_WAIT):
            self.handoff_wait = float(spot_env[E.HANDOFF_WAIT])
        self._observe_preemptions()
        self._recompute_interval()
        self._last_save_at = time.monotonic()  # the state is committed at this very step
        self.segments += 1
        self._write_heartbeat()  # the new attempt's first heartbeat, without waiting for the tick
        log.info("continuing in this process as attempt %s: steps [%d, %d) from step %d (no restore)",
                 self.attempt_id, self.start_step, self.end_step, self.step)
