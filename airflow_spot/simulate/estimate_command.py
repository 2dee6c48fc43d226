"""``airflow-spot estimate``: time and cost of a job on each offer of the market, from measured step times.

    airflow-spot estimate --steps 200000 --measured V100=0.42 --measured A10G=0.47 --gpus 1 --top 10
"""
from __future__ import annotations

import argparse
import sys

from airflow_spot.market.throughput import instance_throughput
from airflow_spot.policy.estimate import fit_step_time
from airflow_spot.policy.offer_ranking import RankingParams, cost_per_step
from airflow_spot.policy.offers import GpuRequest, Market


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, required=True, help="training steps of the whole job")
    p.add_argument("--measured", action="append", default=[], metavar="GPU=SECONDS",
                   help="seconds per step measured on one GPU of that type (repeat for several types)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per instance")
    p.add_argument("--min-memory-gib", type=float, default=0.0)
    p.add_argument("--regions", default="", help="comma-separated regions (default: all)")
    p.add_argument("--restart-overhead-seconds", type=float, default=600.0)
    p.add_argument("--top", type=int, default=15, help="show this many offers, cheapest expected cost first")


def run(args: argparse.Namespace) -> int:
    from airflow_spot.market import get_market

    try:
        if args.steps <= 0:
            raise ValueError("--steps must be positive")
        measured: dict[float, float] = {}
        for item in args.measured:
            gpu, _, secs = item.partition("=")
            try:
                measured[instance_throughput(gpu.strip(), 1)] = float(secs)
            except KeyError:
                raise ValueError(f"--measured {item!r}: unknown GPU {gpu!r}") from None
            except ValueError:
                raise ValueError(f"--measured {item!r}: expected GPU=SECONDS, e.g. V100=0.42") from None
        model = fit_step_time(measured)
        regions = [r for r in args.regions.split(",") if r]
        market = get_market("local", regions=regions or None)
        offers = market.offers(GpuRequest(count=args.gpus, min_memory_gib=args.min_memory_gib))
    except ValueError as exc:
        print(f"airflow-spot estimate: {exc}", file=sys.stderr)
        return 2
    params = RankingParams(overhead_seconds=args.restart_overhead_seconds)
    rows = []
    for o in offers:
        hours = args.steps * model.step_seconds(o.relative_throughput) / 3600.0
        # cost_per_step is $ per V100-hour; scale by the job's hours on this offer
        expected = cost_per_step(o, params) * o.relative_throughput * hours
        rows.append((expected, hours, o))
    rows.sort(key=lambda r: r[0])
    print(f"step time fit: t = {model.step_seconds(1.0):.3f} s on a V100 x throughput^-{model.b:.2f}")
    print(f"{'instance':<16}{'market':<11}{'zone':<14}{'GPU':<10}{'$/h':>8}{'hours':>9}{'expected $':>12}")
    for expected, hours, o in rows[: args.top]:
        print(f"{o.instance_type:<16}{Market(o.market).value:<11}{o.zone:<14}{o.gpu_name:<10}{o.price_per_hour:>8.3f}"
              f"{hours:>9.1f}{expected:>12.2f}")
    return 0
