"""Where the next attempt runs: offers from the market, ranked and filtered by the pure policies.

This module only gathers the inputs (offers, the job's progress and ledger, the clock) and calls
:mod:`airflow_spot.policy.deadline` (spot or on-demand now?) and :mod:`airflow_spot.policy.offer_ranking`
(cheapest per training step, pools that just preempted us cooling down); the decisions are theirs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from airflow_spot.backends.base import InstanceInfo
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
    committed: bool = False,
    spot_up_seconds: float | None = None,
) -> Plan:
    """Rank the offers for the next attempt.

    :param step_seconds: measured seconds per step (from the job's heartbeats), for the deadline policy.
    :param running: the market of the warm instance the job holds, if any (switching costs a restart).
    :param committed: the deadline policy's state from the previous plan (safety net fired).
    :param spot_up_seconds: how long the best spot pool has been up, if the caller knows (the market does
        not report it yet); with it the deadline policy is ``slack-budget``, without it ``slack-reserve``.
        Not estimated from ``ledger_rows``: :mod:`airflow_spot.policy.pool_age` can, but simulated it
        loses to ``slack-reserve`` (``benchmarks/results_simulate.md``, ``ours-observed``).
    """
    from airflow_spot.policy.deadline import DeadlineState, choose_market
    from airflow_spot.policy.offer_ranking import rank_offers

    offers = [o for o in market.offers(gpus) if gpus.matches(o)]
    if not offers:
        raise NoOfferError(f"no offer of the market matches {gpus}; relax the GPU request")
    decision = choose_market(
        now=now,
        started_at=job_started_at,
        deadline_seconds=deadline.total_seconds() if deadline else None,
        done_steps=done_steps,
        total_steps=total_steps,
        step_seconds=step_seconds,
        running=running,
        spot_up_seconds=spot_up_seconds,
        state=DeadlineState(committed=committed),
    )
    wanted = Market(decision.market)
    candidates = [o for o in offers if Market(o.market) is wanted] or offers
    ranked = rank_offers(candidates, now=now, recent_preemptions=_recent_preemptions(ledger_rows))
    best = ranked[0]
    mtbf = 3600.0 / best.preemption_rate_per_hour if best.is_spot and best.preemption_rate_per_hour > 0 else None
    return Plan(
        ranked=list(ranked),
        market=wanted,
        reason=(
            f"{wanted.value} ({decision.reason}); "
            f"best {best.instance_type} in {best.zone} at ${best.price_per_hour:.4f}/h"
        ),
        mtbf_seconds=mtbf,
        committed=decision.state.committed,
    )


def measured_step_seconds(layout: Any) -> float | None:
    """Seconds per step of the job's most recent heartbeat (any attempt), or None before the first."""
    from airflow_spot.storage.protocol import Heartbeat, SchemaError

    newest = None
    for key in layout.store.list("control/attempts/"):
        if not key.endswith("/heartbeat.json"):
            continue
        try:
            hb = Heartbeat.from_json(layout.store.get_bytes(key))
        except (KeyError, SchemaError):
            continue
        if hb.step_time_ewma and (newest is None or hb.time > newest.time):
            newest = hb
    return newest.step_time_ewma if newest else None


def _recent_preemptions(rows: Sequence[Any]) -> dict[str, float]:
    """Pool -> time of its last preemption of this job (for the ranking's cool-down)."""
    out: dict[str, float] = {}
    for r in rows:
        if r.outcome in ("preempted", "lost"):
            pool = f"{r.instance_type}@{r.zone}"
            out[pool] = max(out.get(pool, 0.0), r.ended_at)
    return out


def pick_warm(alive: Sequence[InstanceInfo], plan_: Plan, tolerance: float) -> InstanceInfo | None:
    """The warm instance to reuse: in the market the policy wants, and within ``tolerance`` of the best
    offer's cost per step (a relaunch costs boot time and a new billing minimum, so near-best is good)."""
    if not plan_.ranked:
        return None
    best = plan_.cost_of(plan_.ranked[0])
    good = [
        i for i in alive
        if Market(i.offer.market) is plan_.market and plan_.cost_of(i.offer) <= best * (1.0 + tolerance)
    ]
    return min(good, key=lambda i: plan_.cost_of(i.offer), default=None)
