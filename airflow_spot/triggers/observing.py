"""How :class:`~airflow_spot.triggers.segment.SegmentTrigger` observes its attempt, as a mixin of it.

Everything the trigger reads while it waits: opening the job's store and the backend, the store reads with
a time limit (:mod:`airflow_spot.triggers.bounded`), the shared poller's rounds with the status reads in
between, and the quick reads under a preemption notice; the result of a round is an
:class:`~airflow_spot.triggers.verdict.Observation`. Kept apart from the trigger's wait loop, events and
accounting so each reads on its own. The methods use the trigger's own attributes (set in its
``__init__``), and :meth:`_next_round` its ``_interim_read_seconds`` (in ``segment.py``, beside the count of
running triggers whose budget it shares).
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time

from airflow_spot.storage.protocol import Heartbeat, JobLayout
from airflow_spot.triggers.poller import Subscription
from airflow_spot.triggers.verdict import Observation


class ObservingMixin:
    """The reads of :class:`~airflow_spot.triggers.segment.SegmentTrigger` (see the module doc)."""

    def _read_timeout(self) -> float:
        """Seconds one store read may take before it counts as failed: a quarter of the heartbeat window, so
        a hung read (an NFS mount that stopped answering, an endpoint that black-holes packets: botocore waits
        60 s per try) is a store error, judged by the window, instead of holding the wait past every bound."""
        return self.heartbeat_timeout / 4

    async def _bounded(self, kind: str, fn, *args):
        """``fn(*args)`` in a thread, bounded by :meth:`_read_timeout` (:mod:`.bounded`: a hung read pins at most
        one thread of the default executor, which every trigger's reads, ``_release`` and ``on_kill`` share)."""
        return await self._calls.call(kind, lambda: asyncio.to_thread(fn, *args), self._read_timeout())

    async def _observe(self, layout: JobLayout, subscription: Subscription) -> Observation:
        # Instance first, store second: a status written just before the instance died is then seen.
        # The instance comes from the shared per-scope poller: one batched describe for all triggers.
        seen = await self._next_round(layout, subscription)
        if seen.error is None:  # a failed describe neither starts nor ends an absence
            if seen.known:
                if self._unknown_since is not None:
                    self.log.info("attempt %s: instance %s is known to the backend again", self.attempt_id,
                                  self.instance_id)
                self._unknown_since = None
            elif self._unknown_since is None:
                self._unknown_since = seen.at
                self.log.warning("attempt %s: instance %s is absent from the backend's describe; still waiting "
                                 "(a loss needs the cloud to say so, or heartbeats silent past %.0fs)",
                                 self.attempt_id, self.instance_id, self.heartbeat_timeout)
        store_error, failing_for = None, 0.0
        status, heartbeat = self._last_read
        # Any read failure is transient until the window says otherwise. The status on its own first: one that
        # reads is final whatever the heartbeat read does (the heartbeat then only informs the event).
        try:
            status = await self._bounded("store", layout.read_status, self.attempt_id)
        except Exception as exc:  # noqa: BLE001 - a status may be there unseen: the round is a store error
            store_error = f"status: {type(exc).__name__}: {exc}"
        else:
            try:
                heartbeat = await self._bounded("store", layout.read_heartbeat, self.attempt_id)
            except Exception as exc:  # noqa: BLE001 - the last heartbeat read stands
                if status is None:  # unknown, not absent: silence cannot be judged this round
                    store_error = f"heartbeat: {type(exc).__name__}: {exc}"
                else:
                    self.log.info("attempt %s: its heartbeat is unreadable (%s: %s); its status decides",
                                  self.attempt_id, type(exc).__name__, exc)
            self._last_read = (status, heartbeat)
        if store_error is None:
            self._store_failing_since = None
        else:
            now = time.time()
            self._store_failing_since = self._store_failing_since or now
            failing_for = now - self._store_failing_since
            self.log.warning("attempt %s: cannot read its %s for %.0fs; still waiting", self.attempt_id,
                             store_error, failing_for)
        self._log_notice(heartbeat)
        now = time.time()
        if heartbeat is not None:
            if self._beat_seen is None:
                # first sight (a new wait, a triggerer restart): as old as its own time says, within half the
                # window, so a restart neither makes a dead agent's beat fresh nor a slow clock's beat stale
                age = min(max(0.0, now - heartbeat.time), self.heartbeat_timeout / 2)
                self._beat_seen = (heartbeat.time, now - age)
            elif self._beat_seen[0] != heartbeat.time:
                self._beat_seen = (heartbeat.time, now)
            if self._step_seen is None or self._step_seen[0] != heartbeat.step:
                self._step_seen = (heartbeat.step, now)
        return Observation(
            now=now,
            status=status,
            heartbeat=heartbeat,
            instance=seen.instance,
            instance_known=seen.known,
            instance_error=seen.error,
            store_error=store_error,
            store_failing_for=failing_for,
            instance_unknown_for=0.0 if self._unknown_since is None else now - self._unknown_since,
            beat_seen_at=None if self._beat_seen is None else self._beat_seen[1],
            step_seen_at=None if self._step_seen is None else self._step_seen[1],
        )

    async def _next_round(self, layout: JobLayout, subscription: Subscription):
        """The poller's next round for this instance; or, as soon as the attempt's status object appears
        between rounds (read every :meth:`_interim_read_seconds`), the instance as the last round saw it:
        the agent's own status decides the outcome, so the describe can wait. The first round always
        comes from the poller."""
        tick = self._interim_read_seconds()
        last = self._last_seen
        if tick is None or last is None:
            seen = await subscription.next()
        else:
            pending = asyncio.ensure_future(subscription.next())
            try:
                while True:
                    done, _ = await asyncio.wait({pending}, timeout=tick)
                    if done:
                        seen = pending.result()
                        break
                    try:
                        status = await self._bounded("store", layout.read_status, self.attempt_id)
                    except Exception:  # noqa: BLE001 - the round's own read handles (and times) store errors
                        status = None
                    if status is not None:
                        seen = last
                        break
            finally:
                if not pending.done():
                    pending.cancel()  # the poller's round is shielded: other subscribers still get it
        self._last_seen = seen
        return seen

    #: under a preemption notice the status comes within seconds: read it this often, not once per poll
    NOTICE_READ_SECONDS = 0.25

    async def _await_status_after_notice(self, layout: JobLayout, obs: Observation) -> Observation:
        """The instance is under a preemption notice and its emergency save is under way: read the status
        every :attr:`NOTICE_READ_SECONDS` for up to one poll interval instead of waiting for the next round
        (the retry starts that much sooner). Store reads only: the describe stays with the shared poller."""
        deadline = time.monotonic() + self.poll_interval
        while time.monotonic() < deadline:
            await asyncio.sleep(min(self.NOTICE_READ_SECONDS, max(0.0, deadline - time.monotonic())))
            try:
                status = await self._bounded("store", layout.read_status, self.attempt_id)
            except Exception:  # noqa: BLE001 - the regular observation handles (and times) store errors
                break
            if status is not None:
                try:  # for the event's last step only: the status decides
                    heartbeat = await self._bounded("store", layout.read_heartbeat, self.attempt_id)
                except Exception:  # noqa: BLE001 - the last one read stands
                    heartbeat = None
                self._last_read = (status, heartbeat or obs.heartbeat)
                return dataclasses.replace(obs, now=time.time(), status=status, heartbeat=heartbeat or obs.heartbeat)
        return obs

    def _log_notice(self, hb: Heartbeat | None) -> None:
        """Say once in the task's log that the instance got its preemption notice (the training process
        reports it in its heartbeat: on EC2 only the instance can read ``spot/instance-action``)."""
        if hb is None or hb.notice_at is None or self._notice_logged:
            return
        self._notice_logged = True
        saved = hb.last_committed_step is not None and hb.last_committed_step >= hb.step
        self.log.warning(
            "attempt %s: instance %s got a preemption notice at %s (%s), %.1fs ago; %s", self.attempt_id,
            self.instance_id, time.strftime("%H:%M:%S", time.gmtime(hb.notice_at)) + " UTC", hb.notice or "notice",
            time.time() - hb.notice_at,
            f"emergency checkpoint committed at step {hb.step}" if saved else
            f"emergency checkpoint of step {hb.step} being saved (last committed {hb.last_committed_step})")

    async def _open(self, hook):
        """The job's store and the backend: (store, backend, None), or what opened and why the rest did not.

        Building them may read an Airflow connection (off the event loop): in the triggerer through the
        supervisor and the API server, where a blip or a slow secrets backend raises. Like a store read, a
        failure is retried (with a growing, jittered delay: a triggerer restart retries all its triggers at
        once) until it has lasted past the heartbeat window; an error escaping ``run()`` would fail the try."""
        store = backend = None
        started = time.monotonic()
        delay = min(self.poll_interval, self._read_timeout())
        while True:
            try:
                if store is None:
                    store = await self._bounded("open", hook.get_store, self.job_uri)
                if backend is None:
                    backend = await self._bounded("open", hook.get_backend)
                return store, backend, None
            except Exception as exc:  # noqa: BLE001 - transient until the window says otherwise
                error = f"{type(exc).__name__}: {exc}"
                failing_for = time.monotonic() - started
                what = "store" if store is None else "backend"
                if failing_for + delay > self.heartbeat_timeout:
                    return store, backend, (
                        f"could not open the job's {what} for {failing_for:.0f}s (window "
                        f"{self.heartbeat_timeout:.0f}s): {error}")
                self.log.warning("attempt %s: cannot open the job's %s (%s); retrying in %.1fs", self.attempt_id,
                                 what, error, delay)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(2 * delay, self._read_timeout())
