"""One shared instance poller per backend scope (EC2: per region) in the triggerer process.

A triggerer may hold thousands of deferred segments. Polling each instance on its own costs one
``DescribeInstances`` per segment per interval, which AWS throttles long before a thousand; the
:class:`SharedPoller` instead makes **one** batched ``Backend.adescribe`` call per interval for the ids
of every subscribed trigger (the EC2 backend pages through ``DescribeInstances`` filtered by those ids)
and hands each trigger its own instance's entry.

Life cycle: a poller starts with its first subscriber and stops (its task cancelled, its registry entry
dropped) with its last. Pollers live per event loop, so tests that run ``asyncio.run`` twice do not share
one. A describe call that raises reaches every subscriber as a round with ``error`` set: the instance is
"unknown this round", never gone (a loss needs the cloud to say so, or heartbeats silent past a window).
Throttling is not retried here: the EC2 client runs botocore's ``adaptive`` retry mode, so a throttled
round is slower, and one that still fails is one more "unknown" round.

Usage (inside a trigger's ``run``)::

    async with subscribe(backend, instance_id, interval=5.0) as sub:
        for _ in range(max_polls):
            seen = await sub.next()        # waits for the next round that included this id
            if seen.error: ...             # unknown this round
            info = seen.instance           # None when the backend no longer knows the id
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from airflow_spot.backends.base import Backend, InstanceInfo
from airflow_spot.triggers.bounded import BoundedCalls

log = logging.getLogger(__name__)

#: rounds a subscriber waits for one that includes its id before giving up (a bound, never reached in
#: practice: an id subscribed before a round starts is in that round)
MAX_ROUNDS_PER_NEXT = 3
#: a describe that has not answered in this long counts as failed for the round (botocore's own read
#: timeout is 60 s a try): one hung call would otherwise hold every subscriber's wait with it
DESCRIBE_TIMEOUT_SECONDS = 120.0


@dataclass(frozen=True)
class PollRound:
    """One batched describe: which ids it asked for, what came back, or why it failed."""

    number: int
    instance_ids: frozenset[str]
    described: dict[str, InstanceInfo]
    error: str | None
    finished_at: float


@dataclass(frozen=True)
class InstanceSeen:
    """One subscriber's view of one round."""

    round_number: int
    instance: InstanceInfo | None
    known: bool
    error: str | None
    at: float


def describe_scope(backend: Backend) -> str:
    """What makes two backends describe the same instances: the backend's own ``describe_scope()`` when
    it has one (EC2: its region and endpoint), else its serialised kwargs."""
    own = getattr(backend, "describe_scope", None)
    if callable(own):
        return f"{backend.name}:{own()}"
    return f"{backend.name}:{json.dumps(backend.serialize(), sort_keys=True, default=str)}"


class SharedPoller:
    """Polls the union of its subscribers' instance ids, one ``adescribe`` per round.

    :param backend: the backend all subscribers share (any one of theirs: they describe the same scope).
    :param scope: the registry key (see :func:`describe_scope`).
    """

    def __init__(self, backend: Backend, scope: str) -> None:
        self.backend = backend
        self.scope = scope
        self.describe_calls = 0
        #: how long the last rounds' describes took (seconds; for the benchmark and diagnostics)
        self.round_seconds: deque[float] = deque(maxlen=100)
        #: instance id -> the poll intervals of its subscribers (one entry per subscription)
        self._subscribers: dict[str, list[float]] = {}
        self._round = 0
        self._next_round: asyncio.Future[PollRound] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task | None = None
        self._calls = BoundedCalls()

    # ------------------------------------------------------------------ subscribers
    @property
    def subscriber_count(self) -> int:
        return sum(len(v) for v in self._subscribers.values())

    @property
    def interval(self) -> float:
        """The shortest interval any subscriber asked for (every one then sees a round at least that often)."""
        return min(min(v) for v in self._subscribers.values()) if self._subscribers else 0.0

    def _add(self, instance_id: str, interval: float) -> None:
        self._subscribers.setdefault(instance_id, []).append(float(interval))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"spot-poller {self.scope}")

    def _remove(self, instance_id: str, interval: float) -> bool:
        """Drop one subscription; True when it was the last one (the poller then stops)."""
        intervals = self._subscribers.get(instance_id, [])
        if float(interval) in intervals:
            intervals.remove(float(interval))
        if not intervals:
            self._subscribers.pop(instance_id, None)
        if self._subscribers:
            return False
        if self._task is not None:
            self._task.cancel()
            self._task = None
        return True

    # ------------------------------------------------------------------ rounds
    async def _loop(self) -> None:
        while self._subscribers:
            await self._poll_once()
            await asyncio.sleep(self.interval)

    async def _poll_once(self) -> None:
        ids = frozenset(self._subscribers)
        self._round += 1
        self.describe_calls += 1
        started = time.monotonic()
        try:
            described = await self._describe(sorted(ids))
            error = None
        except Exception as exc:  # noqa: BLE001 - any failure is "unknown this round" for every subscriber
            described, error = {}, f"{type(exc).__name__}: {exc}"
            log.warning("shared poller %s: describe of %d instances failed (round %d): %s",
                        self.scope, len(ids), self._round, error)
        self.round_seconds.append(time.monotonic() - started)
        done, self._next_round = self._next_round, asyncio.get_running_loop().create_future()
        done.set_result(PollRound(self._round, ids, described, error, time.time()))

    async def _describe(self, ids: list[str]) -> dict[str, InstanceInfo]:
        """One ``adescribe``, bounded by :data:`DESCRIBE_TIMEOUT_SECONDS`; while one past it still runs, rounds
        fail at once rather than start another beside it (:mod:`.bounded`)."""
        return await self._calls.call("describe", lambda: self.backend.adescribe(ids), DESCRIBE_TIMEOUT_SECONDS)

    async def next_for(self, instance_id: str, after_round: int) -> InstanceSeen:
        """The first round after ``after_round`` that asked about ``instance_id``."""
        for _ in range(MAX_ROUNDS_PER_NEXT):
            polled = await asyncio.shield(self._next_round)
            if polled.number > after_round and instance_id in polled.instance_ids:
                return InstanceSeen(
                    round_number=polled.number,
                    instance=polled.described.get(instance_id),
                    known=polled.error is None and instance_id in polled.described,
                    error=polled.error,
                    at=polled.finished_at,
                )
        raise RuntimeError(
            f"shared poller {self.scope}: {MAX_ROUNDS_PER_NEXT} rounds passed without {instance_id} (bug)"
        )


class Subscription:
    """One trigger's handle on a shared poller; ``next()`` waits for the next round with its instance."""

    def __init__(self, poller: SharedPoller, instance_id: str, interval: float) -> None:
        self.poller = poller
        self.instance_id = instance_id
        self.interval = interval
        self._last_round = 0
        self._last_at: float | None = None

    async def next(self) -> InstanceSeen:
        """The next round with this instance, no sooner than about ``interval`` after the last one: a
        trigger that asked for 30 s does not read its store every second because another asked for 1 s.
        The 10 % margin makes sure a subscriber paced like the poller waits for the very next round."""
        if self._last_at is not None:
            wait = self._last_at + 0.9 * self.interval - time.time()
            if wait > 0:
                await asyncio.sleep(wait)
        seen = await self.poller.next_for(self.instance_id, self._last_round)
        self._last_round, self._last_at = seen.round_number, seen.at
        return seen


#: (event loop, scope) -> poller; entries leave with their last subscriber
_POLLERS: dict[tuple[int, str], SharedPoller] = {}


def active_pollers() -> list[SharedPoller]:
    """The pollers running in this process (for tests and the benchmark)."""
    return list(_POLLERS.values())


@contextlib.asynccontextmanager
async def subscribe(backend: Backend, instance_id: str, *, interval: float) -> AsyncIterator[Subscription]:
    """Subscribe ``instance_id`` to the poller of ``backend``'s scope, starting it if needed; leaving the
    block (normally, by an exception, or by the trigger's cancellation) unsubscribes."""
    if interval <= 0:
        raise ValueError(f"poll interval must be positive, got {interval!r}")
    key = (id(asyncio.get_running_loop()), describe_scope(backend))
    poller = _POLLERS.get(key)
    if poller is None:
        poller = _POLLERS[key] = SharedPoller(backend, key[1])
    poller._add(instance_id, interval)
    try:
        yield Subscription(poller, instance_id, interval)
    finally:
        if poller._remove(instance_id, interval) and _POLLERS.get(key) is poller:
            del _POLLERS[key]
