"""``airflow-spot simulate``: replay a job through the policies on real spot traces.

Example (the issue's reference job, all four measured zones)::

    airflow-spot simulate --work-hours 48 --deadline-hours 52 --restart-overhead-hours 0.2 \\
        --spot-price 0.9731 --on-demand-price 3.06 --offsets --png sim.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from airflow_spot.market.traces import PREEMPTION_TRACES_SUBDIR, TraceError, default_traces_dir, load_traces
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec
from airflow_spot.simulate.report import (
    build_pools, distribution, format_distributions, format_table, offsets_for, plot, run_policies,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work-hours", type=float, required=True, help="hours of training on one V100")
    p.add_argument("--deadline-hours", type=float, default=None, help="hours from the start (default: none)")
    p.add_argument("--save-cost-seconds", type=float, default=10.0, help="training stall per checkpoint")
    p.add_argument("--restart-overhead-hours", type=float, default=0.2, help="paid time without progress per new instance")
    p.add_argument("--notice-seconds", type=float, default=120.0, help="preemption notice window")
    p.add_argument("--traces", default=None,
                   help="trace files or directories (default: the bundled AWS V100 preemption traces, 4 zones)")
    p.add_argument("--zones", default=None, help="comma-separated zones to keep (e.g. us-west-2b,us-west-2c)")
    p.add_argument("--spot-price", type=float, default=None, help="$/h of every spot pool (default: the catalog)")
    p.add_argument("--on-demand-price", type=float, default=None, help="$/h on-demand (default: the catalog)")
    p.add_argument("--policies", default=",".join(controllers.names()),
                   help=f"comma-separated, from: {', '.join(controllers.names())}")
    p.add_argument("--start-hour", type=float, default=0.0, help="replay from this hour of the traces")
    p.add_argument("--offsets", action="store_true", help="also run every hourly start offset and print the distribution")
    p.add_argument("--offset-step-hours", type=float, default=1.0)
    p.add_argument("--png", default=None, help="write progress and cost over time to this PNG")
    p.add_argument("--json", dest="json_out", default=None, help="write the figures as JSON to this file")


def _trace_paths(arg: str | None) -> list[Path]:
    if not arg:
        return [default_traces_dir() / PREEMPTION_TRACES_SUBDIR]
    return [Path(x) for x in arg.split(",")]


def run(args: argparse.Namespace) -> int:
    try:
        spec = JobSpec(work_hours=args.work_hours, deadline_hours=args.deadline_hours,
                       save_cost_seconds=args.save_cost_seconds, restart_overhead_hours=args.restart_overhead_hours,
                       notice_seconds=args.notice_seconds)
        traces = []
        for path in _trace_paths(args.traces):
            traces.extend(load_traces(path))
        if args.zones:
            wanted = [z.strip() for z in args.zones.split(",") if z.strip()]
            unknown = sorted(set(wanted) - {t.zone for t in traces})
            if unknown:
                raise ValueError(f"zones {unknown} have no trace; traces cover {sorted(t.zone for t in traces)}")
            traces = [t for z in wanted for t in traces if t.zone == z]
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        for n in names:
            controllers.get(n)
        market = None
        if args.spot_price is None or args.on_demand_price is None:
            from airflow_spot.market import get_market

            market = get_market("local")
        pools, on_demand = build_pools(traces, spot_price=args.spot_price, on_demand_price=args.on_demand_price,
                                       market=market)
        start = int(args.start_hour * 3600 // traces[0].gap_seconds)
    except (TraceError, ValueError, KeyError) as exc:
        print(f"airflow-spot simulate: {exc}", file=sys.stderr)
        return 2
    baseline = run_policies(spec, pools, on_demand, ["on-demand"], offset_ticks=start)[0].cost
    results = run_policies(spec, pools, on_demand, names, offset_ticks=start)
    print(f"job: {spec.work_hours:g} GPU h, deadline {spec.deadline_hours} h, restart {spec.restart_overhead_hours:g} h, "
          f"zones {', '.join(t.zone for t in traces)}, start hour {args.start_hour:g}; on-demand only = ${baseline:.2f}")
    print(format_table(results, baseline))
    out: dict = {"spec": spec.__dict__, "zones": [t.zone for t in traces], "on_demand_cost": baseline,
                 "runs": [r.to_dict() for r in results]}
    if args.offsets:
        try:
            offs = offsets_for(spec, traces, args.offset_step_hours)
        except ValueError as exc:
            print(f"airflow-spot simulate: {exc}", file=sys.stderr)
            return 2
        dists = [distribution(spec, pools, on_demand, n, offs, baseline) for n in names]
        print(f"\nover {len(offs)} start offsets every {args.offset_step_hours:g} h (cost as a multiple of on-demand):")
        print(format_distributions(dists))
        out["distributions"] = [d.to_dict() for d in dists]
    if args.png:
        print(f"\nwrote {plot(results, args.png, spec)}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))
    return 0
