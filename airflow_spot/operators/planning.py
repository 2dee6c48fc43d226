"""Where the next attempt runs: offers from the market, ranked and filtered by the pure policies.

This module only gathers the inputs (offers, the job's progress, its ledger and pool events, the
deployment's availability log through the market, the clock) into one
:class:`~airflow_spot.policy.observations.JobObservation` and calls
:func:`airflow_spot.policy.decision.decide_attempt` — the same function the simulator's ``ours`` replays;
the decisions are its.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from airflow_spot.backends.base import InstanceInfo
from airflow_spot.policy.decision import work_reference
from airflow_spot.policy.observations import PROBE_RETRIES, ledger_events
from airflow_spot.policy.offers import GpuRequest, Market, Offer


class NoOfferError(ValueError):
    """No offer of the market matches the job's GPU request."""


@dataclass
class Plan:
    ranked: list[Offer]
    market: Market
    reason: str
    mtbf_seconds: float | None = None
    #: the deadline policy committed the job to on-demand until the end
    committed: bool = False
    #: the policy would rather wait than pay on-demand: when every spot offer refuses, retry later
    wait: bool = False
    #: a warm spot instance's pool now costs as much as on-demand of its type: let it go, do not reuse it
    leave_running: bool = False
    #: on on-demand, the spot pools' state is stale: probe them if the backend can
    probe: bool = False
    #: on a warm spot instance: cheaper pools worth moving to, best first (``decide_attempt``'s ``move_to``)
    move_to: list[Offer] = field(default_factory=list)
    #: on a warm spot instance: cheaper pools worth a move once seen settled; probe them if the backend can,
    #: else try them after ``move_to`` (``decide_attempt``'s ``settle_probe``)
    settle_probe: list[Offer] = field(default_factory=list)
    #: every offer the market made for the request, before its filters (a price cap): what a warm instance
    #: is billed from (:func:`priced_now`)
    market_offers: list[Offer] = field(default_factory=list)
    #: the request's ``max_price_per_hour``: a warm instance whose pool now costs more is let go
    price_cap: float | None = None

    def cost_of(self, offer: Offer) -> float:
        from airflow_spot.policy.offer_ranking import cost_per_step

        return cost_per_step(offer)


def plan(
    market: Any,
    gpus: GpuRequest,
    *,
    now: float,
    done_steps: int,
    total_steps: int,
    job_started_at: float,
    deadline: timedelta | None,
    ledger_rows: Sequence[Any],
    step_seconds: float | None = None,
    running: Market | None = None,
    running_pool: str | None = None,
    committed: bool = False,
    job_events: Sequence[Any] = (),
    checkpoint_region: str | None = None,
    transfer_seconds: float = 0.0,
    transfer_dollars: float = 0.0,
    remote_dollars_per_hour: float = 0.0,
    restart_overhead_seconds: float | None = None,
    step_profile: dict[str, float] | None = None,
    step_throughput: float | None = None,
    profile_source: str = "the declared step_profile",
) -> Plan:
    """Rank the offers for the next attempt with :func:`airflow_spot.policy.decision.decide_attempt`, the
    function the simulator's ``ours`` replays, fed by one
    :class:`~airflow_spot.policy.observations.JobObservation`: the job's ledger rows and own pool events
    (``job_events``: launches and capacity refusals it recorded) plus the deployment's events that the
    market reports (:meth:`MarketSource.observations`).

    :param step_seconds: measured seconds per step (from the job's heartbeats), for the deadline policy;
        without it the job is assumed to need the whole window at its current rate and only the
        Uniform Progress line decides.
    :param running: the market of the warm instance the job holds, if any (switching costs a restart).
    :param running_pool: that instance's pool (it is up: the job sees it running).
    :param committed: the deadline policy's state from the previous plan (safety net fired).
    :param checkpoint_region: the region of the job's store: an attempt elsewhere restores and saves across
        regions, paying ``transfer_seconds`` more start-up and ``transfer_dollars``; the ranking and the
        deadline rule price both (``DecisionParams.home_region``), as ``simulate --store-region`` replays;
        ``remote_dollars_per_hour`` is what running there costs an hour (its saves written back).
    :param restart_overhead_seconds: the job's restart, as the deadline rule budgets it (the operator's
        ``restart_overhead_seconds``; ``simulate`` replays ``ours`` with its ``--restart-overhead-hours``);
        None: the rule's default.
    :param step_profile: the job's declared seconds per step per GPU model (``segment_options``'
        ``step_profile``): before any heartbeat measured a step time, the deadline rule takes the profile's
        time on the reference offer (:func:`work_reference`) instead of only the Uniform Progress line.
    :param step_throughput: the relative throughput (``Offer.relative_throughput``) of the instance
        ``step_seconds`` was measured on. The deadline rule counts work in seconds of its reference offer,
        the on-demand instance it falls back to: a job measured on a fast spot type and falling back to a
        slower on-demand type needs more time than its measured pace says. None: measured on that type.
    :param profile_source: where ``step_profile`` comes from, for the plan's reason (the declared one, or
        what the DAG's earlier run measured).
    """
    from airflow_spot.policy.deadline import WAIT, DeadlineState
    from airflow_spot.policy import decision as policy_decision
    from airflow_spot.policy.decision import DecisionParams, observed_deadline_params
    from airflow_spot.policy.observations import JobObservation

    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps!r}")
    # the market's offers without the price cap: a warm instance in a pool that rose above it is billed there
    uncapped = replace(gpus, max_price_per_hour=None) if gpus.max_price_per_hour is not None else gpus
    market_offers = list(market.offers(uncapped))
    offers = [o for o in market_offers if gpus.matches(o)]
    if not offers:
        raise NoOfferError(f"no offer of the market matches {gpus}; relax the GPU request")
    deadline_seconds = deadline.total_seconds() if deadline else None
    restart = {} if restart_overhead_seconds is None else {"restart_overhead_seconds": float(restart_overhead_seconds)}
    params = DecisionParams(deadline=observed_deadline_params(**restart))
    if checkpoint_region is not None:
        params = replace(params, home_region=checkpoint_region, transfer_seconds=transfer_seconds,
                         transfer_dollars=transfer_dollars, remote_dollars_per_hour=remote_dollars_per_hour)
    # the deadline rule's work unit: a second on the on-demand instance it falls back to
    measured = step_seconds if step_seconds is not None and step_seconds > 0 else None

    def pace(ref: Offer) -> float | None:  # seconds per step on ``ref``
        if measured is not None:
            scale = step_throughput / ref.relative_throughput if step_throughput and step_throughput > 0 else 1.0
            return measured * scale
        return profile_step_seconds(step_profile, ref, market_offers) if step_profile else None

    steps_left = max(0, total_steps - min(done_steps, total_steps))
    reference = fallback_reference(offers, params, steps_left, pace)
    step_seconds = pace(reference)
    declared = step_seconds if measured is None else None
    converted = measured is not None and step_seconds is not None and abs(step_seconds - measured) > 1e-9 * measured
    if step_seconds is not None and step_seconds > 0:
        unit = step_seconds
    elif deadline_seconds:
        # unknown speed: scale steps so that the whole job fills the window before the last restart; the
        # absolute slack is then meaningless, so only the line decides (no safety-net restarts)
        unit = max(deadline_seconds - params.deadline.restart_overhead_seconds, 1.0) / total_steps
        params = replace(params, deadline=observed_deadline_params(safety_restarts=0.0, **restart),
                         policy="uniform-progress")
    else:
        unit = 1.0
    observed = getattr(market, "observations", None)
    deployment = list(observed(now)) if callable(observed) else []
    obs = JobObservation(
        now=now, started_at=job_started_at,
        deadline_at=job_started_at + deadline_seconds if deadline_seconds else None,
        work_done=min(done_steps, total_steps) * unit, work_total=total_steps * unit, offers=offers,
        events=ledger_events(ledger_rows) + list(job_events) + deployment,
        running=Market(running).value if running else None, running_pool=running_pool,
    )
    decision = policy_decision.decide_attempt(obs, DeadlineState(committed=committed), params)
    wanted = Market.SPOT if decision.market == WAIT else Market(decision.market)
    ranked = [o for o in decision.ranked if Market(o.market) is wanted] or list(decision.ranked)
    best = ranked[0]
    mtbf = 3600.0 / best.preemption_rate_per_hour if best.is_spot and best.preemption_rate_per_hour > 0 else None
    return Plan(
        ranked=ranked,
        market=wanted,
        reason=(
            f"{decision.market} ({decision.reason}); "
            f"best {best.instance_type} in {best.zone} at ${best.price_per_hour:.4f}/h"
            + ("" if declared is None else f"; {declared:.3g} s per step from {profile_source}")
            + ("" if not converted else f"; work counted at {reference.instance_type}'s pace")
            + ("" if decision.preemption_rate_per_hour is None
               else f"; this job's preemptions {decision.preemption_rate_per_hour:.2f}/h with the prior")
        ),
        mtbf_seconds=mtbf,
        committed=decision.state.committed,
        wait=decision.market == WAIT,
        leave_running=decision.leave_running,
        probe=decision.probe,
        move_to=list(decision.move_to),
        settle_probe=list(decision.settle_probe),
        market_offers=market_offers,
        price_cap=gpus.max_price_per_hour,
    )


def fallback_reference(offers: Sequence[Offer], params: Any, steps_left: int, pace: Any) -> Offer:
    """:func:`~airflow_spot.policy.decision.work_reference` (the on-demand offer the decision falls back to)
    with the work left counted at the reference's own pace (``pace(offer)``:
    seconds per step there, None unknown), since the ranking spreads a checkpoint's move over the work left:
    the offer whose pace ranks it first. Where no offer is (the ranking flips between two), the slowest of
    those met, so that the deadline holds on either."""
    def work(ref: Offer | None) -> float:
        seconds = pace(ref) if ref is not None else None
        return steps_left * (seconds if seconds else 1.0)

    ref = work_reference(offers, params, work(None))
    seen = [ref]
    for _ in range(4):
        nxt = work_reference(offers, params, work(ref))
        if nxt == ref:
            return ref
        if nxt in seen:
            break
        seen.append(nxt)
        ref = nxt
    return min(seen, key=lambda o: o.relative_throughput)


def profile_step_seconds(profile: dict[str, float], offer: Offer, market_offers: Sequence[Offer] = ()) -> float | None:
    """Seconds per step a declared ``{GPU model: seconds}`` profile predicts on ``offer``: fitted on the
    profile's GPUs' relative throughputs (the market's, as its offers of one such GPU state them with any
    ``throughput_overrides``; else the catalog's) and evaluated at ``offer.relative_throughput``, the figure
    a measured step time is converted with. None when no GPU of the profile has a throughput figure."""
    from airflow_spot.market.throughput import instance_throughput
    from airflow_spot.policy.estimate import fit_step_time

    per_gpu = {o.gpu_name: o.relative_throughput for o in market_offers if o.gpu_count == 1}
    measured = {}
    for gpu, seconds in profile.items():
        try:
            x = per_gpu.get(gpu) or instance_throughput(gpu, 1)
        except KeyError:
            continue
        if x > 0:
            measured[x] = float(seconds)
    if not measured or not offer.relative_throughput > 0:
        return None
    return fit_step_time(measured).step_seconds(offer.relative_throughput)


#: accounted attempts, newest first by their ledger row's end, whose heartbeats a segment start reads
RECENT_HEARTBEATS = 8


def measured_step_seconds(layout: Any, rows: list | None = None) -> float | None:
    """Seconds per step of the job's most recent heartbeat (any attempt), or None before the first
    (see :func:`measured_step`)."""
    beat = measured_step(layout, rows)
    return beat.step_time_ewma if beat is not None else None


def measured_step(layout: Any, rows: list | None = None) -> Any:
    """The job's most recent heartbeat with a step time (any attempt; its ``attempt_id`` says which
    instance measured it), or None before the first.

    :param rows: the job's ledger rows, when the caller has them: then only the heartbeats of the attempts
        without a row (running, or not yet accounted) and of the :data:`RECENT_HEARTBEATS` accounted ones
        that ended last are read, not one per attempt of the job's history (a job's attempts run one after
        another, so an older one's last beat is older); all of them when none of those has a step time.
    """
    keys = layout.attempt_keys(layout.store, layout.HEARTBEAT_NAME)
    if rows:
        ended = {r.attempt_id: r.ended_at for r in rows}
        recent = set(sorted(ended, key=ended.get, reverse=True)[:RECENT_HEARTBEATS])

        def attempt(key: str) -> str:  # control/attempts/<attempt id>/heartbeat.json
            return key[len(layout.ATTEMPTS_PREFIX):].rsplit("/", 1)[0]

        candidates = [k for k in keys if attempt(k) not in ended or attempt(k) in recent]
        found = _newest_step_time(layout.store.get_many(candidates).values())
        if found is not None or len(candidates) == len(keys):
            return found
        taken = set(candidates)
        keys = [k for k in keys if k not in taken]
    return _newest_step_time(layout.store.get_many(keys).values())


def _newest_step_time(raws) -> Any:
    from airflow_spot.storage.protocol import Heartbeat, SchemaError

    newest = None
    for raw in raws:
        try:
            hb = Heartbeat.from_json(raw)
        except (KeyError, SchemaError):
            continue
        if hb.step_time_ewma and (newest is None or hb.time > newest.time):
            newest = hb
    return newest


#: a segment longer than this keeps a job on on-demand long after spot is back: with a deadline, where the
#: job runs is decided at segment boundaries (replayed at 52 h, bundled traces: 1.206 x hindsight with
#: 60 min segments against 1.156 with 15 min; 2022 set 1.163 against 1.156 at 30 min)
LONG_SEGMENT_SECONDS = 45 * 60.0


def segment_length_advice(steps: int, step_seconds: float | None, deadline: timedelta | None) -> str | None:
    """A warning when this job's segments last so long that the deadline policy decides too rarely."""
    if deadline is None or not step_seconds or steps <= 0:
        return None
    seconds = steps * step_seconds
    if seconds <= LONG_SEGMENT_SECONDS:
        return None
    suggested = max(1, int(round(20 * 60 / step_seconds)))
    return (f"segments of {steps} steps last about {seconds / 60:.0f} min at the measured {step_seconds:.3g} s "
            "per step; with a deadline, spot or on-demand is decided at segment boundaries, so a job on "
            "on-demand stays there up to a segment after spot is back (hour-long segments cost 1–4 % more in "
            f"replays); steps_per_segment={suggested} gives ~20 min segments")


def pick_warm(alive: Sequence[InstanceInfo], plan_: Plan) -> InstanceInfo | None:
    """The warm instance to reuse, priced now (:func:`priced_now`): one in the market the policy wants,
    of a type the request still takes in its region, whose price now is within the request's cap; the
    cheapest per step of them at today's prices. Whether a warm spot instance should give way to a
    cheaper pool is the policy's (``Plan.move_to``), tried before the instance is let go."""
    offers = plan_.market_offers or plan_.ranked
    takes = {(o.instance_type, o.region) for o in offers}  # a changed GPU request or regions: let it go
    good = []
    for i in alive:
        if Market(i.offer.market) is not plan_.market or (i.offer.instance_type, i.offer.region) not in takes:
            continue
        if plan_.leave_running and i.offer.is_spot:
            continue
        priced = priced_now(i, offers)
        if plan_.price_cap is None or priced.offer.price_per_hour <= plan_.price_cap:
            good.append(priced)
    return min(good, key=lambda i: plan_.cost_of(i.offer), default=None)


def priced_now(instance: InstanceInfo, offers: Sequence[Offer]) -> InstanceInfo:
    """A warm instance as the next attempt bills it: at the price ``offers`` (the market's, now) quote for
    its instance type and market in its zone (spot: a pool's price) or its region (on-demand, which a market
    may offer per region), not the price it was launched at. The cloud bills a running spot instance the
    price in effect, and a warm instance can serve many segments; one the market no longer offers keeps
    its own price."""
    old = instance.offer
    market = Market(old.market)
    for now in offers:
        if now.instance_type == old.instance_type and Market(now.market) is market and (
                now.zone == old.zone if market is Market.SPOT else now.region == old.region):
            return replace(instance, offer=replace(
                old, price_per_hour=now.price_per_hour, on_demand_price_per_hour=now.on_demand_price_per_hour,
                preemption_rate_per_hour=now.preemption_rate_per_hour))
    return instance


class AvailabilityRecorder:
    """Writes the job's pool events to its own log (``control/availability/`` in the job's store) and to
    the deployment's availability log (:mod:`airflow_spot.storage.availability`).

    The deployment log is a hint shared with other jobs: a failure to write it is logged, never fatal;
    the job's own log is part of its state (its capacity refusals) and must be written.
    """

    def __init__(self, job_store: Any, deployment_store: Any | None, job: str, log: Any = None) -> None:
        from airflow_spot.storage.availability import AvailabilityLog, job_availability_log

        self.job_log = job_availability_log(job_store)
        self.deployment_log = AvailabilityLog(deployment_store) if deployment_store is not None else None
        self.job = job
        self._log = log

    def job_events(self) -> list:
        return self.job_log.read()

    def record(self, pool: str, kind: str, at: float) -> None:
        from airflow_spot.policy.observations import PoolEvent

        event = PoolEvent(pool, kind, at, self.job)
        self.job_log.append(event)
        if self.deployment_log is None:
            return
        try:
            self.deployment_log.append(event)
        except Exception as exc:  # noqa: BLE001 - the shared log is a hint; the job goes on without it
            if self._log is not None:
                self._log.warning("could not write the deployment's availability log (%s: %s)",
                                  type(exc).__name__, exc)


def probe_spot(backend: Any, offers: Sequence[Offer], make_spec: Any, recorder: AvailabilityRecorder,
               now: float, log: Any = None, retries: int = PROBE_RETRIES, bill: Any = None) -> int:
    """Probe the spot pools of ``offers``: place a launch in each and terminate it at once; record
    ``probe-up`` (it launched: the pool has capacity) or ``probe-down`` (a capacity refusal). A probe that
    launched is billed its minimum (the simulator charges the same). Returns how many pools answered.

    A capacity refusal is asked again up to ``retries`` times before it counts: a fulfilled request is
    capacity, but an unfulfilled one may be a miss, and a false "down" costs the job the pool's observed
    up-time, which it needs before leaving on-demand (``benchmarks/results_simulate.md``, "Probes that
    miss"). A refused request is not billed, so the retry costs only an API call.

    :param make_spec: ``(offer, try_number) -> LaunchSpec`` (tags and idempotency token of this probe;
        each try needs its own token).
    :param bill: ``(offer, instance, ended_at)``, called for each probe that launched, once it is
        terminated: the job's cost holds its bill (``LedgerStore.write_probe``).
    """
    answered = 0
    for offer in offers:
        if not offer.is_spot:
            continue
        has_capacity = _probe_pool(backend, offer, make_spec, retries, log, bill)
        if has_capacity is not None:
            recorder.record(offer.pool, "probe-up" if has_capacity else "probe-down", now)
            answered += 1
    return answered


def _probe_pool(backend: Any, offer: Offer, make_spec: Any, retries: int, log: Any, bill: Any = None) -> bool | None:
    """True: a probe launched (and was terminated); False: it was refused for capacity (every try, or a
    try before one that failed otherwise); None: it failed for another reason (logged, nothing learned)."""
    from airflow_spot.backends.base import LaunchError

    refused = False
    for attempt in range(1 + max(0, retries)):
        try:
            info = backend.launch(make_spec(offer, attempt))
        except LaunchError as exc:
            if not exc.capacity:
                if log is not None:
                    log.warning("probe of %s failed (%s)%s", offer.pool, exc,
                                "; its earlier try was refused for capacity" if refused else "; skipped")
                return False if refused else None
            refused = True
            continue
        backend.terminate([info.instance_id])
        if bill is not None:
            bill(offer, info, time.time())
        return True
    return False
