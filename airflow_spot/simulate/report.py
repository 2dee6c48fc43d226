"""Run every controller over traces and start offsets; tables, distributions and the PNG."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from airflow_spot.market.catalog import DEFAULT_MTBF_HOURS
from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import HOUR, JobSpec, SimPool, SimResult, simulate, simulate_together
from airflow_spot.simulate.history import deployment_history
from airflow_spot.simulate.observed import OtherJobs

REFERENCE_GPU = "V100"


def read_prices(path: str | Path) -> dict[str, tuple[float, float]]:
    """``zone,spot,on_demand`` CSV (a header line is allowed) -> zone -> (spot $/h, on-demand $/h)."""
    import csv

    import math

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"prices file {p} is a folder; give a CSV with lines zone,spot,on_demand")
    if not p.is_file():
        raise ValueError(f"prices file {p} does not exist; give a CSV with lines zone,spot,on_demand")
    out: dict[str, tuple[float, float]] = {}
    header_allowed = True  # on the first line that is not blank or a comment
    with p.open(newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's "CSV UTF-8" starts with a BOM
        for n, row in enumerate(csv.reader(f), 1):
            cells = [c.strip() for c in row]
            if not cells or not any(cells) or cells[0].startswith("#"):
                continue
            if header_allowed and cells[0].lower() == "zone":
                header_allowed = False
                continue
            header_allowed = False
            if len(cells) != 3:
                raise ValueError(f"{p} line {n}: expected zone,spot,on_demand, got {','.join(cells)!r}")
            try:
                spot, od = float(cells[1]), float(cells[2])
            except ValueError:
                raise ValueError(
                    f"{p} line {n}: prices must be numbers ($/h), got {cells[1]!r}, {cells[2]!r}") from None
            if not (0 < spot and 0 < od and math.isfinite(spot) and math.isfinite(od)):
                raise ValueError(f"{p} line {n}: prices must be positive and finite ($/h), got spot {spot}, "
                                 f"on-demand {od}")
            if cells[0] in out:
                raise ValueError(f"{p} line {n}: zone {cells[0]} is listed twice")
            out[cells[0]] = (spot, od)
    if not out:
        raise ValueError(f"{p} holds no price line; expected zone,spot,on_demand")
    return out


def build_pools(
    traces: list[SpotTrace],
    *,
    spot_price: float | None,
    on_demand_price: float | None,
    market=None,
    instance_type: str = "p3.2xlarge",
    prices: dict[str, tuple[float, float]] | None = None,
    nodes: int = 1,
    tick_prices: bool = True,
) -> tuple[list[SimPool], Offer]:
    """Pools for the traces, priced per zone by ``prices`` (zone -> spot, on-demand), else by the given
    prices, else by the trace's own (the SkyPilot simulator's ``price_info``, or its per-tick ``prices``
    series where that varies, replayed tick by tick unless ``tick_prices`` is False: then at its mean),
    else by the market (catalog):
    a trace zone gets the median spot price of its instance type in its region (trace zone names do not
    map to the catalog's zone ids). A gang of ``nodes`` instances
    pays ``nodes`` times the price. The on-demand offer is the cheapest zone's on-demand price, in its
    region (on-demand capacity is assumed available everywhere)."""
    if prices is not None:
        missing = sorted({t.zone for t in traces} - set(prices))
        if missing:
            raise ValueError(f"the prices file has no line for zones {missing}; add zone,spot,on_demand lines")
    pools = []
    od_by_region: dict[str, float] = {}
    for t in traces:
        itype = t.instance_type or instance_type
        price, od = spot_price, on_demand_price
        if prices is not None:
            price, od = prices[t.zone]
        series = t.prices if price is None and tick_prices else None
        price = t.spot_price if price is None else price
        od = t.on_demand_price if od is None else od
        if price is None or od is None:
            if market is None:
                raise ValueError("give --spot-price and --on-demand-price, or a market to price the traces from")
            try:
                od = od if od is not None else market.on_demand_price(itype, t.region)
            except KeyError as exc:
                raise ValueError(f"{exc.args[0]} (zone {t.zone} of the traces); pass --on-demand-price and "
                                 "--spot-price, or --prices FILE (zone,spot,on_demand)") from None
            if price is None:
                spots = sorted(o.price_per_hour for o in market.offers()
                               if o.instance_type == itype and o.region == t.region and Market(o.market) is Market.SPOT)
                if not spots:
                    raise ValueError(f"the catalog has no spot price for {itype} in {t.region}; pass --spot-price")
                price = spots[len(spots) // 2]
        od_by_region[t.region] = min(od * nodes, od_by_region.get(t.region, float("inf")))
        # the prior every pool starts from, not the trace's own MTBF (that would look into the future)
        rate = 1.0 / DEFAULT_MTBF_HOURS
        pools.append(SimPool(t, Offer(itype, t.region, t.zone, Market.SPOT, price * nodes, od * nodes, REFERENCE_GPU,
                                      nodes, 16.0, relative_throughput=1.0, preemption_rate_per_hour=rate),
                             prices=tuple(x * nodes for x in series) if series else None))
    if not od_by_region:
        if on_demand_price is None:
            raise ValueError("no on-demand price: pass --on-demand-price")
        od_by_region["us-east-1"] = on_demand_price * nodes
    region = min(od_by_region, key=lambda r: (od_by_region[r], r))
    od_price = od_by_region[region]
    on_demand = Offer(pools[0].offer.instance_type if pools else instance_type, region, region, Market.ON_DEMAND,
                      od_price, od_price, REFERENCE_GPU, nodes, 16.0, relative_throughput=1.0)
    return pools, on_demand


def offsets_for(spec: JobSpec, traces: list[SpotTrace], step_hours: float = 1.0) -> list[int]:
    """Every ``step_hours`` start tick that leaves the whole deadline window (or the work) inside the traces."""
    gap = traces[0].gap_seconds
    window = int(math.ceil((spec.deadline_hours or spec.work_hours) * HOUR / gap))
    last = min(len(t.values) for t in traces) - window
    if last < 0:
        raise ValueError(
            f"the traces ({min(len(t.values) for t in traces) * gap / HOUR:.1f} h) are shorter than the job's "
            f"window ({window * gap / HOUR:.1f} h)"
        )
    step = max(1, int(round(step_hours * HOUR / gap)))
    return list(range(0, last + 1, step))


@dataclass
class Distribution:
    policy: str
    runs: int
    mean_ratio: float
    p90_ratio: float
    worst_ratio: float
    deadline_met: int
    mean_lost_gpu_hours: float
    mean_preemptions: float
    #: per start offset, in the offsets' order (for held-out splits)
    ratios: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def mean_over(self, parity: int) -> float:
        """Mean ratio over every other offset: ``0`` the even ones, ``1`` the odd ones."""
        return statistics.mean(self.ratios[parity::2])


#: not a controller: the hindsight optimum (knows the future), reported beside the policies
HINDSIGHT = "hindsight"


def policy_names() -> list[str]:
    return controllers.names() + [HINDSIGHT]


def run_one(spec, pools, on_demand, name: str, offset_ticks: int = 0, jobs: int = 1,
            history_hours: float = 0.0) -> SimResult:
    """One replay of ``name``; with ``jobs`` > 1 what a job of that deployment costs on average
    (:func:`per_job_mean` of :func:`run_jobs`). Not one job of them: jobs that decide at the same instants
    do so in order, and the last reads the probes the first paid for without paying any."""
    return per_job_mean(run_jobs(spec, pools, on_demand, name, offset_ticks, jobs, history_hours))


def per_job_mean(results: list[SimResult]) -> SimResult:
    """The jobs' mean cost, hours and preemptions; completed and deadline met only when every job's was;
    the latest completion. One result is returned as it is (with its ledger rows)."""
    if len(results) == 1:
        return results[0]
    done = [r.completion_hours for r in results]
    met = [r.deadline_met for r in results]
    return SimResult(
        policy=results[0].policy,
        cost=statistics.mean(r.cost for r in results),
        on_demand_cost=statistics.mean(r.on_demand_cost for r in results),
        completed=all(r.completed for r in results),
        completion_hours=None if None in done else max(done),
        deadline_met=None if None in met else all(met),
        preemptions=statistics.mean(r.preemptions for r in results),
        lost_gpu_hours=statistics.mean(r.lost_gpu_hours for r in results),
        spot_hours=statistics.mean(r.spot_hours for r in results),
        on_demand_hours=statistics.mean(r.on_demand_hours for r in results),
    )


def run_jobs(spec, pools, on_demand, name: str, offset_ticks: int = 0, jobs: int = 1,
             history_hours: float = 0.0) -> list[SimResult]:
    """Replays of ``name``: with ``jobs`` > 1 and a controller that reads the deployment's events
    (``shared``), ``jobs`` jobs start together on the same window and each reads the others' events as
    they happen (:func:`~airflow_spot.simulate.engine.simulate_together`), one result per job; otherwise
    one result (jobs that read nothing of each other all do the same). With ``history_hours``, such jobs
    also find in the log what an earlier job of the deployment logged in the hours before they start
    (:func:`~airflow_spot.simulate.history.deployment_history`)."""
    if name == HINDSIGHT:
        from airflow_spot.simulate.hindsight import hindsight_cost

        cost = hindsight_cost(spec, pools, on_demand, offset_ticks=offset_ticks)
        # an infinite cost: no schedule on the optimum's grid meets the deadline; it claims nothing then
        met = True if math.isfinite(cost) else None
        return [SimResult(HINDSIGHT, cost, math.nan, True, None, met, 0, 0.0, math.nan, math.nan)]
    first = controllers.get(name)()
    reads_log = hasattr(first, "shared")
    history = (deployment_history(spec, pools, on_demand, name, offset_ticks, history_hours)
               if reads_log and history_hours else [])
    if jobs <= 1 or not reads_log:
        if history:
            first.shared = history
        return [simulate(spec, pools, on_demand, first, offset_ticks=offset_ticks)]
    together = [first] + [controllers.get(name)() for _ in range(jobs - 1)]
    for k, c in enumerate(together):
        c.shared = OtherJobs([(f"replayed-job-{j}", o) for j, o in enumerate(together) if j != k], history)
    return simulate_together(spec, pools, on_demand, together, offset_ticks=offset_ticks)


def run_policies(spec, pools, on_demand, names, offset_ticks=0, jobs: int = 1,
                 history_hours: float = 0.0) -> list[SimResult]:
    """Each policy's replay; with ``jobs`` > 1 a row per job of a policy whose jobs read each other's events
    (named ``policy (job k/N)``)."""
    out = []
    for n in names:
        results = run_jobs(spec, pools, on_demand, n, offset_ticks, jobs, history_hours)
        if len(results) > 1:
            results = [replace(r, policy=f"{n} (job {k + 1}/{len(results)})") for k, r in enumerate(results)]
        out.extend(results)
    return out


def distribution(spec, pools, on_demand, name, offsets, baseline_cost: float, jobs: int = 1,
                 history_hours: float = 0.0) -> Distribution:
    if name == HINDSIGHT:
        return hindsight_distribution(spec, pools, on_demand, offsets, baseline_cost)
    results = [run_one(spec, pools, on_demand, name, o, jobs, history_hours) for o in offsets]
    in_order = [r.cost / baseline_cost for r in results]
    ratios = sorted(in_order)
    return Distribution(
        policy=name,
        runs=len(results),
        mean_ratio=statistics.mean(ratios),
        p90_ratio=ratios[min(len(ratios) - 1, int(math.ceil(0.9 * len(ratios))) - 1)],
        worst_ratio=ratios[-1],
        deadline_met=sum(bool(r.deadline_met) for r in results),
        mean_lost_gpu_hours=statistics.mean(r.lost_gpu_hours for r in results),
        mean_preemptions=statistics.mean(r.preemptions for r in results),
        ratios=in_order,
    )


def hindsight_distribution(spec, pools, on_demand, offsets, baseline_cost: float) -> Distribution:
    """The hindsight optimum (:mod:`airflow_spot.simulate.hindsight`, knows the future) over ``offsets``."""
    from airflow_spot.simulate.hindsight import hindsight_cost

    in_order = [hindsight_cost(spec, pools, on_demand, offset_ticks=o) / baseline_cost for o in offsets]
    ratios = sorted(in_order)
    return Distribution(
        policy="hindsight", runs=len(ratios), mean_ratio=statistics.mean(ratios),
        p90_ratio=ratios[min(len(ratios) - 1, int(math.ceil(0.9 * len(ratios))) - 1)], worst_ratio=ratios[-1],
        deadline_met=sum(math.isfinite(r) for r in ratios), mean_lost_gpu_hours=math.nan,
        mean_preemptions=math.nan, ratios=in_order,
    )


def _fmt(value: float, width: int, spec: str) -> str:
    """``value`` right-aligned in ``width``, or ``-`` where it is not a number (NaN, infinite): a figure the
    row does not have, never ``nan`` or ``inf``."""
    return f"{value:>{width}{spec}}" if math.isfinite(value) else f"{'-':>{width}}"


def format_table(results: list[SimResult], baseline_cost: float, hindsight_cost: float | None = None) -> str:
    """One row per policy; ``x hindsight`` (cost / hindsight optimum) when ``hindsight_cost`` is given (and
    finite). The hindsight optimum's row has no completion time, preemptions or hours (``-``); where it found
    no schedule that meets the deadline (an infinite cost) its cost reads ``infeasible``."""
    if hindsight_cost is not None and not math.isfinite(hindsight_cost):
        hindsight_cost = None
    hs = f"{'x hindsight':>13}" if hindsight_cost else ""
    head = (f"{'policy':<22}{'cost $':>10}{'x on-demand':>13}{hs}{'done (h)':>11}{'deadline':>10}{'preempt.':>10}"
            f"{'lost GPU h':>12}{'spot h':>9}{'od h':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        met = "-" if r.deadline_met is None else ("met" if r.deadline_met else "MISSED")
        done = "-" if r.policy == HINDSIGHT else "unfinished"
        if r.completion_hours is not None:
            done = f"{r.completion_hours:.1f}"
        ratio = _fmt(r.cost / hindsight_cost, 13, ".3f") if hindsight_cost else ""
        cost = f"{r.cost:>10.2f}" if math.isfinite(r.cost) else f"{'infeasible':>10}"
        if r.policy == HINDSIGHT:  # the optimum is a cost, not a replay: no preemptions or hours to show
            rest = f"{'-':>10}{'-':>12}{'-':>9}{'-':>8}"
        else:
            rest = (f"{r.preemptions:>10d}{_fmt(r.lost_gpu_hours, 12, '.2f')}{_fmt(r.spot_hours, 9, '.1f')}"
                    f"{_fmt(r.on_demand_hours, 8, '.1f')}")
        lines.append(
            f"{r.policy:<22}{cost}{_fmt(r.cost / baseline_cost, 13, '.3f')}{ratio}{done:>11}{met:>10}{rest}"
        )
    return "\n".join(lines)


def hindsight_ratios(d: Distribution, hindsight: Distribution) -> list[float]:
    """Per offset: the policy's cost / the hindsight optimum's (both are ratios to the same on-demand cost)."""
    return [a / b for a, b in zip(d.ratios, hindsight.ratios, strict=True)]


def format_distributions(dists: list[Distribution], hindsight: Distribution | None = None) -> str:
    """Per policy: mean / p90 / worst cost as a multiple of on-demand, and with ``hindsight`` the mean,
    p90 and worst of cost / hindsight over the same offsets (those where the optimum found a schedule;
    ``-`` where it found none). A figure that is not a number prints as ``-``."""
    hs = f"{'mean /hs':>10}{'p90 /hs':>9}{'worst /hs':>10}" if hindsight else ""
    head = (f"{'policy':<22}{'runs':>6}{'mean x':>9}{'p90 x':>9}{'worst x':>9}{hs}{'deadline met':>14}"
            f"{'lost GPU h':>12}{'preempt.':>10}")
    lines = [head, "-" * len(head)]
    for d in dists:
        extra = ""
        if hindsight:
            rs = sorted(r for r, h in zip(hindsight_ratios(d, hindsight), hindsight.ratios, strict=True)
                        if math.isfinite(h))
            extra = (f"{_fmt(statistics.mean(rs), 10, '.3f')}{_fmt(_p90(rs), 9, '.3f')}{_fmt(rs[-1], 10, '.3f')}"
                     if rs else f"{'-':>10}{'-':>9}{'-':>10}")
        lines.append(
            f"{d.policy:<22}{d.runs:>6d}{_fmt(d.mean_ratio, 9, '.3f')}{_fmt(d.p90_ratio, 9, '.3f')}"
            f"{_fmt(d.worst_ratio, 9, '.3f')}{extra}"
            f"{f'{d.deadline_met}/{d.runs}':>14}{_fmt(d.mean_lost_gpu_hours, 12, '.2f')}"
            f"{_fmt(d.mean_preemptions, 10, '.1f')}"
        )
    return "\n".join(lines)


def _p90(sorted_values: list[float]) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(math.ceil(0.9 * len(sorted_values))) - 1)]


def plot(results: list[SimResult], path: str | Path, spec: JobSpec, title: str = "") -> Path:
    """Progress and cost over time per policy (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in results:
        xs = [p[0] for p in r.timeline]
        ax1.plot(xs, [p[1] * spec.work_hours for p in r.timeline], label=r.policy)
        ax2.plot(xs, [p[2] for p in r.timeline], label=r.policy)
    if spec.deadline_hours is not None:
        for ax in (ax1, ax2):
            ax.axvline(spec.deadline_hours, color="k", linestyle="--", linewidth=0.8)
    ax1.set_ylabel("work done (GPU h)")
    ax2.set_ylabel("cost ($)")
    ax2.set_xlabel("hours since job start")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.set_title(title or "airflow-spot simulate")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
