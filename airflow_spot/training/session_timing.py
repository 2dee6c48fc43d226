"""When a :class:`~airflow_spot.training.session.SpotSession` saves, and what it tells the Airflow side: the
checkpoint interval (from the measured save cost, the job's preemptions so far and what they showed of the
notices) and the heartbeat written every tick (step, step time, ``report()``'s metrics, save cost, interval,
notice). A mixin of ``SpotSession`` (it uses the session's ``job_store``, ``layout``, ``writer``,
``notice_sources``, the interval settings (``min_interval``, ``max_interval``, ``interval_policy``,
``notice_window``, ``prior_mtbf``, ``heartbeat_seconds``), its measurements and notice fields, ``is_writer``,
``metrics``, ``_lock``, ``_hb_stop`` and ``_between_segments``)."""
from __future__ import annotations

import logging
import os
import time

from airflow_spot.policy.checkpoint_interval import (
    IntervalInputs, checkpoint_interval, estimate_mtbf, estimate_notice_coverage,
)
from airflow_spot.policy.ledger import notice_evidence
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.protocol import AttemptStatus, Heartbeat, JobLayout, Outcome

log = logging.getLogger("airflow_spot.session")


class SessionTiming:
    """Work out the checkpoint interval, and write the attempt's heartbeats."""

    def _recompute_interval(self) -> None:
        self.notice_coverage = estimate_notice_coverage(*self.notice_evidence, fits=self._save_fits_notice())
        inputs = IntervalInputs(
            save_cost_seconds=self.save_cost_ewma or 0.0,
            mtbf_seconds=self.mtbf,
            min_interval_seconds=self.min_interval,
            max_interval_seconds=self.max_interval,
            write_seconds=self.writer.last_write_seconds,
            notice_coverage=self.notice_coverage,
        )
        self.interval = checkpoint_interval(inputs, self.interval_policy)

    def _save_fits_notice(self) -> bool:
        """The session hears notices at all, and an emergency save (staging, then the write) can commit
        inside the notice window, as measured, after the slowest source's poll has seen the notice."""
        if not self.notice_sources:
            return False
        if not self.notice_window:
            return True
        seen_after = max((getattr(src, "interval", 0.0) for src in self.notice_sources), default=0.0)
        return (self.save_cost_ewma or 0.0) + self.writer.last_write_seconds + seen_after <= self.notice_window

    def _observe_preemptions(self) -> None:
        """The job's preemptions so far: the pool's MTBF (the market's prior blended with them) and what
        they showed of the notices (from the job's ledger rows)."""
        self.mtbf = self._observed_mtbf()
        try:
            self.notice_evidence = notice_evidence(LedgerStore(self.job_store).rows())
        except (OSError, ValueError) as exc:  # an unreadable ledger leaves the prior; training goes on
            log.warning("could not read the job's ledger for its notice record: %s", exc)

    def _observed_mtbf(self) -> float:
        """Blend the market's prior with the preemptions this job has seen so far."""
        preemptions, seconds = 0, 0.0
        for key in JobLayout.attempt_keys(self.job_store, JobLayout.STATUS_NAME):
            try:
                st = AttemptStatus.from_json(self.job_store.get_bytes(key))
            except (KeyError, ValueError):
                continue
            seconds += max(0.0, st.ended_at - st.started_at)
            preemptions += st.outcome in (Outcome.PREEMPTED.value, Outcome.LOST.value)
        return estimate_mtbf(self.prior_mtbf, preemptions, seconds)

    # ------------------------------------------------------------------ heartbeats
    def report(self, **metrics: float) -> None:
        """Record metrics of the current step; they ride along with the next heartbeat."""
        for k, v in metrics.items():
            self.metrics[k] = float(v)

    def _write_heartbeat(self) -> None:
        if not self.is_writer:
            return  # rank 0 speaks for the attempt
        hb = Heartbeat(
            attempt_id=self.attempt_id,
            step=self.step,
            time=time.time(),
            step_time_ewma=self.step_time_ewma,
            last_committed_step=self.writer.last_committed_step,
            metrics=dict(self.metrics),
            pid=os.getpid(),
            save_cost_seconds=self.save_cost_ewma,
            interval_seconds=self.interval,
            notice_at=self.notice_at,
            notice=self.notice,
            first_step_at=self.first_step_at,
            first_step=self.first_step,
        )
        try:
            with self._lock:
                self.layout.write_heartbeat(hb)
        except Exception as exc:  # noqa: BLE001 - a missed heartbeat must never stop training
            log.warning("heartbeat write failed (retried at the next tick): %s", exc)

    def _heartbeat_loop(self) -> None:
        # Written every tick, even when the step has not moved: silence is how the trigger spots a
        # lost instance, so a long step must not look like a dead one.
        while not self._hb_stop.wait(self.heartbeat_seconds):
            if not self._between_segments:
                self._write_heartbeat()
