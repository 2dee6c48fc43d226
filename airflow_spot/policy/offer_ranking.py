"""Which offer to take: the cheapest per unit of training work, not per hour.

Cost per unit of work (one V100-hour of training, see ``Offer.relative_throughput``)::

    price_per_hour / relative_throughput * (1 + preemption_rate_per_hour * overhead_hours)

where ``overhead_hours`` is what one preemption costs in paid time without progress (relaunch, boot,
restore, the step in flight). A pool that preempted this job less than ``cooldown_seconds`` ago is ranked
after every other pool (it is the pool most likely to do it again soon: capacity there is short), but is
still kept so a job never runs out of offers because of a cool-down.

Pure: time and the job's preemption history are passed in.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from airflow_spot.policy.offers import Market, Offer
from airflow_spot.policy.registry import PolicyRegistry

offer_ranking_policies = PolicyRegistry("offer-ranking")

#: paid time without progress per preemption: a new instance boots, pulls the checkpoint and warms up
DEFAULT_OVERHEAD_SECONDS = 600.0
#: a pool that just preempted us is avoided this long
DEFAULT_COOLDOWN_SECONDS = 1800.0


@dataclass(frozen=True)
class RankingParams:
    """:param overhead_seconds: paid time without progress per preemption.
    :param cooldown_seconds: how long a pool that preempted this job is ranked last."""

    overhead_seconds: float = DEFAULT_OVERHEAD_SECONDS
    cooldown_seconds: float = DEFAULT_COOLDOWN_SECONDS

    def __post_init__(self) -> None:
        if self.overhead_seconds < 0 or self.cooldown_seconds < 0:
            raise ValueError("overhead_seconds and cooldown_seconds must be >= 0")


def risk_multiplier(seconds_since_loss: float | None, cooldown_seconds: float) -> float:
    """How much riskier than its long-run rate a pool is, given the time since it last lost capacity.

    Spot capacity that just came back tends to go again soon: on the four measured p3.2xlarge traces a
    fresh up period lasts a median 0.3-1 h, while one that has already lasted 2 h has 3.5-6 h more on
    average (a decreasing hazard). ``1 + c / (age + c / 4)``: 5x at age 0, 1.8x at one cool-down, -> 1.
    """
    if seconds_since_loss is None or cooldown_seconds <= 0:
        return 1.0
    age = max(seconds_since_loss, 0.0)
    return 1.0 + cooldown_seconds / (age + cooldown_seconds / 4.0)


def cost_per_step(
    offer: Offer, params: RankingParams = RankingParams(), seconds_since_loss: float | None = None
) -> float:
    """Expected $ per V100-hour of work on ``offer`` (proportional to $ per training step).

    :param seconds_since_loss: time since the pool last preempted (us or, where the market shows it,
        anyone); raises the expected preemption rate of pools that just lost capacity.
    """
    if offer.relative_throughput <= 0:
        raise ValueError(f"offer {offer.pool} has relative_throughput {offer.relative_throughput}; must be > 0")
    inflation = 1.0
    if Market(offer.market) is Market.SPOT:
        rate = offer.preemption_rate_per_hour * risk_multiplier(seconds_since_loss, params.cooldown_seconds)
        inflation += rate * params.overhead_seconds / 3600.0
    return offer.price_per_hour / offer.relative_throughput * inflation


def in_cooldown(offer: Offer, now: float, recent_preemptions: Mapping[str, float], cooldown_seconds: float) -> bool:
    """Whether ``offer``'s pool preempted this job within the last ``cooldown_seconds``."""
    last = recent_preemptions.get(offer.pool)
    return offer.is_spot and last is not None and now - last < cooldown_seconds


@offer_ranking_policies.register("cost-per-step", default=True)
def rank_by_cost_per_step(
    offers: Sequence[Offer], now: float, recent_preemptions: Mapping[str, float], params: RankingParams
) -> list[Offer]:
    def since(o: Offer) -> float | None:
        last = recent_preemptions.get(o.pool)
        return None if last is None else now - last

    return sorted(
        offers,
        key=lambda o: (
            in_cooldown(o, now, recent_preemptions, params.cooldown_seconds),
            cost_per_step(o, params, since(o)),
            o.pool,
        ),
    )


@offer_ranking_policies.register("cheapest-per-hour")
def rank_by_price(
    offers: Sequence[Offer], now: float, recent_preemptions: Mapping[str, float], params: RankingParams
) -> list[Offer]:
    """The naive baseline: lowest $/h first, ignoring speed, risk and cool-down."""
    return sorted(offers, key=lambda o: (o.price_per_hour, o.pool))


def rank_offers(
    offers: Sequence[Offer],
    *,
    now: float,
    recent_preemptions: Mapping[str, float] | None = None,
    params: RankingParams | None = None,
    policy: str | None = None,
) -> list[Offer]:
    """Offers best first.

    :param now: current time (seconds, same clock as ``recent_preemptions``).
    :param recent_preemptions: pool (``Offer.pool``) -> time this job was last preempted there.
    :param policy: registered ranking name (default ``cost-per-step``).
    """
    return offer_ranking_policies.get(policy)(offers, now, recent_preemptions or {}, params or RankingParams())


def choose_offer(
    offers: Sequence[Offer],
    *,
    now: float,
    recent_preemptions: Mapping[str, float] | None = None,
    market: Market | str | None = None,
    params: RankingParams | None = None,
    policy: str | None = None,
) -> Offer | None:
    """The offer to launch now, or None when there is none.

    :param market: the purchase option the deadline policy wants (``spot`` / ``on-demand``); when no
        offer of that market exists the best offer of any market is returned, so a job that asked for
        spot only still gets its spot offers and one that must go on-demand is not left without a plan.
    """
    pool = list(offers)
    if market is not None:
        wanted = [o for o in pool if Market(o.market) is Market(market)]
        pool = wanted or pool
    ranked = rank_offers(pool, now=now, recent_preemptions=recent_preemptions, params=params, policy=policy)
    return ranked[0] if ranked else None
