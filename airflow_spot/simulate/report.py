"""Run every controller over traces and start offsets; tables, distributions and the PNG."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from airflow_spot.market.catalog import DEFAULT_MTBF_HOURS
from airflow_spot.market.traces import SpotTrace
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import HOUR, JobSpec, SimPool, SimResult, simulate

REFERENCE_GPU = "V100"


def build_pools(
    traces: list[SpotTrace],
    *,
    spot_price: float | None,
    on_demand_price: float | None,
    market=None,
    instance_type: str = "p3.2xlarge",
) -> tuple[list[SimPool], Offer]:
    """Pools for the traces, priced by the given prices or else by the market (catalog): a trace zone gets
    the median spot price of its instance type in its region (trace zone names do not map to the
    catalog's zone ids)."""
    pools = []
    od_price = on_demand_price
    for t in traces:
        itype = t.instance_type or instance_type
        price, od = spot_price, on_demand_price
        if price is None or od is None:
            if market is None:
                raise ValueError("give --spot-price and --on-demand-price, or a market to price the traces from")
            od = od if od is not None else market.on_demand_price(itype, t.region)
            if price is None:
                spots = sorted(o.price_per_hour for o in market.offers()
                               if o.instance_type == itype and o.region == t.region and Market(o.market) is Market.SPOT)
                if not spots:
                    raise ValueError(f"the catalog has no spot price for {itype} in {t.region}; pass --spot-price")
                price = spots[len(spots) // 2]
        od_price = od if od_price is None else od_price
        # the prior every pool starts from, not the trace's own MTBF (that would look into the future)
        rate = 1.0 / DEFAULT_MTBF_HOURS
        pools.append(SimPool(t, Offer(itype, t.region, t.zone, Market.SPOT, price, od, REFERENCE_GPU, 1, 16.0,
                                      relative_throughput=1.0, preemption_rate_per_hour=rate)))
    if od_price is None:
        raise ValueError("no on-demand price: pass --on-demand-price")
    region = traces[0].region if traces else "us-east-1"
    on_demand = Offer(pools[0].offer.instance_type if pools else instance_type, region, region, Market.ON_DEMAND,
                      od_price, od_price, REFERENCE_GPU, 1, 16.0, relative_throughput=1.0)
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


def run_policies(spec, pools, on_demand, names, offset_ticks=0) -> list[SimResult]:
    return [simulate(spec, pools, on_demand, controllers.get(n)(), offset_ticks=offset_ticks) for n in names]


def distribution(spec, pools, on_demand, name, offsets, baseline_cost: float) -> Distribution:
    results = [simulate(spec, pools, on_demand, controllers.get(name)(), offset_ticks=o) for o in offsets]
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
        deadline_met=len(ratios), mean_lost_gpu_hours=math.nan, mean_preemptions=math.nan, ratios=in_order,
    )


def format_table(results: list[SimResult], baseline_cost: float) -> str:
    head = f"{'policy':<22}{'cost $':>10}{'x on-demand':>13}{'done (h)':>10}{'deadline':>10}{'preempt.':>10}{'lost GPU h':>12}{'spot h':>9}{'od h':>8}"
    lines = [head, "-" * len(head)]
    for r in results:
        met = "-" if r.deadline_met is None else ("met" if r.deadline_met else "MISSED")
        done = f"{r.completion_hours:.1f}" if r.completion_hours is not None else "unfinished"
        lines.append(
            f"{r.policy:<22}{r.cost:>10.2f}{r.cost / baseline_cost:>13.3f}{done:>10}{met:>10}{r.preemptions:>10d}"
            f"{r.lost_gpu_hours:>12.2f}{r.spot_hours:>9.1f}{r.on_demand_hours:>8.1f}"
        )
    return "\n".join(lines)


def format_distributions(dists: list[Distribution]) -> str:
    head = f"{'policy':<22}{'runs':>6}{'mean x':>9}{'p90 x':>9}{'worst x':>9}{'deadline met':>14}{'lost GPU h':>12}{'preempt.':>10}"
    lines = [head, "-" * len(head)]
    for d in dists:
        lines.append(
            f"{d.policy:<22}{d.runs:>6d}{d.mean_ratio:>9.3f}{d.p90_ratio:>9.3f}{d.worst_ratio:>9.3f}"
            f"{f'{d.deadline_met}/{d.runs}':>14}{d.mean_lost_gpu_hours:>12.2f}{d.mean_preemptions:>10.1f}"
        )
    return "\n".join(lines)


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
