"""The hindsight optimum: the cheapest schedule for a job that knows the whole trace in advance.

Not a policy (it reads the future); a yardstick for how far a causal policy is from the best possible.
A dynamic programme on a coarse grid (``step_seconds``, default 0.1 h) over (time, slack used, where the
job runs, restart steps left and, with a transfer cost, the region its checkpoint is in). Each step the
job idles, stays where it runs (a spot pool only while it is up for the whole step), or starts anew on
on-demand or on a pool up for the whole step, paying the restart and, for a checkpoint in another region,
its transfer (time and money) as the replay does; the checkpoint is in the new region once the new
instance makes progress (an instance given up during the move leaves it where it was), or with
``JobSpec.store_region`` always in the store's, where an instance in another region also pays
``remote_dollars_per_hour`` for each step it runs (its saves written back). A spot price that varies per
tick (:attr:`SimPool.prices`) is charged per step, at its time-weighted mean over the step.
Approximations, all named: a pool counts as up in a step only when it is up for all of it (a little
pessimistic), the restart is rounded to whole steps, and neither save stalls nor the 60 s billing minimum
are modelled (a little optimistic). Progress survives a preemption (emergency save).
"""
from __future__ import annotations

import math

import numpy as np

from airflow_spot.policy.offers import Offer
from airflow_spot.simulate.engine import HOUR, JobSpec, SimPool


def _up_by_step(pools: list[SimPool], offset_ticks: int, steps: int, step_seconds: float, nodes: int = 1) -> np.ndarray:
    gap = pools[0].trace.gap_seconds
    out = np.zeros((len(pools), steps), dtype=bool)
    for i, p in enumerate(pools):
        v = p.trace.up_for(nodes)
        for s in range(steps):
            a = offset_ticks + int(s * step_seconds // gap)
            b = offset_ticks + int(math.ceil((s + 1) * step_seconds / gap))
            out[i, s] = b <= len(v) and all(v[a:b])
    return out


def _price_by_step(pools: list[SimPool], offset_ticks: int, steps: int, step_seconds: float) -> np.ndarray:
    """[step, pool]: each pool's spot $/h over each step, its per-tick prices (:attr:`SimPool.prices`)
    weighted by the time each holds in the step (past the series' end its last price holds), else its
    offer's."""
    gap = pools[0].trace.gap_seconds
    out = np.empty((steps, len(pools)))
    edges = offset_ticks * gap + np.arange(steps + 1) * step_seconds  # seconds into the traces
    for i, p in enumerate(pools):
        out[:, i] = p.offer.price_per_hour
        if p.prices is None:
            continue
        prices = np.asarray(p.prices)
        n = len(prices)
        spent = np.concatenate(([0.0], np.cumsum(prices) * gap))  # $·s/h paid by the start of each tick
        tick = np.minimum((edges // gap).astype(int), n - 1)
        paid = spent[tick] + (edges - tick * gap) * prices[tick]  # up to each edge
        out[:, i] = np.diff(paid) / step_seconds
    return out


def hindsight_cost(
    spec: JobSpec, pools: list[SimPool], on_demand: Offer, *, offset_ticks: int = 0, step_seconds: float = 360.0
) -> float:
    """The cheapest cost ($) of ``spec`` from tick ``offset_ticks`` meeting its deadline, knowing the future.

    :param step_seconds: the grid; work, deadline, restart and transfer are rounded to whole steps.
    :raises ValueError: without a deadline (the optimum then just waits for spot).
    """
    if spec.deadline_hours is None:
        raise ValueError("the hindsight optimum needs a deadline")
    work = int(round(spec.work_hours * HOUR / step_seconds))
    horizon = int(round(spec.deadline_hours * HOUR / step_seconds))
    restart = max(1, int(round(spec.restart_overhead_hours * HOUR / step_seconds)))
    depth = restart + int(round(spec.transfer_seconds / step_seconds))  # a restart that moves the checkpoint
    spare = horizon - work
    up = _up_by_step(pools, offset_ticks, horizon, step_seconds, spec.nodes)
    # places: 0 idle, 1 on-demand, 2.. the spot pools; where the checkpoint is: 0 nowhere yet, 1.. a region
    run_regions = [on_demand.region] + [p.offer.region for p in pools]
    regions = []
    if spec.transfer_seconds or spec.transfer_dollars:
        regions = sorted(set(run_regions + ([spec.store_region] if spec.store_region else [])))
    home = [0] + [1 + regions.index(r) if regions else 0 for r in run_regions]
    # progress writes the checkpoint where the job runs, or to the one store
    store = 1 + regions.index(spec.store_region) if regions and spec.store_region else None
    writes = home if store is None else [store] * len(home)
    # [step, place]: what a step at each place costs (spot prices may vary per step)
    price = np.zeros((horizon, len(pools) + 2))
    price[:, 1] = on_demand.price_per_hour
    if pools:
        price[:, 2:] = _price_by_step(pools, offset_ticks, horizon, step_seconds)
    if spec.store_region is not None:  # an instance in another region writes its saves back across regions
        price[:, 1:] += [spec.remote_dollars_per_hour if r != spec.store_region else 0.0 for r in run_regions]
    price *= step_seconds / HOUR
    places = price.shape[1]
    inf = math.inf
    cost = np.full((spare + 1, places, depth + 1, len(regions) + 1), inf)  # [slack used, place, restart left, ckpt]
    cost[0, 0, 0, store or 0] = 0.0
    # a start at a place with the checkpoint nowhere yet or in its region needs no transfer
    free = np.array([[ck in (0, home[q]) for ck in range(len(regions) + 1)] for q in range(places)])
    extra = np.where(free, 0.0, spec.transfer_dollars)
    arange, writes = np.arange(places), np.array(writes)
    best = inf
    for t in range(horizon):
        price_of = price[t][None, :, None]
        nxt = np.full_like(cost, inf)
        at = cost.min(axis=2)  # [slack used, place, ckpt]
        # the job anywhere but at q: the best place, or for q itself the second best
        order = np.argsort(at, axis=1)
        first = np.take_along_axis(at, order[:, :1], axis=1)
        second = np.take_along_axis(at, order[:, 1:2], axis=1)
        elsewhere = np.where(order[:, :1] == arange[None, :, None], second, first)
        # start here: the first restart step is this one; a checkpoint in another region moves first
        # (its transfer paid), and counts as here only once the instance makes progress
        start = elsewhere[:-1] + price_of + extra[None]
        nxt[1:, :, restart - 1] = np.where(free[None], start, inf)
        nxt[1:, :, depth - 1] = np.minimum(nxt[1:, :, depth - 1], np.where(free[None], inf, start))
        # still restarting: no progress
        nxt[1:, :, :-1] = np.minimum(nxt[1:, :, :-1], cost[:-1, :, 1:] + price_of[..., None])
        progress = cost[:, :, 0].min(axis=2) + price_of[:, :, 0]  # [slack used, place]
        nxt[:, arange, 0, writes] = np.minimum(nxt[:, arange, 0, writes], progress)
        nxt[:, 2:][:, ~up[:, t]] = inf  # a spot pool only while it is up for the whole step
        nxt[:, 0] = inf
        nxt[1:, 0, 0] = at.min(axis=1)[:-1]  # idle: one step of slack, the checkpoint where it is
        cost = nxt
        done_at = t + 1 - work  # slack used by a job that has just finished
        if 0 <= done_at <= spare:
            best = min(best, float(cost[done_at].min()))
            cost[done_at] = inf  # a finished job costs nothing more
    return best
