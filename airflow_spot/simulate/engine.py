"""Replay one job over spot traces with a simulated clock.

Model (one tick = the traces' ``gap_seconds``):

* A pool (one instance type in one zone) can be launched at tick ``t`` when its trace reads 1 there; a
  spot instance running in it is preempted at the first tick its trace reads 0.
* Every new instance pays ``restart_overhead`` (boot, restore, warm-up) before it makes progress; an
  on-demand instance is never preempted. Money is billed per attempt by :mod:`airflow_spot.policy.ledger`
  (per second, 60 s minimum), so the simulator's costs are the ledger's. A pool whose trace carries a
  per-tick spot price (:attr:`SimPool.prices`) is offered at the tick's price, and a spot instance is
  billed the price in effect over its run (its ledger row's price is their mean over the run).
* A periodic checkpoint stalls training for ``save_cost``. On a preemption, a controller with emergency
  saves keeps all progress if ``save_cost`` fits in the notice window; otherwise the job falls back to
  its last periodic checkpoint. Leaving an instance on purpose checkpoints first (nothing is lost).
* Work is counted in seconds on the reference GPU (V100 = 1.0); an instance with relative throughput
  ``x`` does ``x`` seconds of work per second.

A controller decides at the start of every tick, and also inside a tick at the time it names
(``next_decision_at``: ``ours`` decides at segment boundaries and retries a waiting job every minute, as
the operators do), with the tick's capacity: a trace sampled every 10 minutes says nothing finer.

What a controller sees at tick ``t`` (:class:`View`): the job's progress, where it runs, which pools can
be launched now, when each pool was last seen to lose capacity (a 1 -> 0 step of its trace) and since
when it has been up (the last 0 -> 1 step) — the past, never the future. Seeing other pools' capacity
is an assumption of this replay (the traces were measured by relaunching in every zone); a live market
approximates it with spot placement scores and the preemptions other jobs see.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Protocol

from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.ledger import LedgerRow, summarize
from airflow_spot.policy.offers import Market, Offer

HOUR = 3600.0


@dataclass(frozen=True)
class JobSpec:
    """:param work_hours: hours of training on one reference GPU (V100).
    :param deadline_hours: hours from the job's start, or None.
    :param save_cost_seconds: training stall per checkpoint.
    :param restart_overhead_hours: paid time without progress per new instance.
    :param notice_seconds: preemption notice (AWS: 120 s).
    :param nodes: instances the job runs on at once (a gang): a pool is up when its trace's count is
        at least this (multi-node availability traces); the pools' prices are the gang's.
    :param transfer_seconds: extra restart time when an instance starts in another region than the
        job's last checkpoint (moving it across regions).
    :param transfer_dollars: money per such move (egress).
    :param store_region: the checkpoints live in one store in this region (the operators' model: one S3
        bucket) instead of following the job: every instance in another region restores from it and saves
        back across regions, paying the transfer, the first included. None: the checkpoint moves with the job.
    :param remote_dollars_per_hour: with ``store_region``, money per hour an instance runs in another region
        (its saves written back across regions; :mod:`airflow_spot.policy.transfer`), on its ledger row.
    :param segment_seconds: wall-clock length of one segment (``steps_per_segment`` times the step time):
        the operators decide where the job runs at segment boundaries, so the replay of ``ours`` does too.
    :param probe_miss: the chance that one probe request (a spot request placed and cancelled) of a pool
        that has capacity reads "no capacity" (not fulfilled in time). A property of the market, like
        ``notice_seconds``, drawn per pool, moment and try (jobs probing one pool at one moment get one
        answer); a fulfilled request is capacity, so a down pool never reads up. Per request, precision 1
        and recall ``1 - probe_miss``: F1 0.9, what published probes measure, is ``0.18``. The job asks a
        refused probe again (``PROBE_RETRIES``), each try drawn independently: an assumption."""

    work_hours: float
    deadline_hours: float | None = None
    save_cost_seconds: float = 10.0
    restart_overhead_hours: float = 0.2
    notice_seconds: float = 120.0
    nodes: int = 1
    transfer_seconds: float = 0.0
    transfer_dollars: float = 0.0
    store_region: str | None = None
    remote_dollars_per_hour: float = 0.0
    segment_seconds: float = 900.0
    probe_miss: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes must be a whole number >= 1, got {self.nodes!r}")
        if not self.work_hours > 0:
            raise ValueError(f"work_hours must be positive, got {self.work_hours!r}")
        if self.deadline_hours is not None and self.deadline_hours < self.work_hours:
            if not self.deadline_hours > 0:
                raise ValueError(f"deadline_hours must be positive (hours from the job's start; None for no "
                                 f"deadline), got {self.deadline_hours!r}")
            raise ValueError(
                f"deadline_hours {self.deadline_hours} is shorter than the work ({self.work_hours} h): "
                "no policy can meet it; raise the deadline or shrink the job"
            )
        if not self.segment_seconds > 0:  # also NaN
            raise ValueError(f"segment_seconds must be > 0 (one segment's wall-clock time), got {self.segment_seconds!r}")
        if not 0.0 <= self.probe_miss < 1.0:  # also NaN
            raise ValueError(f"probe_miss is a probability in [0, 1) (a probe that always misses is no probe), "
                             f"got {self.probe_miss!r}")
        for name in ("save_cost_seconds", "restart_overhead_hours", "notice_seconds", "transfer_seconds",
                     "transfer_dollars", "remote_dollars_per_hour"):
            if not getattr(self, name) >= 0:  # also NaN
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.remote_dollars_per_hour and self.store_region is None:
            raise ValueError("remote_dollars_per_hour prices saves written back to one store in another region: "
                             "give the store's region (store_region)")


@dataclass(frozen=True)
class SimPool:
    """A spot pool replayed from a trace, with its prices."""

    trace: SpotTrace
    offer: Offer  # the spot offer (price, on-demand price, throughput)
    #: the spot $/h at each tick of the trace, when it varies over time (the gang's; ``offer`` holds their
    #: mean): the replay then offers, and bills a running instance, the price in effect at each tick, as
    #: the cloud does; past the series' end its last price holds
    prices: tuple[float, ...] | None = None

    @property
    def name(self) -> str:
        return self.offer.pool

    def price_at(self, idx: int) -> float:
        """The spot $/h at tick ``idx``."""
        if self.prices is None:
            return self.offer.price_per_hour
        return self.prices[min(max(idx, 0), len(self.prices) - 1)]

    def at_tick(self, idx: int) -> SimPool:
        """This pool as offered at tick ``idx``: its price then (itself when the price does not vary)."""
        price = self.price_at(idx)
        if price == self.offer.price_per_hour:
            return self
        return replace(self, offer=replace(self.offer, price_per_hour=price))


@dataclass
class View:
    """What the controller may look at (see the module docstring)."""

    now: float
    spec: JobSpec
    pools: list[SimPool]
    on_demand: Offer
    up: list[bool]
    last_capacity_loss: dict[str, float]
    up_since: dict[str, float]
    our_preemptions: dict[str, float]
    our_preemption_counts: dict[str, int]
    work_done: float
    running: tuple[str, int] | None  # ("spot", pool index) or ("on-demand", 0)
    #: seconds into the traces where this replay's clock reads 0 (for draws that belong to the market at a
    #: moment, such as a probe's miss, rather than to the job)
    window_start: float = 0.0
    #: paid time the current instance has still to spend before it makes progress (restart, a checkpoint
    #: move, a save's stall)
    pending_seconds: float = 0.0
    #: the region the job's last checkpoint is in (None before its first instance made progress; with
    #: ``JobSpec.store_region``, always the store's): an instance started in another region pays
    #: ``JobSpec.transfer_seconds`` / ``transfer_dollars``
    checkpoint_region: str | None = None

    @property
    def work_total(self) -> float:
        return self.spec.work_hours * HOUR

    @property
    def deadline_at(self) -> float | None:
        return self.spec.deadline_hours * HOUR if self.spec.deadline_hours is not None else None


class Controller(Protocol):
    """May also have ``next_decision_at`` (seconds on the replay's clock): the replay then asks it again
    at that time when it falls inside the current tick."""

    name: str
    emergency_save: bool

    def decide(self, view: View) -> tuple[str, int] | None:
        """Where to run during the next tick: ``("spot", pool index)``, ``("on-demand", 0)`` or None."""

    def checkpoint_interval(self, view: View) -> float:
        """Seconds of training between periodic checkpoints on the current instance."""


@dataclass
class SimResult:
    policy: str
    cost: float
    on_demand_cost: float
    completed: bool
    completion_hours: float | None
    deadline_met: bool | None
    preemptions: int
    lost_gpu_hours: float
    spot_hours: float
    on_demand_hours: float
    rows: list[LedgerRow] = field(default_factory=list)
    timeline: list[tuple[float, float, float]] = field(default_factory=list)  # (hours, work fraction, $)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("rows", "timeline")}


class _Attempt:
    def __init__(self, where: tuple[str, int], offer: Offer, start: float, committed: float) -> None:
        self.where, self.offer, self.start, self.committed_at_start = where, offer, start, committed
        self.transfer_dollars = 0.0  # the restore of a checkpoint in another region
        self.remote_dollars_per_hour = 0.0  # saves written back to a store in another region
        self.dollars = 0.0  # the instance's price integrated over its run so far (per-tick prices)

    def transfers(self, now: float) -> float:
        return self.transfer_dollars + (now - self.start) / HOUR * self.remote_dollars_per_hour

    def price_per_hour(self, now: float, varying: bool) -> float:
        """What its run cost an hour: the offer's price, or with per-tick prices their mean over the run."""
        if not varying or now <= self.start:
            return self.offer.price_per_hour
        return self.dollars / ((now - self.start) / HOUR)


def simulate(
    spec: JobSpec,
    pools: list[SimPool],
    on_demand: Offer,
    controller: Controller,
    *,
    offset_ticks: int = 0,
    max_hours: float | None = None,
    timeline_every: int = 15,
) -> SimResult:
    """Run ``controller`` from tick ``offset_ticks`` of the traces until the job is done or the traces end.

    :param max_hours: stop (unfinished) after this many simulated hours; default: four times the deadline
        (or the work without one). Past a trace's end its pool reads as down.
    """
    return simulate_together(spec, pools, on_demand, [controller], offset_ticks=offset_ticks,
                             max_hours=max_hours, timeline_every=timeline_every)[0]


def simulate_together(
    spec: JobSpec,
    pools: list[SimPool],
    on_demand: Offer,
    controllers: list[Controller],
    *,
    offset_ticks: int = 0,
    max_hours: float | None = None,
    timeline_every: int = 15,
) -> list[SimResult]:
    """Replay one job per controller over the same window at the same time: every decision of every job
    comes in time order (at equal times, in the controllers' order), so a job that reads the others'
    events (``ObservedController.shared``) sees each of them as soon as it happened, never before.
    The jobs share the traces' capacity reading, not its amount: each pool holds all of them."""
    runs = [_replay(spec, pools, on_demand, c, offset_ticks, max_hours, timeline_every) for c in controllers]
    results: list[SimResult | None] = [None] * len(runs)
    due: list[tuple[float, int]] = []
    for k, run in enumerate(runs):
        _advance(run, k, due, results)
    while due:
        _, k = heapq.heappop(due)
        _advance(runs[k], k, due, results)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def _advance(run, k: int, due: list[tuple[float, int]], results: list) -> None:
    """Let job ``k`` make its due decision and run on to its next one (queued in ``due``) or its end."""
    try:
        heapq.heappush(due, (next(run), k))
    except StopIteration as stop:
        results[k] = stop.value


def _replay(spec: JobSpec, pools: list[SimPool], on_demand: Offer, controller: Controller, offset_ticks: int,
            max_hours: float | None, timeline_every: int):
    """The replay of one job (the arguments are :func:`simulate`'s), as a generator: it yields the time of
    each decision before making it (so that :func:`simulate_together` can order several jobs' decisions
    in time) and returns the result."""
    if not pools and controller.name != "on-demand":
        raise ValueError("no spot pool to replay: pass at least one trace")
    gap = pools[0].trace.gap_seconds if pools else 60.0
    if any(p.trace.gap_seconds != gap for p in pools):
        raise ValueError("all traces must share one gap_seconds")
    total = spec.work_hours * HOUR
    r = spec.restart_overhead_hours * HOUR
    horizon_ticks = int((max_hours * HOUR if max_hours else 4 * (spec.deadline_hours or spec.work_hours) * HOUR) // gap) + 1
    progress = committed = since_ckpt = pending = 0.0
    attempt: _Attempt | None = None
    rows: list[LedgerRow] = []
    timeline: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)]
    last_loss: dict[str, float] = {}
    up_since: dict[str, float] = {}
    ups = [p.trace.up_for(spec.nodes) for p in pools]
    for p, values in zip(pools, ups, strict=True):  # the past before the job started is known too
        before = values[: max(0, offset_ticks + 1)]
        for i in range(len(before) - 1, 0, -1):
            if before[i - 1] and not before[i] and p.name not in last_loss:
                last_loss[p.name] = (i - offset_ticks) * gap
            if not before[i - 1] and before[i] and p.name not in up_since:
                up_since[p.name] = (i - offset_ticks) * gap
            if p.name in last_loss and p.name in up_since:
                break
    ours: dict[str, float] = {}
    ours_count: dict[str, int] = {}
    cost_so_far = 0.0
    done_at: float | None = None
    checkpoint_region: str | None = spec.store_region

    varying = any(p.prices is not None for p in pools)
    tick_pools = pools

    def close(now: float, outcome: str, kept: float, lost: float) -> None:
        nonlocal attempt, cost_so_far
        assert attempt is not None
        o = attempt.offer
        rows.append(LedgerRow(
            attempt_id=f"{controller.name}-{len(rows)}", instance_id=f"sim-{len(rows)}", instance_type=o.instance_type,
            zone=o.zone, region=o.region, market=o.market, price_per_hour=attempt.price_per_hour(now, varying),
            on_demand_price_per_hour=o.on_demand_price_per_hour, started_at=attempt.start, ended_at=now,
            steps_done=int(round(max(0.0, kept - attempt.committed_at_start))), steps_lost=int(round(lost)),
            outcome=outcome, step_seconds=1.0 / o.relative_throughput, transfer_dollars=attempt.transfers(now),
        ))
        cost_so_far += rows[-1].cost
        attempt = None

    for t in range(horizon_ticks):
        now = t * gap
        idx = offset_ticks + t
        up = [values[idx] if idx < len(values) else False for values in ups]
        if idx > 0:
            for p, values in zip(pools, ups, strict=True):
                if idx < len(values) and values[idx - 1] != values[idx]:
                    (up_since if values[idx] else last_loss)[p.name] = now
        if attempt is not None and attempt.where[0] == "spot" and not up[attempt.where[1]]:
            saved = controller.emergency_save and spec.save_cost_seconds <= spec.notice_seconds
            lost = 0.0 if saved else progress - committed
            progress = committed = progress if saved else committed
            ours[pools[attempt.where[1]].name] = now
            ours_count[pools[attempt.where[1]].name] = ours_count.get(pools[attempt.where[1]].name, 0) + 1
            close(now, "preempted", committed, lost)
            since_ckpt = pending = 0.0
        if varying and (t == 0 or any(p.price_at(idx) != p.price_at(idx - 1) for p in pools)):
            tick_pools = [p.at_tick(idx) for p in pools]  # only when a price changed: they change rarely
        at, tick_end = now, now + gap
        while True:  # decisions at the tick's start and wherever the controller asks for one inside it
            view = View(at, spec, tick_pools, on_demand, up, last_loss, up_since, ours, ours_count, progress,
                        attempt.where if attempt is not None else None, offset_ticks * gap, pending,
                        checkpoint_region)
            yield at  # other jobs replayed together decide first if they are due earlier
            target = controller.decide(view)
            if target is not None and target[0] == "spot" and not up[target[1]]:
                raise RuntimeError(f"controller {controller.name} chose pool {pools[target[1]].name}, which is down")
            current = attempt.where if attempt is not None else None
            if target != current:
                if attempt is not None:  # leaving on purpose: checkpoint first
                    committed = progress
                    close(at, "completed", committed, 0.0)
                if target is not None:
                    offer = on_demand if target[0] == "on-demand" else tick_pools[target[1]].offer
                    attempt = _Attempt(target, offer, at, committed)
                    pending, since_ckpt = r, 0.0
                    if checkpoint_region is not None and offer.region != checkpoint_region:
                        pending += spec.transfer_seconds  # the checkpoint moves to the new region
                        attempt.transfer_dollars = spec.transfer_dollars  # billed with the attempt, as the operators do
                    if spec.store_region is not None and offer.region != spec.store_region:
                        attempt.remote_dollars_per_hour = spec.remote_dollars_per_hour
            # a trace holds its value for a whole tick; a controller that decides more often than the
            # trace was sampled (the operators retry a job waiting for capacity every minute) is asked
            # again inside the tick, with the same capacity
            nxt = getattr(controller, "next_decision_at", None)
            until = nxt if nxt is not None and at < nxt < tick_end else tick_end
            span = until - at
            if attempt is not None:
                thr = attempt.offer.relative_throughput
                # the price in effect now (a spot price changes under a running instance, as the cloud bills)
                running = tick_pools[attempt.where[1]] if attempt.where[0] == "spot" else None
                rate = (running.offer if running else attempt.offer).price_per_hour
                use = min(pending, span)
                pending -= use
                if span > use:
                    # progress from here on writes its checkpoints here (an instance given up while the
                    # checkpoint was still moving leaves it where it was)
                    checkpoint_region = spec.store_region or attempt.offer.region
                work = (span - use) * thr
                if progress + work >= total:
                    done_at = at + use + (total - progress) / thr
                    attempt.dollars += (done_at - at) / HOUR * rate
                    progress = committed = total
                    close(done_at, "completed", total, 0.0)
                    timeline.append((done_at / HOUR, 1.0, cost_so_far))
                    break
                attempt.dollars += span / HOUR * rate
                progress += work
                since_ckpt += span - use
                if since_ckpt >= controller.checkpoint_interval(view):
                    committed, since_ckpt = progress, 0.0
                    pending += spec.save_cost_seconds
            if until >= tick_end:
                break
            at = until
        if done_at is not None:
            break
        if t % timeline_every == 0:
            running_cost = cost_so_far + ((now + gap - attempt.start) / HOUR
                                          * attempt.price_per_hour(now + gap, varying)
                                          + attempt.transfers(now + gap) if attempt else 0)
            timeline.append(((now + gap) / HOUR, progress / total, running_cost))
    else:
        if attempt is not None:
            close(horizon_ticks * gap, "lost", committed, progress - committed)

    summary = summarize(rows)
    deadline = spec.deadline_hours
    return SimResult(
        policy=controller.name,
        # probes (spot requests placed and cancelled) are billed outside the job's attempts
        cost=summary.cost + getattr(controller, "probe_cost", 0.0),
        on_demand_cost=summary.on_demand_cost,
        completed=done_at is not None,
        completion_hours=done_at / HOUR if done_at is not None else None,
        deadline_met=None if deadline is None else (done_at is not None and done_at <= deadline * HOUR + 1e-6),
        preemptions=summary.preemptions,
        lost_gpu_hours=summary.lost_gpu_hours,
        spot_hours=sum(x.billed_seconds for x in rows if x.market == Market.SPOT.value) / HOUR,
        on_demand_hours=sum(x.billed_seconds for x in rows if x.market == Market.ON_DEMAND.value) / HOUR,
        rows=rows,
        timeline=timeline,
    )
