"""The one decision the operators and the simulator both make: where the job runs next.

:func:`decide_attempt` takes a :class:`~airflow_spot.policy.observations.JobObservation` — the job's
progress, its offers and the pool events it has (its own ledger and the deployment's availability log),
nothing read from a trace — and returns the market (spot / on-demand / wait), the offers in the order to
try them, and whether spot pools should be probed. ``SpotSegmentOperator`` (through
:func:`airflow_spot.operators.planning.plan`) and the simulator's ``ours`` controller
(:mod:`airflow_spot.simulate.controllers`) call it with the same observation type; both then try the
ranked offers in order, record each launch and refusal as a pool event, and, when every spot offer
refused, decide once more with those refusals (then the answer is on-demand or wait).

What is derived from the events (:mod:`airflow_spot.policy.observations`): which pools are believed up,
down or unknown; how long the best believed-up pool has been seen up (``spot_up_seconds``; a pool
seen down — refused, probed down, preempted — within the last ``recheck_seconds`` after a run counts
with that run: a job that decides to leave on-demand for a settled pool and is refused there takes the
next pool that accepts, so a refusal seen just before deciding, another job's from the log, must not
change what it does); how long
every pool has refused the job (``no_spot_seconds``); the expected outage length; the job's own
preemption rate, which scales the slack kept for future preemptions when leaving on-demand. The
deadline rule is :func:`airflow_spot.policy.deadline.slack_budget` by default.

Ranking of spot offers: the pools not believed down (believed up, or unknown) before those that just
refused; among them the cheapest per unit of work in the long run first (price over throughput, the
market's preemption rate, and any checkpoint move: see below), and at equal cost: believed up before
unknown, then the cost with each pool's preemption risk raised while its observed up-time is short
(:func:`~airflow_spot.policy.offer_ranking.cost_per_step`; a pool not seen up since it was last seen down
is priced as if it came back right after that down-event — the most it can have been up — so a pool that
refused or preempted the job a while ago ranks after one never seen down), then the longest observed
up-time, then the pool name. A cheaper pool not known to be down goes before a pricier one known up:
trying it costs a refusal (seconds, no money), while the pricier one costs its price for as long as the
job stays (found in replays of a job that finds the deployment's log: it followed an earlier job's
instance into a pricier pool and stayed, `benchmarks/results_simulate.md`).

Prices may differ per region; moving the job's checkpoint to another region than the one it is in
costs ``transfer_seconds`` of restart and ``transfer_dollars`` (:class:`DecisionParams`), which the
ranking adds per unit of work left; with the checkpoints in one store, running outside its region also
costs ``remote_dollars_per_hour`` (the saves written back), added to the offer's price.

A spot offer that costs at least as much as on-demand of its own instance type (:func:`dearer_than_on_demand`:
prices only, with the saves written back and any checkpoint move) is no spot opportunity: the decision
leaves it out, and a job running in such a pool leaves it (``AttemptDecision.leave_running``). While
cheaper pools are offered but down, the deadline rule waits for them as for any outage; when no cheaper
one is offered at all, the job runs on-demand, deadline or not (found by a user's check: with a store in another region,
the saves written back made every spot pool there dearer than on-demand, and the job ran on them anyway).

Moving a running spot job to a cheaper pool (:func:`move_targets`): at a segment boundary, a job on a
spot instance that is still up moves when another pool's long-run cost per unit of work is lower by
enough that, over the work left but at most the target's expected lifetime (its prior MTBF, shortened
while the pool is young: :func:`~airflow_spot.policy.offer_ranking.risk_multiplier` of its observed
up-time, or of half the time since it was last seen down; and shortened by the job's own preemptions
anywhere in the target's region, which fade over two prior lifetimes: :data:`REGION_MEMORY_LIFETIMES`),
the saving pays ``move_margin`` times the move: the new instance's restart (and the checkpoint's
transfer across regions); with a deadline, only while the slack pays that restart, one more (the
target's own preemption, should it come soon), the floor and the reserve for future preemptions (as when
leaving on-demand). A target's prior rate is the market's scaled by the job's own preemption rate
against it (:func:`~airflow_spot.policy.observations.own_preemption_rate`): a job whose instances have
lasted expects the same of a region it has not tried, one preempted often expects less. A target
passes only once it has been seen up ``min_spot_up_seconds`` (the deadline rule's wait before leaving
on-demand): until then the decision names it in ``settle_probe``, and a backend that can probes it at
each segment boundary (one billed minute a probe) and moves once it has settled; one that cannot moves
as before (found on the bundled traces at the catalog's prices: a job moved back, again and again, into a
region that had come back minutes before and preempted it within the hour). The job tries the targets
first and keeps its instance if they all refuse (a refusal is not billed). Prices that are equal
everywhere never move a job: the saving counts prices and long-run rates, not the pools' ages.

Pure: everything is passed in.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from airflow_spot.policy.checkpoint_interval import estimate_mtbf
from airflow_spot.policy.deadline import (
    WAIT, DeadlineParams, DeadlineState, Observation, decide, switch_spare,
)
from airflow_spot.policy.observations import (
    WATCH_SECONDS, JobObservation, PoolEvent, PoolView, expected_outage_seconds, own_pool_losses, own_preemption_rate,
    pool_views,
)
from airflow_spot.policy.offer_ranking import RankingParams, cost_per_step, risk_multiplier
from airflow_spot.policy.offers import Market, Offer

_STATE_ORDER = {"up": 0, "unknown": 1, "down": 2}
#: the job's own losses in a region fade, for the move rule, with this many of the market's prior
#: lifetimes (7.2 h at 3.6 h): a region that flapped this morning is not worth a move back, one that
#: flapped yesterday is. On the replays of `benchmarks/results_simulate.md` ("A region that keeps
#: preempting the job"), 52 h: never fading (a Gamma estimate of a fixed rate) barred a region for the
#: rest of a job after one bad hour (H100 worst start against the anchors 1.021 -> 1.068); 1 / 2 / 4
#: lifetimes: 1.027 / 1.034 / 1.037 there, and on the nine-zone one-store set worst 1.90 / 1.51 / 1.39
#: against 2.05 before (every third start)
REGION_MEMORY_LIFETIMES = 2.0

#: constants of the deadline rule where they differ from ``oracle-age``'s (chosen on the even hourly
#: offsets at 52 h of the bundled traces, ``benchmarks/results_simulate.md``): the slack kept for future
#: preemptions when leaving on-demand scales with the pool's hazard given its observed up-time (0.03
#: at 45 min, 0.02 at 3 h, -> 0.015 per second of work left; and with the job's own preemption rate,
#: ``DecisionParams.rate_prior_hours``); a job that cannot keep that reserve still leaves on-demand
#: for a pool up 2 h when its slack pays the restart and the floor (1 / 2 / 4 h: 1.172 / 1.153 /
#: 1.155 x hindsight)
OBSERVED_DEADLINE_DEFAULTS = {"spot_reserve_per_work": 0.015, "spot_reserve_age_seconds": 3600.0,
                              "last_shot_up_seconds": 7200.0}


def observed_deadline_params(**overrides) -> DeadlineParams:
    """The deadline constants the operators and the simulator's ``ours`` use."""
    return DeadlineParams(**{**OBSERVED_DEADLINE_DEFAULTS, **overrides})


@dataclass(frozen=True)
class DecisionParams:
    """:param deadline: the deadline rule's constants.
    :param ranking: the offer ranking's constants.
    :param policy: the registered deadline policy (:mod:`airflow_spot.policy.deadline`).
    :param recheck_seconds: a pool that refused or preempted this recently is believed down; older, it is
        worth another try (an idle job retries about this often).
    :param watch_seconds: an outage is measured only when someone saw the pool down this shortly before
        it came back, so its length is known to within this. Shorter than ``probe_every_seconds`` on
        purpose: with a watch equal to the probe interval, whether an outage seen only between two probes
        counted hung on the probes' exact spacing (the replay's once came 928 s apart, rounded to the
        traces' 32 s ticks; the operators' come whenever Airflow runs the task). The outages that count are those an idle job's retries (seconds
        apart in the operators) see end.
    :param prior_outage_seconds: the expected outage length before any outage was observed (weighted as two
        outages). 0 by default: with no outage seen, an idle job waits only the deadline rule's grace
        (on the bundled traces, 52 h even offsets, a 30 min prior cost 1.215 -> 1.196 x hindsight; 5 and
        20 min cost more still: waiting without evidence spends slack the restarts need)
    :param rate_prior_hours: the slack kept for future preemptions when leaving on-demand
        (``DeadlineParams.spot_reserve_per_work``) scales with the job's own preemption rate over the
        market's prior (the spot offers' mean ``preemption_rate_per_hour``): the restarts still to come
        are the work left times that rate. The prior weighs as this many hours of spot time
        (:func:`~airflow_spot.policy.observations.own_preemption_rate`); None: the market's prior alone.
        On the bundled traces, 52 h even offsets, before ``last_shot_up_seconds``: 10 / 20 / 40 / 80 h
        gave 1.158 / 1.154 / 1.153 / 1.162 x hindsight against 1.168 unscaled
        (``benchmarks/results_simulate.md``).
    :param probe_every_seconds: on on-demand, ask for a probe of the spot pools when the newest spot
        observation is this old (executors that cannot probe ignore it).
    :param transfer_seconds: restart time added when the next instance is in another region than the
        job's checkpoint (``JobObservation.offers`` carry regions; see ``home_region``).
    :param transfer_dollars: money per cross-region move (egress of one checkpoint).
    :param home_region: the region the job's checkpoint is in, or None (no transfer cost).
    :param remote_dollars_per_hour: money per hour of running outside ``home_region`` when that is the one
        store every save is written to (:mod:`airflow_spot.policy.transfer`); the ranking and the move
        rule add it to the price of every offer there.
    :param move_margin: a running spot job moves to a cheaper pool only when the saving over the target's
        expected lifetime pays this many times the move (:func:`move_targets`); None never moves. 2: a
        target preempted halfway through its expected lifetime still pays for the move.
    """

    deadline: DeadlineParams = field(default_factory=observed_deadline_params)
    ranking: RankingParams = field(default_factory=RankingParams)
    policy: str = "slack-budget"
    recheck_seconds: float = 60.0
    watch_seconds: float = WATCH_SECONDS
    prior_outage_seconds: float = 0.0
    rate_prior_hours: float | None = 20.0
    probe_every_seconds: float = 900.0
    transfer_seconds: float = 0.0
    transfer_dollars: float = 0.0
    home_region: str | None = None
    remote_dollars_per_hour: float = 0.0
    move_margin: float | None = 2.0

    def __post_init__(self) -> None:
        for name in ("recheck_seconds", "watch_seconds", "prior_outage_seconds", "probe_every_seconds",
                     "transfer_seconds", "transfer_dollars", "remote_dollars_per_hour"):
            if not getattr(self, name) >= 0:  # also NaN
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.rate_prior_hours is not None and self.rate_prior_hours <= 0:
            raise ValueError(f"rate_prior_hours must be > 0 or None, got {self.rate_prior_hours!r}")
        if self.move_margin is not None and not self.move_margin > 0:
            raise ValueError(f"move_margin must be > 0 or None, got {self.move_margin!r}")


@dataclass(frozen=True)
class AttemptDecision:
    """:param market: ``spot``, ``on-demand`` or ``wait``.
    :param ranked: the offers of that market (spot offers when waiting) in the order to try them.
    :param probe: on on-demand: the spot pools' state is stale; probe them if the backend can.
    :param state: pass it to the next call."""

    market: str
    ranked: tuple[Offer, ...]
    reason: str
    state: DeadlineState
    probe: bool = False
    spot_up_seconds: float | None = None
    expected_outage_seconds: float | None = None
    #: the job's own preemption rate the spot reserve was scaled with (None: not scaled)
    preemption_rate_per_hour: float | None = None
    #: a job on a spot instance that is up: cheaper pools worth moving to, best first (empty: stay)
    move_to: tuple[Offer, ...] = ()
    #: the job's running spot instance is in a pool that now costs as much as on-demand of its type: let
    #: it go and run as decided (``market``, ``ranked``), as an idle job would
    leave_running: bool = False
    #: a job on a spot instance that is up: cheaper pools worth a move but not yet seen up
    #: ``min_spot_up_seconds``, due a probe; a backend that cannot probe moves to them (after ``move_to``)
    settle_probe: tuple[Offer, ...] = ()


def _move_penalty(offer: Offer, params: DecisionParams, work_left: float) -> float:
    """Extra $ per V100-hour of work for moving the checkpoint to ``offer``'s region."""
    if params.home_region is None or offer.region == params.home_region or work_left <= 0:
        return 0.0
    dollars = params.transfer_dollars + params.transfer_seconds / 3600.0 * offer.price_per_hour
    return dollars / (work_left / 3600.0)


def _remote_dollars_per_hour(offer: Offer, params: DecisionParams) -> float:
    """What an hour on ``offer`` costs in saves written back to the store in another region (0 at home)."""
    if params.remote_dollars_per_hour and params.home_region and offer.region != params.home_region:
        return params.remote_dollars_per_hour
    return 0.0


def _cost_per_step(offer: Offer, params: DecisionParams, age: float | None = None) -> float:
    """:func:`cost_per_step`, with the saves written back to a store in another region."""
    return (cost_per_step(offer, params.ranking, age)
            + _remote_dollars_per_hour(offer, params) / offer.relative_throughput)


def dearer_than_on_demand(spot: Sequence[Offer], on_demand: Sequence[Offer], params: DecisionParams,
                          work_left: float) -> list[Offer]:
    """The spot offers that cost at least as much as on-demand of their own instance type (the cheapest
    region's, with the saves written back and a checkpoint move on either side): one type against itself,
    so no throughput estimate decides, only prices. A type not offered on-demand is never dearer."""
    def price(o: Offer) -> float:
        return ((o.price_per_hour + _remote_dollars_per_hour(o, params)) / o.relative_throughput
                + _move_penalty(o, params, work_left))

    floor: dict[str, float] = {}
    for o in on_demand:
        floor[o.instance_type] = min(price(o), floor.get(o.instance_type, float("inf")))
    return [o for o in spot if o.instance_type in floor and price(o) >= floor[o.instance_type]]


def _risk_age(offer: Offer, view: PoolView | None, now: float) -> float | None:
    """The up-time a spot pool's risk is priced with: observed, or for a pool last seen down, the most it
    can have been up since."""
    if view is None or not offer.is_spot:
        return None
    age = view.up_seconds(now)
    return view.up_seconds_at_most(now) if age is None else age


def move_targets(
    offers: Sequence[Offer], running_pool: str, views: dict[str, PoolView], now: float, params: DecisionParams,
    work_left: float, affordable: bool, own_losses: dict[str, tuple[float, float]] | None = None,
    rate_scale: float = 1.0,
) -> tuple[Offer, ...]:
    """The spot offers (in the order given) a job running in ``running_pool`` should move to, by the rule
    in the module docstring; ``affordable``: the deadline's slack pays one more restart; ``own_losses``:
    per pool, the job's own preemptions there and its instances' seconds there, faded with their age
    (:func:`~airflow_spot.policy.observations.own_pool_losses`); ``rate_scale``: the job's own preemption
    rate over the market's, applied to every target's prior rate."""
    current = next((o for o in offers if o.pool == running_pool and o.is_spot), None)
    if current is None or params.move_margin is None or not affordable or work_left <= 0:
        return ()
    restart_hours = params.deadline.restart_overhead_seconds / 3600.0
    base = _cost_per_step(current, params)
    # capacity in one region comes and goes together: the job's own losses anywhere in the target's region
    # shorten the bet on the target (found on a one-store replay: a job moved home five times into a
    # region whose pools preempted it each time, `benchmarks/results_simulate.md`)
    region_of = {o.pool: o.region for o in offers}
    by_region: dict[str, tuple[float, float]] = {}
    for pool, (losses, seconds) in (own_losses or {}).items():
        if pool in region_of:
            n, t = by_region.get(region_of[pool], (0, 0.0))
            by_region[region_of[pool]] = (n + losses, t + seconds)
    out = []
    for o in offers:
        v = views.get(o.pool)
        if not o.is_spot or o.pool == running_pool or (v is not None and v.state == "down"):
            continue
        saving = base - _cost_per_step(o, params)  # $ per V100-hour, long-run rates: ages do not move
        if saving <= 0:
            continue
        age = _risk_age(o, v, now)
        if age is not None and v is not None and v.up_seconds(now) is None:
            # not seen up since it was seen down: if it is up, it came back at some time since then, half
            # way on average (the ranking's "at most" orders pools; a move bets on the expected lifetime)
            age /= 2.0
        rate = o.preemption_rate_per_hour * rate_scale
        if rate > 0 and o.region in by_region:
            # the market's rate as a prior worth one preemption (estimate_mtbf's default), moved by the job's own
            rate = 3600.0 / estimate_mtbf(3600.0 / rate, *by_region[o.region])
        rate *= risk_multiplier(age, params.ranking.cooldown_seconds)
        horizon = work_left / 3600.0 if rate <= 0 else min(work_left / 3600.0, 1.0 / rate)
        move = restart_hours * o.price_per_hour / o.relative_throughput
        move += _move_penalty(o, params, work_left) * work_left / 3600.0
        if saving * horizon >= params.move_margin * move:
            out.append(o)
    return tuple(out)


def rank_observed(
    offers: Sequence[Offer], views: dict[str, PoolView], now: float, params: DecisionParams, work_left: float
) -> list[Offer]:
    """Offers best first by the rule in the module docstring."""

    def key(o: Offer):
        v = views.get(o.pool)
        state = v.state if (v is not None and o.is_spot) else ("up" if not o.is_spot else "unknown")
        age = v.up_seconds(now) if v is not None and o.is_spot else None
        move = _move_penalty(o, params, work_left)
        # the price decides first: trying a cheaper pool not known to be down costs only a refusal
        price = _cost_per_step(o, params) + move
        # a pool last seen down is, if back, at most this old: priced as a pool that came back then
        cost = _cost_per_step(o, params, _risk_age(o, v, now)) + move
        return (state == "down", round(price, 9), _STATE_ORDER[state], round(cost, 9), -(age or 0.0), o.pool)

    return sorted(offers, key=key)


def work_reference(offers: Sequence[Offer], params: DecisionParams | None = None, work_left: float = 0.0) -> Offer:
    """The offer whose pace the deadline rule's work is counted in: the on-demand offer the decision falls
    back to (the first of the on-demand offers as :func:`rank_observed` ranks them: cost per unit of work,
    the checkpoint's move and remote saves included), so that "the work left fits on on-demand" holds on the
    instance the job would get; with no on-demand offer, the slowest offer."""
    on_demand = [o for o in offers if not o.is_spot]
    if on_demand:
        return rank_observed(on_demand, {}, 0.0, params or DecisionParams(), work_left)[0]
    return min(offers, key=lambda o: o.relative_throughput)


def decide_attempt(
    obs: JobObservation, state: DeadlineState | None = None, params: DecisionParams | None = None
) -> AttemptDecision:
    """Where the job's next attempt runs (see the module docstring)."""
    params = params or DecisionParams()
    state = state or DeadlineState()
    now = obs.now
    on_demand = [o for o in obs.offers if not o.is_spot]
    dear = {o.pool for o in dearer_than_on_demand([o for o in obs.offers if o.is_spot], on_demand, params,
                                                  obs.work_total - obs.work_done)}
    spot = [o for o in obs.offers if o.is_spot and o.pool not in dear]
    events = list(obs.events)
    running = Market(obs.running) if obs.running else None
    if running is Market.SPOT and obs.running_pool:
        events.append(PoolEvent(obs.running_pool, "running", now))
    # a running spot instance whose pool now costs as much as on-demand has to go: decide as if idle
    leave = running is Market.SPOT and obs.running_pool in dear
    if leave:
        running = None
    views = pool_views(events, now, [o.pool for o in spot], params.recheck_seconds, params.watch_seconds)
    spot_views = [views[o.pool] for o in spot]
    worth = [v for v in spot_views if v.state != "down"]
    up_ages = [v.up_seconds(now) or 0.0 for v in worth if v.state == "up"]
    # a pool not seen up counts as just come back: leaving on-demand waits for evidence it has settled
    spot_up = max(up_ages) if up_ages else (0.0 if worth else None)
    settled_by = None  # a pool that went down a moment ago, whose run stands for the market's settledness
    if worth:
        # a settled pool down a moment ago still counts (the module docstring says why)
        just_ended = [(v.last_run_seconds, v.pool) for v in spot_views if v.up_since is None
                      and v.last_run_seconds and v.down_since is not None
                      and now - v.down_since < params.recheck_seconds]
        if just_ended and max(just_ended)[0] > (spot_up or 0.0):
            spot_up, settled_by = max(just_ended)
    no_spot = None
    if spot_views and not worth:
        # every pool refuses: the outage began when the last of them went down
        no_spot = max(0.0, now - max(v.down_since for v in spot_views if v.down_since is not None))
    expected = expected_outage_seconds(views.values(), params.prior_outage_seconds)
    if not spot:
        spot_up, expected = None, None
    dobs = Observation(
        started_at=obs.started_at, deadline_at=obs.deadline_at, work_done=obs.work_done,
        work_total=obs.work_total, spot_available=bool(worth), running=running, spot_up_seconds=spot_up,
        no_spot_seconds=no_spot, expected_outage_seconds=expected,
    )
    work_left = obs.work_total - obs.work_done
    deadline_params = params.deadline
    rate = None
    priors = [o.preemption_rate_per_hour for o in spot if o.preemption_rate_per_hour > 0]
    prior = sum(priors) / len(priors) if priors else None
    if prior is not None and params.rate_prior_hours is not None:
        rate = own_preemption_rate(events, now, prior, params.rate_prior_hours)
        deadline_params = replace(deadline_params,
                                  spot_reserve_per_work=deadline_params.spot_reserve_per_work * rate / prior)
    best_spot = rank_observed(spot, views, now, params, work_left)[:1]
    if best_spot and params.home_region and best_spot[0].region != params.home_region:
        # going to spot means moving the checkpoint: a longer restart for the deadline rule
        deadline_params = replace(deadline_params, restart_overhead_seconds=(
            deadline_params.restart_overhead_seconds + params.transfer_seconds))
    d = decide(state, dobs, now, deadline_params, params.policy)
    if not spot and on_demand and (dear or d.market == WAIT):
        # no spot offer is cheaper than on-demand (or none is offered): waiting buys nothing
        d = replace(d, market=Market.ON_DEMAND.value,
                    reason="no spot offer costs less than on-demand of its type" if dear
                    else "no spot offer in the request")
    if leave:
        d = replace(d, reason=f"{d.reason}; leaving {obs.running_pool}, which now costs as much as on-demand")
    if settled_by is not None and d.market == Market.SPOT.value and running is Market.ON_DEMAND:
        d = replace(d, reason=f"{d.reason} (the up-time of {settled_by}, down a moment ago; the next pool "
                              "that accepts is taken)")
    if d.market == Market.ON_DEMAND.value:
        ranked = rank_observed(on_demand or spot, views, now, params, work_left)
    else:
        ranked = rank_observed(spot or on_demand, views, now, params, work_left)
    probe = False
    if running is Market.ON_DEMAND and d.market == Market.ON_DEMAND.value and spot and not d.state.committed:
        newest = max((e.at for e in events if e.pool in views and e.at <= now), default=None)
        if newest is None or now - newest >= params.probe_every_seconds:
            # probe only when a settled pool would change the answer
            settled = replace(dobs, spot_available=True, spot_up_seconds=float("inf"))
            probe = decide(state, settled, now, deadline_params, params.policy).market == Market.SPOT.value
    moves: tuple[Offer, ...] = ()
    if running is Market.SPOT and obs.running_pool and d.market == Market.SPOT.value:
        move_params = replace(params, deadline=deadline_params)
        # a move bets on a pool the job has not proved: the slack must pay its restart and, should the
        # target go soon, the restart after that, not only the one
        affordable = obs.deadline_at is None or switch_spare(dobs, now, deadline_params, None) >= (
            deadline_params.restart_overhead_seconds)
        memory = None if prior is None else REGION_MEMORY_LIFETIMES * 3600.0 / prior
        moves = move_targets(ranked, obs.running_pool, views, now, move_params, work_left, affordable,
                             own_pool_losses(events, now, memory), 1.0 if rate is None else rate / prior)
    settle: tuple[Offer, ...] = ()
    if moves:
        moves, settle = _settled(moves, views, events, now, params)
    return AttemptDecision(d.market, tuple(ranked), d.reason, d.state, probe, spot_up, expected, rate, moves,
                           leave_running=leave, settle_probe=settle)


def _settled(targets: Sequence[Offer], views: dict[str, PoolView], events: Sequence[PoolEvent], now: float,
             params: DecisionParams) -> tuple[tuple[Offer, ...], tuple[Offer, ...]]:
    """The move targets seen up ``min_spot_up_seconds``, and those of the rest due a probe (none of their
    events newer than ``probe_every_seconds``): a pool that came back a moment ago tends to go again soon,
    and a move into it pays two restarts for minutes of a cheaper price."""
    wanted = params.deadline.min_spot_up_seconds
    pools = {o.pool for o in targets}
    newest: dict[str, float] = {}  # one pass over the events, which hold the deployment's log
    for e in events:
        if e.pool in pools and e.at <= now and e.at > newest.get(e.pool, -math.inf):
            newest[e.pool] = e.at
    ready, due = [], []
    for o in targets:
        v = views.get(o.pool)
        age = None if v is None else v.up_seconds(now)
        if age is not None and age >= wanted:
            ready.append(o)
            continue
        if o.pool not in newest or now - newest[o.pool] >= params.probe_every_seconds:
            due.append(o)
    return tuple(ready), tuple(due)


def as_launch_market(decision: AttemptDecision) -> AttemptDecision:
    """For executors that cannot idle (the operators): waiting for spot means trying spot offers."""
    if decision.market == WAIT:
        return replace(decision, market=Market.SPOT.value)
    return decision
