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

The trigger is split by concern: :mod:`airflow_spot.triggers.verdict` decides what an observation means,
:mod:`airflow_spot.triggers.observing` makes the observations (store reads, the shared poller's rounds) and
:mod:`airflow_spot.triggers.attempt_end` releases and bills the attempt's instance; this module holds the
trigger itself, its wait loop, events, progress lines and live price. The class stays here: its classpath
is stored with every deferred task.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TaskSuccessEvent, TriggerEvent

from airflow_spot.backends.base import InstanceState, TerminationReason
from airflow_spot.storage.protocol import AttemptStatus, Heartbeat, JobLayout, LivePrice, Outcome
from airflow_spot.storage.read_cache import CachedReads, ReadCache
# ACCOUNTING_THREADS, Observation and classify were defined here: still importable from this module
from airflow_spot.triggers.attempt_end import ACCOUNTING_THREADS, AttemptEndMixin  # noqa: F401 - re-exported
from airflow_spot.triggers.bounded import BoundedCalls
from airflow_spot.triggers.observing import ObservingMixin
from airflow_spot.triggers.poller import Subscription, subscribe
from airflow_spot.triggers.verdict import Observation, classify

#: SpotHooks shared by the triggers of this process (see SegmentTrigger._hook):
#: (backend, backend options, connection id, market options) -> hook
_HOOKS: dict[tuple[str, str, str | None, str], Any] = {}

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


class SegmentTrigger(ObservingMixin, AttemptEndMixin, BaseTrigger):
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

    def _interim_read_seconds(self) -> float | None:
        """Seconds between status reads while waiting for the next describe round (None: none)."""
        tick = max(INTERIM_READ_MIN_SECONDS, _RUNNING / INTERIM_READS_PER_SECOND)
        return tick if tick < 0.9 * self.poll_interval else None

    def _max_polls(self) -> int:
        remaining = self.requested_at + self.max_attempt_seconds - time.time()
        # rounds of the shared poller may come a little faster than poll_interval (see Subscription.next)
        return max(2, math.ceil(remaining / max(0.9 * self.poll_interval, 0.05)) + 2)

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
