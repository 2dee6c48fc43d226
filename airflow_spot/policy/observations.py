"""What a job can observe about spot capacity, and what it concludes from it.

One observation model for the operators and the simulator: a list of :class:`PoolEvent` — each launch
outcome, capacity refusal, preemption (and probe, where the backend supports probing) that the job
itself met or that another job of the deployment logged in the availability log
(:mod:`airflow_spot.storage.availability`). Nothing here reads a trace's true state.

Per pool, from the events at or before ``now``:

* **believed state**: ``up`` when the newest event says it held capacity (a launch, a probe that got
  capacity, or the job's own instance still running there), ``down`` when the newest says it refused or
  preempted and that is younger than ``recheck_seconds`` (older than that, the pool is worth a new try:
  ``unknown``), ``unknown`` when nothing was seen;
* **observed up-time**: seconds since the first up-event after the last down-event (a lower bound of
  the true age: the pool may have come back before anyone looked);
* **observed outages**: from a down-event to the next up-event of the same pool (an upper bound of the
  true outage: it came back somewhere in between); their mean, blended with a prior, is the expected
  outage length the deadline policy budgets its waiting with.

Of the job itself: its own preemption rate (preemptions per hour its own spot instances ran, blended
with the market's prior), which scales the slack kept for future preemptions' restarts.

Pure: events and time are passed in; no I/O, no clock.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from airflow_spot.policy.checkpoint_interval import estimate_mtbf

#: the pool held capacity at ``at``
UP_KINDS = frozenset({"launched", "probe-up", "running"})
#: the pool had no capacity at ``at`` (a refusal) or lost it (a preemption)
DOWN_KINDS = frozenset({"refused", "preempted", "probe-down"})
EVENT_KINDS = UP_KINDS | DOWN_KINDS
#: what the deployment's availability log holds of a job (launches, refusals, probes, preemptions): never
#: ``running``, which a job knows only of its own instances (its ledger rows, ``ledger_events``)
LOGGED_KINDS = EVENT_KINDS - {"running"}
#: an outage is measured only when a down-event came at most this long before the pool was seen back
#: (shorter than the 900 s probe interval on purpose: see ``DecisionParams.watch_seconds``)
WATCH_SECONDS = 300.0
#: a probe that found no capacity is asked again this many times at once before it counts as
#: ``probe-down`` (the operators' ``planning.probe_spot`` and the replay alike): an unfulfilled request
#: may be a miss, and a false "down" resets the pool's observed up-time
PROBE_RETRIES = 1


@dataclass(frozen=True)
class PoolEvent:
    """One observation of one spot pool.

    :param pool: ``Offer.pool`` (``instance_type@zone``).
    :param kind: one of :data:`EVENT_KINDS`.
    :param at: when (seconds, the caller's clock).
    :param job: who saw it (empty: this job); other jobs' events come from the availability log."""

    pool: str
    kind: str
    at: float
    job: str = ""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"unknown pool event kind {self.kind!r}; valid kinds: {', '.join(sorted(EVENT_KINDS))}")
        if not self.pool:
            raise ValueError("a pool event needs a pool (instance_type@zone)")

    @property
    def up(self) -> bool:
        return self.kind in UP_KINDS


@dataclass(frozen=True)
class PoolView:
    """What the events say about one pool at ``now`` (see the module docstring)."""

    pool: str
    state: str  # "up", "down" or "unknown"
    up_since: float | None
    down_since: float | None
    outages: tuple[float, ...] = ()
    #: the newest down-event (refusal, preemption, probe that found no capacity), or None
    last_down: float | None = None
    #: how long the pool had been seen up when the current outage began (None: not seen up before it)
    last_run_seconds: float | None = None

    def up_seconds(self, now: float) -> float | None:
        return None if self.up_since is None else max(0.0, now - self.up_since)

    def up_seconds_at_most(self, now: float) -> float | None:
        """For a pool not seen up since it was last seen down: if it is up now, it came back after that
        down-event, so it has been up at most this long (None when it was never seen down)."""
        if self.up_since is not None or self.last_down is None:
            return None
        return max(0.0, now - self.last_down)


def ledger_events(rows: Iterable) -> list[PoolEvent]:
    """Pool events of the job's own ledger rows (:class:`~airflow_spot.policy.ledger.LedgerRow`): a new spot
    instance held capacity when it started (``launched``; an instance reused from the previous segment is
    ``running``), one that completed held it until it ended, a preempted one lost it when it ended. A lost
    attempt (silence, an agent that never started, an instance ended without the market's word) held it too:
    it says nothing of the pool's capacity, as the deployment's log, which does not carry it, says nothing."""
    out = []
    for r in rows:
        if r.market != "spot":
            continue
        pool = f"{r.instance_type}@{r.zone}"
        out.append(PoolEvent(pool, "launched" if r.new_instance else "running", float(r.started_at)))
        out.append(PoolEvent(pool, "preempted" if r.outcome == "preempted" else "running", float(r.ended_at)))
    return out


def pool_views(
    events: Iterable[PoolEvent],
    now: float,
    pools: Iterable[str] = (),
    recheck_seconds: float = 120.0,
    watch_seconds: float = WATCH_SECONDS,
) -> dict[str, PoolView]:
    """Per pool (every pool of ``pools`` and every pool with an event) its :class:`PoolView` at ``now``;
    events after ``now`` are ignored.

    :param recheck_seconds: a refusal or preemption older than this no longer marks the pool down.
    :param watch_seconds: an outage counts only if a down-event came at most this long before it ended."""
    by_pool: dict[str, list[PoolEvent]] = {p: [] for p in pools}
    for e in events:
        if e.at <= now:
            by_pool.setdefault(e.pool, []).append(e)
    out = {}
    for pool, evs in by_pool.items():
        # at equal times a down-event wins: a refusal and a launch in one tick most likely mean it just went
        evs.sort(key=lambda e: (e.at, e.up))
        up_since = down_since = last_down = last_run = None
        outages = []
        for e in evs:
            if e.up:
                if up_since is None:
                    up_since = e.at
                    # an outage counts only when someone looked shortly before it ended; a pool nobody
                    # watched for hours says nothing about how long outages last
                    if down_since is not None and last_down is not None and e.at - last_down <= watch_seconds:
                        outages.append(e.at - down_since)
                down_since = None
            else:
                if down_since is None:
                    down_since = e.at
                    last_run = None if up_since is None else e.at - up_since
                last_down = e.at
                up_since = None
        if up_since is not None:
            state = "up"
        elif down_since is not None and now - evs[-1].at < recheck_seconds:
            state = "down"
        else:
            state = "unknown"
        out[pool] = PoolView(pool, state, up_since, down_since, tuple(outages), last_down, last_run)
    return out


def expected_outage_seconds(views: Iterable[PoolView], prior_seconds: float, prior_weight: float = 2.0) -> float:
    """Mean observed outage length, shrunk towards ``prior_seconds`` as if ``prior_weight`` outages of that
    length had been seen (a deployment with no history waits the prior)."""
    seen = [o for v in views for o in v.outages]
    return (prior_seconds * prior_weight + sum(seen)) / (prior_weight + len(seen))


def own_pool_losses(
    events: Iterable[PoolEvent], now: float, memory_seconds: float | None = None
) -> dict[str, tuple[float, float]]:
    """Per pool, the job's own preemptions there and the seconds its own spot instances ran there; with
    ``memory_seconds``, each instance's loss and seconds weigh ``exp(-age / memory_seconds)``, its age
    counted from when it ended (a pool's spell of losing capacity passes).

    Only the job's own events count (``job == ""``: its ledger and its running instance), because only
    for its own instances is it known how long they were up before the loss. An instance's time runs
    from its launch to its preemption, or, when it was not preempted, to the newest event that saw it
    (or its pool) up; a ``launched`` event is a new instance (one reused by the next segment is
    ``running``), so the time between two instances in one pool is not counted."""
    by_pool: dict[str, list[PoolEvent]] = {}
    for e in events:
        if e.at <= now and not e.job:
            by_pool.setdefault(e.pool, []).append(e)
    out = {}
    for pool, evs in by_pool.items():
        evs.sort(key=lambda e: (e.at, e.up))
        seconds = losses = 0.0
        start = last_up = None

        def weight(end: float) -> float:
            return 1.0 if memory_seconds is None else math.exp(-(now - end) / memory_seconds)

        for e in evs:
            if start is not None and (e.kind == "launched" or not e.up):
                # the instance ends here: lost if preempted, else unharmed at the last sight of it up
                lost = e.kind == "preempted"
                end = e.at if lost else last_up
                seconds += weight(end) * (end - start)
                losses += weight(end) * lost
                start = None
            if e.kind == "launched":
                start = e.at
            if e.up:
                last_up = e.at
        if start is not None:
            seconds += weight(last_up) * (last_up - start)
        out[pool] = (losses, seconds)
    return out


def own_preemption_rate(events: Iterable[PoolEvent], now: float, prior_rate_per_hour: float,
                        prior_hours: float) -> float:
    """Preemptions per hour of the job's own spot instances (:func:`own_pool_losses`, all pools), shrunk
    towards ``prior_rate_per_hour`` as if ``prior_hours`` of spot time at that rate had been seen (the
    Gamma-prior estimate of :func:`~airflow_spot.policy.checkpoint_interval.estimate_mtbf`, as a rate)."""
    per_pool = own_pool_losses(events, now).values()
    losses = sum(n for n, _ in per_pool)
    seconds = sum(t for _, t in per_pool)
    prior_mtbf = 3600.0 / prior_rate_per_hour
    return 3600.0 / estimate_mtbf(prior_mtbf, losses, seconds, prior_weight=prior_rate_per_hour * prior_hours)


@dataclass(frozen=True)
class JobObservation:
    """Everything the decision function (:func:`airflow_spot.policy.decision.decide_attempt`) may use:
    the job's progress and the pool events it has, from its own ledger and the deployment's log.

    :param now: the current time.
    :param started_at: when the job started.
    :param deadline_at: when it must be done (None: no deadline).
    :param work_done: seconds of work done (committed progress, at the reference speed).
    :param work_total: seconds of work of the whole job.
    :param offers: the offers the job may launch (spot per pool, on-demand), already filtered to its request.
    :param events: pool events (the job's own and the deployment's).
    :param running: the market the job's instance runs on now (``spot``/``on-demand``) or None.
    :param running_pool: the pool of that instance (it is up: the job sees its own instance running).
    """

    now: float
    started_at: float
    deadline_at: float | None
    work_done: float
    work_total: float
    offers: Sequence = ()
    events: Sequence[PoolEvent] = ()
    running: str | None = None
    running_pool: str | None = None

    def __post_init__(self) -> None:
        if self.work_total <= 0:
            raise ValueError(f"work_total must be positive, got {self.work_total!r}")
        if self.deadline_at is not None and self.deadline_at <= self.started_at:
            raise ValueError("deadline_at must be after started_at")
        if not math.isfinite(self.now):
            raise ValueError(f"now must be a finite time, got {self.now!r}")
