"""``SegmentTrigger``: waits in the triggerer for one attempt of one segment to end.

It holds no state of its own: every poll reads the attempt's status and heartbeat objects from the job's
store and the instance from the backend, so a trigger recreated from its kwargs after a triggerer restart
picks the attempt up where it stands. It yields exactly one event, ``status`` being one of

* ``completed`` / ``preempted`` / ``failed``: the agent's final status object says so;
* ``preempted``: the instance was reclaimed by the market before the agent could write a status;
* ``lost``: the instance is gone for another reason, or neither heartbeat nor agent progress was seen
  within the timeout, or the attempt ran past ``max_attempt_seconds``. One failed or incomplete describe,
  or one failed store read, never decides: an instance absent from the backend's answers, or a store that
  cannot be read, ends the attempt only after lasting past the heartbeat window.

With ``end_from_trigger`` (what the operator asks for when it defers), a ``completed`` attempt whose
checkpoint reached ``end_step`` is accounted for here (:mod:`airflow_spot.triggers.completion`) and the
task ends from the triggerer with a ``TaskSuccessEvent`` carrying the XComs ``execute_complete`` would
push: no worker round trip at a segment boundary. Anything else (and any error while accounting) goes
back to the worker as before.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from airflow.triggers.base import BaseTrigger, TaskSuccessEvent, TriggerEvent

from airflow_spot.backends.base import InstanceInfo, InstanceState, TerminationReason
from airflow_spot.storage.protocol import AttemptStatus, Heartbeat, JobLayout, LivePrice, Outcome
from airflow_spot.storage.read_cache import CachedReads, ReadCache
from airflow_spot.triggers.bounded import BoundedCalls
from airflow_spot.triggers.poller import Subscription, subscribe

#: SpotHooks shared by the triggers of this process (see SegmentTrigger._hook):
#: (backend, backend options, connection id, market options) -> hook
_HOOKS: dict[tuple[str, str, str | None, str], Any] = {}

#: threads that account for completed attempts in the triggerer (see SegmentTrigger._complete_here)
ACCOUNTING_THREADS = 4
_ACCOUNTING_POOL = None


def _accounting_pool():
    global _ACCOUNTING_POOL
    if _ACCOUNTING_POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _ACCOUNTING_POOL = ThreadPoolExecutor(ACCOUNTING_THREADS, thread_name_prefix="airflow-spot-accounting")
    return _ACCOUNTING_POOL

#: How often a waiting trigger prices its running attempt so far from the market's price history (the job
#: page's and the progress line's live cost); spot prices move a few times a day at most, and each read is
#: one DescribeSpotPriceHistory call
LIVE_PRICE_EVERY_SECONDS = 900.0
#: the live-price reads' own threads (apart from the accounting's: a throttled read must not delay a segment
#: boundary), and the default stall timeout (a trigger that was not given one applies it)
LIVE_PRICE_THREADS = 2
_LIVE_PRICE_POOL = None
DEFAULT_STALL_TIMEOUT = 3600.0


def _live_price_pool():
    global _LIVE_PRICE_POOL
    if _LIVE_PRICE_POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _LIVE_PRICE_POOL = ThreadPoolExecutor(LIVE_PRICE_THREADS, thread_name_prefix="airflow-spot-live-price")
    return _LIVE_PRICE_POOL

#: Between the describe rounds a trigger reads its attempt's status object every so often, so an attempt
#: that ended is seen within about a second instead of up to one poll interval later (each second is the
#: retry's, or the next segment's). The reads of all triggers of this process share a budget: with many
#: deferred segments the interval grows with their number and, past the poll interval, stops (a thousand
#: segments on S3 would otherwise cost a thousand GETs a second).
INTERIM_READ_MIN_SECONDS = 1.0
INTERIM_READS_PER_SECOND = 50.0

#: the progress lines' reads of the triggerer's jobs, kept while unchanged: a line reads the job's listings and
#: what was written since the last one, not every attempt's records again (``storage/read_cache.py``)
PROGRESS_READS = ReadCache(max_bytes=32 * 1024 * 1024)

#: triggers running in this process (the interim reads' budget is shared among them)
_RUNNING = 0

#: keys every event carries (``execute_complete`` validates them)
EVENT_KEYS = ("status", "attempt_id", "instance_id", "message")


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


class SegmentTrigger(BaseTrigger):
    """Poll one attempt until it ends; bounded by ``max_attempt_seconds`` and the timeouts.

    :param job_uri: the job's root in the store.
    :param attempt_id: the attempt to watch.
    :param instance_id: the instance running it.
    :param requested_at: wall-clock time the segment request was written.
    :param backend: backend name; ``backend_options`` its JSON kwargs.
    :param aws_conn_id: connection for ``s3://`` stores.
    :param poll_interval: seconds between polls.
    :param startup_timeout: seconds to wait for the first heartbeat (instance boot + command start).
    :param heartbeat_timeout: seconds of heartbeat silence after which the attempt is lost.
    :param max_attempt_seconds: hard bound on the whole attempt.
    :param stall_timeout: seconds a heartbeating attempt may stay at one step before it is lost (None: off;
        see :func:`classify`).
    :param end_from_trigger: end the task here when the attempt completed (see the module doc).
    :param segment_index: the segment's index (for the summary when ending here).
    :param end_step: the segment's end; ending here needs a checkpoint at or past it.
    """

    def __init__(
        self,
        *,
        job_uri: str,
        attempt_id: str,
        instance_id: str,
        requested_at: float,
        backend: str = "local",
        backend_options: dict[str, Any] | None = None,
        aws_conn_id: str | None = "aws_default",
        market_options: dict[str, Any] | None = None,
        poll_interval: float = 5.0,
        startup_timeout: float = 900.0,
        heartbeat_timeout: float = 300.0,
        max_attempt_seconds: float = 7 * 24 * 3600.0,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
        end_from_trigger: bool = False,
        segment_index: int = 0,
        end_step: int | None = None,
        **newer: Any,
    ) -> None:
        super().__init__()
        if newer:
            # serialised by a newer version (a rolling upgrade reaches workers before this triggerer): waiting
            # without them beats failing the try; they are options this version does not have
            self.log.warning("trigger arguments %s are from a newer airflow-spot; ignored until this triggerer "
                             "is upgraded", sorted(newer))
        self.job_uri = job_uri
        self.attempt_id = attempt_id
        self.instance_id = instance_id
        self.requested_at = float(requested_at)
        self.backend = backend
        self.backend_options = dict(backend_options or {})
        self.aws_conn_id = aws_conn_id
        #: None: serialised by a version that did not carry them (its attempts keep their launch price)
        self.market_options = None if market_options is None else dict(market_options)
        self.poll_interval = float(poll_interval)
        self.startup_timeout = float(startup_timeout)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.max_attempt_seconds = float(max_attempt_seconds)
        self.stall_timeout = None if stall_timeout is None else float(stall_timeout)
        self.end_from_trigger = bool(end_from_trigger)
        self.segment_index = int(segment_index)
        self.end_step = None if end_step is None else int(end_step)
        #: last status/heartbeat read and since when reads fail (kept across polls of one run only)
        self._last_read: tuple[AttemptStatus | None, Heartbeat | None] = (None, None)
        self._store_failing_since: float | None = None
        #: store reads (and the store's and backend's opening) with a time limit
        self._calls = BoundedCalls()
        #: when the instance was first absent from a describe that answered (None: known, or not yet asked)
        self._unknown_since: float | None = None
        self._notice_logged = False
        #: the poller's last round for this instance (an ended attempt seen between rounds reuses it)
        self._last_seen = None
        #: (heartbeat time, when first read) and (step, when first read), by this trigger's clock
        self._beat_seen: tuple[float, float] | None = None
        self._step_seen: tuple[int, float] | None = None
        #: the live price's last read (monotonic), the read in flight, and the $/h last written
        self._price_read_at: float | None = None
        self._price_read = None
        self._live_price: float | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "job_uri": self.job_uri,
                "attempt_id": self.attempt_id,
                "instance_id": self.instance_id,
                "requested_at": self.requested_at,
                "backend": self.backend,
                "backend_options": self.backend_options,
                "aws_conn_id": self.aws_conn_id,
                "market_options": self.market_options,
                "poll_interval": self.poll_interval,
                "startup_timeout": self.startup_timeout,
                "heartbeat_timeout": self.heartbeat_timeout,
                "max_attempt_seconds": self.max_attempt_seconds,
                # the default is left out: a triggerer of the version before it (no such argument) still
                # rebuilds the trigger during a rolling upgrade that reaches the workers first
                **({} if self.stall_timeout == DEFAULT_STALL_TIMEOUT else {"stall_timeout": self.stall_timeout}),
                "end_from_trigger": self.end_from_trigger,
                "segment_index": self.segment_index,
                "end_step": self.end_step,
            },
        )

    def _hook(self):
        # One hook per (backend, options, connection) in this process: building one reads the connection and
        # creates clients (~0.4 s of CPU for ec2), which a thousand triggers starting at once would pay a
        # thousand times, queueing in the default executor ahead of the shared poller's own I/O.
        from airflow_spot.hooks.spot import SpotHook

        key = (self.backend, json.dumps(self.backend_options, sort_keys=True, default=str), self.aws_conn_id,
               json.dumps(self.market_options or {}, sort_keys=True, default=str))
        hook = _HOOKS.get(key)
        if hook is None:
            hook = _HOOKS[key] = SpotHook(
                backend=self.backend, backend_options=self.backend_options, aws_conn_id=self.aws_conn_id,
                market_options=self.market_options or {})
        return hook

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

    def _interim_read_seconds(self) -> float | None:
        """Seconds between status reads while waiting for the next describe round (None: none)."""
        tick = max(INTERIM_READ_MIN_SECONDS, _RUNNING / INTERIM_READS_PER_SECOND)
        return tick if tick < 0.9 * self.poll_interval else None

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

    def _max_polls(self) -> int:
        remaining = self.requested_at + self.max_attempt_seconds - time.time()
        # rounds of the shared poller may come a little faster than poll_interval (see Subscription.next)
        return max(2, math.ceil(remaining / max(0.9 * self.poll_interval, 0.05)) + 2)

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

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = self._hook()
        store, backend, error = await self._open(hook)
        if error is not None:
            # as for a store that stays unreadable: lost, its instance released where the backend opened
            self.log.warning("attempt %s: %s", self.attempt_id, error)
            event = self._event(Outcome.LOST, error, None)
            event["terminated"] = False if backend is None else await self._release(backend)
            yield TriggerEvent(event)
            return
        layout = JobLayout(store)
        global _RUNNING
        _RUNNING += 1
        try:
            async with subscribe(backend, self.instance_id, interval=self.poll_interval) as subscription:
                verdict, obs = await self._wait(layout, store, subscription)
        finally:
            _RUNNING -= 1
        if verdict is None or obs is None:
            verdict = (Outcome.LOST, f"gave up after max_attempt_seconds={self.max_attempt_seconds:.0f}")
        event = self._event(verdict[0], verdict[1], obs)
        if verdict[0].is_retryable():
            event["terminated"] = await self._release(backend)
        summary = await self._complete_here(store, event)
        if summary is not None:
            yield TaskSuccessEvent(xcoms={"attempt": summary, "return_value": summary})
            return
        yield TriggerEvent(event)

    async def _wait(self, layout: JobLayout, store, subscription: Subscription):
        """Observe until a verdict, at most ``max_attempt_seconds``; returns (verdict or None, last obs)."""
        obs: Observation | None = None
        for _ in range(self._max_polls()):
            obs = await self._observe(layout, subscription)  # paced by the poller's rounds
            verdict = self._classify(obs)
            if verdict is None and obs.status is None and obs.heartbeat and obs.heartbeat.notice_at:
                obs = await self._await_status_after_notice(layout, obs)
                verdict = self._classify(obs)
            if verdict is not None:
                return verdict, obs
            await self._log_progress(store)
            self._refresh_live_price(store)
        return None, obs

    async def _release(self, backend) -> bool:
        """Terminate a preempted or lost attempt's instance here, with the client the poller already holds.

        The worker would do it in ``execute_complete``, but there it first builds a hook and an EC2 client
        (a connection read and botocore's service model: over a second), and the retry waits for that;
        here the instance stops billing at once and the event says so. A failure only logs: the worker,
        seeing ``terminated: False``, terminates again (terminating is idempotent)."""
        try:
            await asyncio.shield(asyncio.to_thread(backend.terminate, [self.instance_id]))
        except Exception as exc:  # noqa: BLE001 - the worker terminates it instead
            self.log.warning("attempt %s: could not terminate instance %s here (%s); the worker will",
                             self.attempt_id, self.instance_id, exc)
            return False
        return True

    async def _complete_here(self, store, event: dict[str, Any]) -> dict[str, Any] | None:
        """Account for a completed attempt here; None sends the event to the worker instead."""
        if not self.end_from_trigger or self.end_step is None or event["status"] != Outcome.COMPLETED.value:
            return None
        from airflow_spot.triggers.completion import complete_attempt

        hook = self._hook()

        def account() -> dict[str, Any] | None:
            from airflow_spot.operators.accounting import billing_market

            # a trigger serialised before it carried market_options cannot rebuild the job's market: the
            # launch price then (the defaults could be another market's, e.g. API prices for a catalog job)
            market = billing_market(hook) if self.market_options is not None else None
            return complete_attempt(store, self.attempt_id, event, segment_index=self.segment_index,
                                    end_step=self.end_step, now=time.time(), market=market)

        try:
            # its own few threads: a price-history read that EC2 throttles (retried, seconds) must not hold
            # the default pool that every trigger's store reads share
            summary = await asyncio.get_running_loop().run_in_executor(_accounting_pool(), account)
        except Exception as exc:  # noqa: BLE001 - the worker's execute_complete does it again
            self.log.warning("attempt %s: accounting in the triggerer failed (%s); resuming on a worker",
                             self.attempt_id, exc)
            return None
        if summary is not None:
            self.log.info("attempt %s ended: completed (%s); ending the task from the trigger; %s",
                          self.attempt_id, event["message"], summary)
        return summary

    def _progress_every(self) -> float:
        """Seconds between progress lines in the task log: ten polls, kept within [5 s, 60 s]."""
        return min(60.0, max(5.0, 10 * self.poll_interval))

    async def _log_progress(self, store) -> None:
        """A progress line (%, steps/s, ETA, cost so far) in the task's log at a bounded rate; it reads the
        job through the read-only JobView and never fails the wait."""
        now = time.monotonic()
        last = getattr(self, "_progress_logged_at", None)
        if last is not None and now - last < self._progress_every():
            return
        self._progress_logged_at = now
        if last is None:
            return  # the first line one interval after the wait starts
        from airflow_spot.storage.job_view import JobView, progress_line

        try:  # the job's objects read for an earlier line and unchanged since are not read again
            snap = await self._bounded("progress", JobView(CachedReads(store, PROGRESS_READS)).snapshot, time.time())
        except Exception as exc:  # noqa: BLE001 - progress is informational; the store is read again next time
            self.log.debug("attempt %s: no progress line this time: %s", self.attempt_id, exc)
            return
        self.log.info("attempt %s %s", self.attempt_id, progress_line(snap))

    def _refresh_live_price(self, store) -> None:
        """Every ``LIVE_PRICE_EVERY_SECONDS``, price the running attempt so far from its market's history
        (:class:`~airflow_spot.storage.protocol.LivePrice`), on its own threads and without awaiting it: a
        throttled read must hold neither the wait nor another trigger's accounting."""
        if self.market_options is None or (self._price_read is not None and not self._price_read.done()):
            return
        now = time.monotonic()
        if self._price_read_at is None:
            # the launch price holds for the first interval; spread over it, so triggers that started
            # together (a triggerer restart) do not all read at once
            self._price_read_at = now - random.uniform(0.0, 0.5) * LIVE_PRICE_EVERY_SECONDS
            return
        if now - self._price_read_at < LIVE_PRICE_EVERY_SECONDS:
            return
        self._price_read_at = now
        self._price_read = asyncio.get_running_loop().run_in_executor(
            _live_price_pool(), self._write_live_price, self._hook(), store)

    def _write_live_price(self, hook, store) -> None:
        from airflow_spot.market.base import MarketSource
        from airflow_spot.operators.accounting import billing_market
        from airflow_spot.operators.attempt_record import AttemptLaunch

        try:
            market = billing_market(hook)
            if market is None or type(market).billed_price is MarketSource.billed_price:
                return  # no price history: the launch price is the price
            launch = AttemptLaunch.read(store, self.attempt_id)
            now = time.time()
            if launch is None or not launch.offer_obj.is_spot or now <= launch.billed_from:
                return
            offer = launch.offer_obj
            price = float(market.billed_price(offer, launch.billed_from, now))
            if price == (offer.price_per_hour if self._live_price is None else self._live_price):
                return  # unchanged: nothing to write (a pool whose price never moved writes nothing)
            JobLayout(store).write_live_price(LivePrice(self.attempt_id, price, now))
            self._live_price = price
        except Exception as exc:  # noqa: BLE001 - the page shows the last price read; the ledger row bills the run
            self.log.info("attempt %s: could not read its price so far (%s); read again in %.0f s",
                          self.attempt_id, exc, LIVE_PRICE_EVERY_SECONDS)

    def _classify(self, obs: Observation) -> tuple[Outcome, str] | None:
        verdict = classify(
            obs,
            requested_at=self.requested_at,
            startup_timeout=self.startup_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            max_attempt_seconds=self.max_attempt_seconds,
            stall_timeout=self.stall_timeout,
        )
        if verdict is not None and obs.status is None:
            self.log.warning("attempt %s: %s", self.attempt_id, verdict[1])
        return verdict

    def _event(self, outcome: Outcome, message: str, obs: Observation | None) -> dict[str, Any]:
        status = obs.status if obs else None
        hb = obs.heartbeat if obs else None
        inst = obs.instance if obs else None
        return {
            "status": outcome.value,
            "attempt_id": self.attempt_id,
            "instance_id": self.instance_id,
            "message": message,
            "exit_code": status.exit_code if status else None,
            "error_tail": status.error_tail if status else "",
            "last_step": hb.step if hb else None,
            "step_time_ewma": hb.step_time_ewma if hb else None,
            "last_committed_step": (
                status.last_committed_step if status and status.last_committed_step is not None
                else (hb.last_committed_step if hb else None)
            ),
            "started_at": status.started_at if status else None,
            "ended_at": status.ended_at if status else (obs.now if obs else time.time()),
            "instance_state": InstanceState(inst.state).value if inst else None,
            "instance_reason": TerminationReason(inst.reason).value if inst else None,
            # the backend's record of the notice (local), else the training process's (EC2: via IMDS)
            "notice_at": (inst.notice_at if inst and inst.notice_at is not None
                          else hb.notice_at if hb else None),
        }

    def _still_deferred(self) -> bool:
        """Whether Airflow still has this trigger's task deferred. Airflow 3.3 calls ``on_kill`` for every trigger
        a triggerer stops running while it runs, a trigger moved to another triggerer (its heartbeat came late)
        included, not only for a user's mark or clear; a moved trigger's task is still deferred, a killed one's
        is not. Unknown (no task instance, the API unreachable): not deferred, so a kill still ends its
        instance, what ``on_kill`` is for."""
        ti = self.task_instance
        if ti is None:
            return False
        try:
            from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

            map_index = getattr(ti, "map_index", -1)
            states = RuntimeTaskInstance.get_task_states(
                dag_id=ti.dag_id, task_ids=[ti.task_id], run_ids=[ti.run_id],
                map_index=map_index if map_index is not None and map_index >= 0 else None)
        except Exception as exc:  # noqa: BLE001 - treated as a kill: the documented reason for on_kill
            self.log.warning("attempt %s: the task's state could not be read (%s: %s); ending it as killed",
                             self.attempt_id, type(exc).__name__, exc)
            return False
        of_run = (states or {}).get(ti.run_id) or {}
        key = ti.task_id if map_index is None or map_index < 0 else f"{ti.task_id}_{map_index}"
        return str(of_run.get(key) or "").lower() == "deferred"

    async def on_kill(self) -> None:
        """The user killed the deferred task (mark failed/success, clear, run marked failed): release its
        instance and bill the attempt up to now. The triggerer may cancel this coroutine again while it runs (it repeats the cancellation
        each time it syncs), so the termination is shielded: once asked, it completes in its thread."""
        hook = self._hook()
        killed_at = time.time()

        def release_and_bill() -> None:
            if self._still_deferred():
                self.log.warning("attempt %s: this triggerer was told to stop watching it, but its task is still "
                                 "deferred (the trigger moved to another triggerer): instance %s is left running",
                                 self.attempt_id, self.instance_id)
                return
            self.log.info("attempt %s was killed: terminating its instance %s", self.attempt_id, self.instance_id)
            try:  # before the termination: a status it brings about is the kill's, for whoever bills it later
                JobLayout(hook.get_store(self.job_uri)).write_kill(self.attempt_id, killed_at)
            except Exception as exc:  # noqa: BLE001 - the instance must go all the same
                self.log.warning("kill of attempt %s not recorded (%s: %s)", self.attempt_id, type(exc).__name__, exc)
            hook.get_backend().terminate([self.instance_id])
            self.log.info("terminated instance %s of killed attempt %s", self.instance_id, self.attempt_id)
            try:  # no execute_complete follows a kill: its time is billed here (Outcome.ABANDONED)
                from airflow_spot.operators import accounting
                from airflow_spot.operators.attempt_record import AttemptLaunch

                store = hook.get_store(self.job_uri)
                launch = AttemptLaunch.read(store, self.attempt_id)
                if launch is not None:
                    # the emergency save lands in the shutdown (EC2's termination returns at once): its status
                    # says what the attempt kept
                    accounting.wait_for_statuses(store, [self.attempt_id])
                    market = accounting.billing_market(hook) if self.market_options is not None else None
                    accounting.account_abandoned(store, launch, now=time.time(), killed_at=killed_at, market=market)
            except Exception as exc:  # noqa: BLE001 - the finish task bills it then
                self.log.warning("killed attempt %s not billed here (%s: %s)", self.attempt_id,
                                 type(exc).__name__, exc)

        await asyncio.shield(asyncio.to_thread(release_and_bill))
