"""``airflow-spot simulate``: replay a job through the policies on real spot traces.

Example (the issue's reference job, all four measured zones)::

    airflow-spot simulate --work-hours 48 --deadline-hours 52 --restart-overhead-hours 0.2 \\
        --spot-price 0.9731 --on-demand-price 3.06 --offsets --png sim.png

Traces that carry a per-tick spot price (the SkyPilot simulator's ``prices``) are replayed at the price of
each tick (``--mean-prices``: at its mean). Multi-region: ``--prices FILE`` (CSV ``zone,spot,on_demand``)
prices each zone; ``--transfer-seconds`` and
``--transfer-dollars`` charge moving the checkpoint to another region (or, with ``--store-region``, every
instance outside the one store's region, as the operators price it); ``--checkpoint-gib`` with
``--transfer-dollars-per-gib`` / ``--transfer-seconds-per-gib`` derive them from the checkpoint's size as the
operators' segment_options of the same names do. Multi-node availability traces
(counts 0..N) with ``--nodes N``: the gang needs N up in one zone. ``hindsight`` in ``--policies`` adds
the hindsight optimum; with a deadline every result is also given as ``cost / hindsight``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from airflow_spot.market.traces import (
    PREEMPTION_TRACES_SUBDIR, TraceError, check_node_count, check_region, default_traces_dir, load_traces,
    read_notes,
)
from airflow_spot.policy.transfer import GIB, TransferCost, transfer_cost
from airflow_spot.simulate.controllers import controllers
from airflow_spot.simulate.engine import JobSpec
from airflow_spot.simulate.report import (
    HINDSIGHT, build_pools, distribution, format_distributions, format_table, hindsight_distribution, offsets_for,
    plot, policy_names, read_prices, run_one, run_policies,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work-hours", type=float, required=True, help="hours of training on one V100")
    p.add_argument("--deadline-hours", type=float, default=None, help="hours from the start (default: none)")
    p.add_argument("--save-cost-seconds", type=float, default=10.0, help="training stall per checkpoint")
    p.add_argument("--restart-overhead-hours", type=float, default=0.2, help="paid time without progress per new instance")
    p.add_argument("--notice-seconds", type=float, default=120.0, help="preemption notice window")
    p.add_argument("--segment-minutes", type=float, default=15.0,
                   help="wall-clock minutes of one segment (steps_per_segment x step time): `ours` decides at "
                        "segment boundaries, as the operators do (default 15)")
    p.add_argument("--traces", default=None, nargs="+",
                   help="trace files or directories, separated by commas or spaces (so a shell glob such as "
                        "DIR/*/full.json works); default: the bundled AWS V100 preemption traces, 4 zones")
    p.add_argument("--zones", default=None, help="comma-separated zones to keep (e.g. us-west-2b,us-west-2c)")
    p.add_argument("--spot-price", type=float, default=None, help="$/h of every spot pool (default: the traces' own prices, else the catalog)")
    p.add_argument("--on-demand-price", type=float, default=None, help="$/h on-demand (default: the traces' own prices, else the catalog)")
    p.add_argument("--policies", default=",".join(controllers.names()),
                   help=f"comma-separated, from: {', '.join(policy_names())}")
    p.add_argument("--prices", default=None,
                   help="CSV file of per-zone prices, lines zone,spot,on_demand ($/h; overrides --spot-price)")
    p.add_argument("--mean-prices", action="store_true",
                   help="replay a trace's per-tick spot price series at its mean (default: the price of each tick)")
    p.add_argument("--transfer-seconds", type=float, default=0.0,
                   help="extra restart time to move the checkpoint to another region")
    p.add_argument("--probe-miss", type=float, default=0.0,
                   help="chance one probe request of a pool with capacity reads 'no capacity' (0.18: F1 0.9 per request; "
                        "a refused probe is asked once more, drawn independently; default 0)")
    p.add_argument("--transfer-dollars", type=float, default=0.0, help="$ per checkpoint moved across regions")
    p.add_argument("--checkpoint-gib", type=float, default=0.0,
                   help="size of the job's checkpoint in GiB, for the per-GiB transfer costs below")
    p.add_argument("--transfer-dollars-per-gib", type=float, default=0.0,
                   help="inter-region $ per GiB (e.g. 0.02): a move pays the restore of --checkpoint-gib GiB "
                        "(added to --transfer-dollars); with --store-region, an instance elsewhere also pays it "
                        "for the save at every segment boundary (--segment-minutes)")
    p.add_argument("--transfer-seconds-per-gib", type=float, default=0.0,
                   help="restore seconds per GiB across regions; added to --transfer-seconds")
    p.add_argument("--store-region", default=None,
                   help="the checkpoints stay in one store in this region (the operators' segment_options "
                        "checkpoint_region): every instance elsewhere pays the transfer; default: the checkpoint "
                        "moves with the job")
    p.add_argument("--nodes", type=int, default=1,
                   help="instances per job (gang); a multi-node availability trace must show this many up")
    p.add_argument("--jobs", type=int, default=1,
                   help="jobs of one deployment started together on the same window; each reads the others' pool "
                        "events as they happen (a row per job)")
    p.add_argument("--history-hours", type=float, default=0.0,
                   help="the deployment has run before: the jobs find in its availability log what an earlier job "
                        "of the same policy logged in this many hours before they start (at most since the "
                        "traces' start; policies that read the traces ignore it; default 0: an empty log)")
    p.add_argument("--start-hour", type=float, default=0.0, help="replay from this hour of the traces")
    p.add_argument("--offsets", action="store_true", help="also run every hourly start offset and print the distribution")
    p.add_argument("--offset-step-hours", type=float, default=1.0)
    p.add_argument("--png", default=None, help="write progress and cost over time to this PNG")
    p.add_argument("--json", dest="json_out", default=None, help="write the figures as JSON to this file")


def _trace_paths(args: list[str] | None) -> list[Path]:
    if not args:
        return [default_traces_dir() / PREEMPTION_TRACES_SUBDIR]
    return [Path(x) for arg in args for x in arg.split(",") if x]


def _check_arguments(args: argparse.Namespace) -> None:
    """Argument checks JobSpec does not make (it validates the job itself); ``ValueError`` says the fix."""
    for flag, value in (("--spot-price", args.spot_price), ("--on-demand-price", args.on_demand_price)):
        if value is not None and not value > 0:  # also NaN
            raise ValueError(f"{flag} is $/h of an instance and must be > 0, got {value}")
    if not args.start_hour >= 0:
        raise ValueError(f"--start-hour must be >= 0 (hours into the traces), got {args.start_hour}")
    if not args.segment_minutes > 0:
        raise ValueError(f"--segment-minutes is the wall-clock length of one segment and must be > 0, "
                         f"got {args.segment_minutes}")
    if not args.history_hours >= 0:
        raise ValueError(f"--history-hours is how long an earlier job ran before the replayed one and must be >= 0, "
                         f"got {args.history_hours}")
    if not args.offset_step_hours > 0:
        raise ValueError(f"--offset-step-hours must be > 0, got {args.offset_step_hours}")


def _transfer(args: argparse.Namespace) -> TransferCost:
    """The transfer a move pays and, with one store, the saves an instance elsewhere writes back an hour:
    flat and per GiB of checkpoint, as the operators derive them (one save a segment)."""
    per_gib = args.transfer_dollars_per_gib or args.transfer_seconds_per_gib
    if per_gib and not args.checkpoint_gib:
        raise ValueError("--transfer-dollars-per-gib / --transfer-seconds-per-gib price each GiB of the checkpoint: "
                         "give its size with --checkpoint-gib")
    for flag in ("checkpoint_gib", "transfer_seconds", "transfer_dollars", "transfer_seconds_per_gib",
                 "transfer_dollars_per_gib"):
        if not getattr(args, flag) >= 0:  # also NaN
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    saves = 60.0 / args.segment_minutes if args.store_region else 0.0  # without one store, saves stay local
    return transfer_cost(args.checkpoint_gib * GIB, seconds=args.transfer_seconds, dollars=args.transfer_dollars,
                         seconds_per_gib=args.transfer_seconds_per_gib, dollars_per_gib=args.transfer_dollars_per_gib,
                         saves_per_hour=saves)


def _check_window(args: argparse.Namespace, traces: list, start: int) -> None:
    """The replay must start inside every trace, or every policy would report 'unfinished' for no reason."""
    if not traces:
        raise ValueError("no trace to replay; give --traces FILE_OR_DIR[,...]")
    shortest = min(len(t.values) for t in traces)
    if start >= shortest:
        hours = shortest * traces[0].gap_seconds / 3600
        raise ValueError(f"--start-hour {args.start_hour:g} is past the end of the traces ({hours:.1f} h); "
                         f"use a start hour below {hours:.1f}")


def _replay_notes(args: argparse.Namespace, traces: list, results: list) -> list[str]:
    """What the figures rest on beyond the traces: a replay past their end sees every spot pool down
    (``SpotTrace.up_at``), so what a policy did there is an artefact of the replay, not of the market."""
    notes = []
    if args.store_region and args.store_region not in {t.region for t in traces}:
        notes.append(f"no zone of the traces is in the store's region {args.store_region}: every instance pays "
                     "the transfer")
    end = min(len(t.values) for t in traces) * traces[0].gap_seconds / 3600
    # on-demand reads no trace; the hindsight optimum has no completion time and is kept inside the window
    late = [r.policy for r in results if r.policy not in ("on-demand", HINDSIGHT)
            and (r.completion_hours is None or args.start_hour + r.completion_hours > end)]
    if late:
        notes.append(f"{', '.join(late)} ran past the end of the traces (hour {end:.1f}; this job started at hour "
                     f"{args.start_hour:g}): past it every spot pool counts as down, so the on-demand hours or the "
                     "'unfinished' there come from the replay, not the market; replay a shorter job or an earlier "
                     "--start-hour")
    return notes


def run(args: argparse.Namespace) -> int:
    try:
        _check_arguments(args)
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        transfer = _transfer(args)
        spec = JobSpec(work_hours=args.work_hours, deadline_hours=args.deadline_hours,
                       save_cost_seconds=args.save_cost_seconds, restart_overhead_hours=args.restart_overhead_hours,
                       notice_seconds=args.notice_seconds, nodes=args.nodes, transfer_seconds=transfer.seconds,
                       transfer_dollars=transfer.dollars, segment_seconds=args.segment_minutes * 60.0,
                       probe_miss=args.probe_miss, store_region=args.store_region or None,
                       remote_dollars_per_hour=transfer.dollars_per_hour)
        traces = load_traces(_trace_paths(args.traces))
        if args.zones:
            wanted = [z.strip() for z in args.zones.split(",") if z.strip()]
            unknown = sorted(set(wanted) - {t.zone for t in traces})
            if unknown:
                raise ValueError(f"zones {unknown} have no trace; traces cover {sorted(t.zone for t in traces)}")
            traces = [t for z in wanted for t in traces if t.zone == z]
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        for n in names:
            if n != HINDSIGHT:
                controllers.get(n)
        if HINDSIGHT in names and args.deadline_hours is None:
            raise ValueError("the hindsight optimum needs a deadline: pass --deadline-hours")
        check_node_count(traces, args.nodes)
        if args.store_region and args.store_region in {t.zone for t in traces}:
            raise ValueError(f"--store-region {args.store_region} is a zone; give its region "
                             f"({next(t.region for t in traces if t.zone == args.store_region)})")
        if args.store_region:
            check_region(args.store_region)
        prices = read_prices(args.prices) if args.prices else None
        market = None
        if prices is None and (args.spot_price is None or args.on_demand_price is None):
            from airflow_spot.market import get_market

            market = get_market("local")
        pools, on_demand = build_pools(traces, spot_price=args.spot_price, on_demand_price=args.on_demand_price,
                                       market=market, prices=prices, nodes=args.nodes, tick_prices=not args.mean_prices)
        start = int(args.start_hour * 3600 // traces[0].gap_seconds)
        _check_window(args, traces, start)
    except (TraceError, ValueError, KeyError) as exc:
        print(f"airflow-spot simulate: {exc}", file=sys.stderr)
        return 2
    baseline = run_policies(spec, pools, on_demand, ["on-demand"], offset_ticks=start)[0].cost
    results = run_policies(spec, pools, on_demand, names, offset_ticks=start, jobs=args.jobs,
                           history_hours=args.history_hours)
    best = None
    if spec.deadline_hours is not None:
        best = next((r.cost for r in results if r.policy == HINDSIGHT), None)
        if best is None:
            best = run_one(spec, pools, on_demand, HINDSIGHT, start).cost
    given = args.prices is not None or args.spot_price is not None or args.on_demand_price is not None
    for note in (read_notes(traces, tick_prices=not args.mean_prices, own_prices=not given)
                 + _replay_notes(args, traces, results)):
        print(f"note: {note}")
    print(f"job: {spec.work_hours:g} GPU h x {spec.nodes} node(s), deadline {spec.deadline_hours} h, restart "
          f"{spec.restart_overhead_hours:g} h, segments {spec.segment_seconds / 60:g} min, zones {', '.join(t.zone for t in traces)}, "
          f"start hour {args.start_hour:g}, "
          f"{args.jobs} job(s)" + (f" after {args.history_hours:g} h of history" if args.history_hours else "")
          + f"; on-demand only = ${baseline:.2f}"
          + (f"; hindsight optimum = ${best:.2f}" if best else ""))
    print(format_table(results, baseline, best))
    out: dict = {"spec": spec.__dict__, "zones": [t.zone for t in traces], "on_demand_cost": baseline,
                 "runs": [r.to_dict() for r in results]}
    if args.offsets:
        try:
            offs = offsets_for(spec, traces, args.offset_step_hours)
        except ValueError as exc:
            print(f"airflow-spot simulate: {exc}", file=sys.stderr)
            return 2
        dists = [distribution(spec, pools, on_demand, n, offs, baseline, jobs=args.jobs, history_hours=args.history_hours)
                 for n in names]
        hs = None
        if spec.deadline_hours is not None:
            hs = next((d for d in dists if d.policy == HINDSIGHT), None) or hindsight_distribution(
                spec, pools, on_demand, offs, baseline)
        print(f"\nover {len(offs)} start offsets every {args.offset_step_hours:g} h (cost as a multiple of on-demand"
              + (", and / hindsight" if hs else "") + "):")
        print(format_distributions(dists, hs))
        out["distributions"] = [d.to_dict() for d in dists]
    if args.png:
        print(f"\nwrote {plot(results, args.png, spec)}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))
    return 0
