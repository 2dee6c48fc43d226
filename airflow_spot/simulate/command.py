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
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

from airflow_spot.cli_types import MAX_PRICE_PER_HOUR, check_price
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

#: JobSpec's field -> the flag that sets it, to word JobSpec's messages in the command's terms
_FLAGS = {
    "work_hours": "--work-hours", "deadline_hours": "--deadline-hours", "save_cost_seconds": "--save-cost-seconds",
    "restart_overhead_hours": "--restart-overhead-hours", "notice_seconds": "--notice-seconds", "nodes": "--nodes",
    "transfer_seconds": "--transfer-seconds", "transfer_dollars": "--transfer-dollars",
    "store_region": "--store-region", "segment_seconds": "--segment-minutes (x 60)", "probe_miss": "--probe-miss",
    "remote_dollars_per_hour": "--transfer-dollars-per-gib (with --store-region)",
}
_FLAG_WORDS = re.compile(r"\b(" + "|".join(sorted(_FLAGS, key=len, reverse=True)) + r")\b")


def _cli_words(message: str) -> str:
    """A JobSpec message (Python names, for API users) with the command's flag names."""
    return _FLAG_WORDS.sub(lambda m: _FLAGS[m.group(1)], message)


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
                   help="CSV file of per-zone prices, lines zone,spot,on_demand ($/h; instead of --spot-price and "
                        "--on-demand-price)")
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
    p.add_argument("--offset-step-hours", type=float, default=1.0,
                   help="with --offsets: hours between two start offsets (default 1)")
    p.add_argument("--png", default=None, help="write progress and cost over time to this PNG")
    p.add_argument("--json", dest="json_out", default=None, help="write the figures as JSON to this file")


def _check_outputs(args: argparse.Namespace) -> None:
    """``--png`` and ``--json`` name files that can be written, checked before the replay (which can take
    minutes): a missing folder is created when the file is written (for both), but a path whose folder
    cannot be made (a part of it is a file) or written, or that is a folder, is refused now."""
    outs = [(flag, value) for flag, value in (("--png", args.png), ("--json", args.json_out)) if value]
    if len(outs) == 2 and Path(outs[0][1]).resolve() == Path(outs[1][1]).resolve():
        raise ValueError(f"--png and --json both name {outs[0][1]}; give each its own file")
    for flag, value in outs:
        path = Path(value)
        if path.is_dir():
            raise ValueError(f"{flag} {value} is a folder; give a file path (e.g. {path / ('sim.' + flag[2:])})")
        if path.exists() and not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {value} cannot be written (no permission); give another path")
        folder = path.absolute().parent
        existing = folder
        while not existing.exists() and existing != existing.parent:  # the deepest part that exists
            existing = existing.parent
        if not existing.is_dir():
            raise ValueError(f"{flag} {value} cannot be written: {existing} is a file, not a folder; give another path")
        if not os.access(existing, os.W_OK | os.X_OK):
            what = "its folder" if existing == folder else f"its folder {folder} cannot be created in"
            raise ValueError(f"{flag} {value} cannot be written: {what} {existing} is not writable; "
                             "give another path")
    if args.png and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--png needs matplotlib (pip install matplotlib); leave --png out, or use --json")


def _write_json(path: str, out: dict) -> Path:
    """The figures as JSON; a figure that is not a number (the hindsight optimum's hours, an infeasible
    optimum's cost) is ``null``: JSON has no NaN or Infinity."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(clean(out), indent=2, default=str))
    return p


def _warn(message: str) -> None:
    print(f"airflow-spot simulate: warning: {message}", file=sys.stderr)


def _trace_paths(args: list[str] | None) -> list[Path]:
    if not args:
        return [default_traces_dir() / PREEMPTION_TRACES_SUBDIR]
    return [Path(x) for arg in args for x in arg.split(",") if x]


#: the float flags, each checked finite: an infinite one is no quantity, and hangs or garbles the replay
_FLOAT_FLAGS = ("work_hours", "save_cost_seconds", "restart_overhead_hours", "notice_seconds", "segment_minutes",
                "spot_price", "on_demand_price", "transfer_seconds", "probe_miss", "transfer_dollars",
                "checkpoint_gib", "transfer_dollars_per_gib", "transfer_seconds_per_gib", "history_hours",
                "start_hour", "offset_step_hours")


#: the most jobs ``--jobs`` replays together
MAX_JOBS = 100

#: flag -> (the most it takes, what it is): far above these a figure is a typo, and the replay's sums overflow
#: or print meaningless digits (``--transfer-dollars 1e300``); each bound is far past any real job's
_UPPER_BOUNDS = {
    "save_cost_seconds": (86_400.0, "the training stall per checkpoint in seconds (a day at most)"),
    "restart_overhead_hours": (24.0, "the paid hours without progress per new instance (a day at most)"),
    "notice_seconds": (86_400.0, "the preemption notice window in seconds (clouds give 30-120 s; a day at most)"),
    "segment_minutes": (10_080.0, "the wall-clock minutes of one segment (a week at most)"),
    "transfer_seconds": (86_400.0, "the extra restart seconds to move the checkpoint to another region (a day at "
                                   "most)"),
    "transfer_dollars": (MAX_PRICE_PER_HOUR, "$ per checkpoint moved across regions"),
    "checkpoint_gib": (1_048_576.0, "the checkpoint's size in GiB (a PiB at most)"),
    "transfer_dollars_per_gib": (10.0, "inter-region $ per GiB (AWS charges about 0.02; $10 at most)"),
    "transfer_seconds_per_gib": (3_600.0, "restore seconds per GiB across regions (an hour at most)"),
    "history_hours": (8_760.0, "the hours of an earlier job's events the deployment's log starts with (a year at "
                               "most)"),
}


def _history_words(args: argparse.Namespace, traces, start: int) -> str:
    """The history the replay had: what the traces hold before the start, not what was asked for."""
    if not args.history_hours:
        return ""
    held = min(args.history_hours, start * traces[0].gap_seconds / 3600.0)
    if held <= 0:
        return f" with no history (--history-hours {args.history_hours:g}: the traces hold none before the start)"
    if held < args.history_hours:
        return f" after {held:g} h of history (the traces hold no more before the start; {args.history_hours:g} asked)"
    return f" after {held:g} h of history"


def _check_arguments(args: argparse.Namespace) -> None:
    """Argument checks JobSpec does not make, and the job's own in the command's terms (JobSpec validates
    the job again, in its field names); ``ValueError`` says the fix."""
    for name in _FLOAT_FLAGS:
        value = getattr(args, name)
        if value is not None and math.isinf(value):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if not args.work_hours > 0:  # also NaN
        raise ValueError(f"--work-hours must be positive (hours of training on one V100), got {args.work_hours}")
    if not args.restart_overhead_hours >= 0:
        raise ValueError(f"--restart-overhead-hours must be >= 0, got {args.restart_overhead_hours}")
    if args.deadline_hours is not None:
        if not (args.deadline_hours > 0 and math.isfinite(args.deadline_hours)):
            raise ValueError(f"--deadline-hours must be a positive number of hours (from the job's start; leave it "
                             f"out for no deadline), got {args.deadline_hours}")
        least = args.work_hours + args.restart_overhead_hours
        if args.deadline_hours < least - 1e-9:  # the work and the first instance's restart, at the least
            raise ValueError(
                f"--deadline-hours {args.deadline_hours:g} cannot be met by any policy: the work "
                f"(--work-hours {args.work_hours:g}) and one restart (--restart-overhead-hours "
                f"{args.restart_overhead_hours:g}) take {least:g} h; the smallest feasible deadline is "
                f"--deadline-hours {least:g} (checkpoint stalls add to it), or shrink the job")
    if args.prices is not None:
        given = [f for f, v in (("--spot-price", args.spot_price), ("--on-demand-price", args.on_demand_price))
                 if v is not None]
        if given:
            raise ValueError(f"--prices gives every zone its spot and on-demand price, so {' and '.join(given)} "
                             f"would be ignored; drop {' and '.join(given)}, or drop --prices to price every "
                             "zone alike")
    for flag, value in (("--spot-price", args.spot_price), ("--on-demand-price", args.on_demand_price)):
        check_price(flag, value, "$/h of an instance")
    for name, (most, what) in _UPPER_BOUNDS.items():
        value = getattr(args, name)
        if value is not None and value > most:
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} is {what} and must be at most {most:,.0f}, got {value:g}")
    if not args.start_hour >= 0:
        raise ValueError(f"--start-hour must be >= 0 (hours into the traces), got {args.start_hour}")
    if not args.segment_minutes >= 1:  # an Airflow task's own hand-off takes longer; below, a replay only spins
        raise ValueError(f"--segment-minutes is the wall-clock length of one segment and must be at least 1, "
                         f"got {args.segment_minutes}")
    if not args.history_hours >= 0:
        raise ValueError(f"--history-hours is how long an earlier job ran before the replayed one and must be >= 0, "
                         f"got {args.history_hours}")
    if not args.offset_step_hours > 0:
        raise ValueError(f"--offset-step-hours must be > 0, got {args.offset_step_hours}")


def _read_prices(path: str) -> dict[str, tuple[float, float]]:
    """:func:`read_prices`, with the file named where it cannot be read as one and every price finite."""
    if Path(path).is_dir():
        raise ValueError(f"--prices {path} is a folder; give a CSV file with lines zone,spot,on_demand")
    try:
        prices = read_prices(path)
    except (UnicodeDecodeError, OSError) as exc:
        raise ValueError(f"--prices {path} cannot be read as a CSV text file ({exc}); give a CSV with lines "
                         "zone,spot,on_demand") from None
    for zone, (spot, od) in prices.items():
        if not (math.isfinite(spot) and math.isfinite(od)):
            raise ValueError(f"{path}: zone {zone}'s prices must be finite numbers ($/h), got spot {spot}, "
                             f"on-demand {od}")
        for which, value in (("spot", spot), ("on-demand", od)):
            try:
                check_price(f"--prices {path}: zone {zone}'s {which} price", value)
            except ValueError as exc:
                raise ValueError(f"{exc}; fix that zone's line in the file") from None
    return prices


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
    hours = shortest * traces[0].gap_seconds / 3600
    if start >= shortest:
        raise ValueError(f"--start-hour {args.start_hour:g} is past the end of the traces ({hours:.1f} h); "
                         f"use a start hour below {hours:.1f}")
    # a replay runs up to 4x the job's hours, and past the traces every pool counts as down: a job far
    # longer than what is left of them says nothing of the market and could run for hours
    left = hours - args.start_hour
    longest = args.deadline_hours if args.deadline_hours is not None else args.work_hours
    if longest > 2 * left:
        flag = "--deadline-hours" if args.deadline_hours is not None else "--work-hours"
        raise ValueError(f"{flag} {longest:g} is more than twice the {left:.1f} h of traces left from --start-hour "
                         f"{args.start_hour:g}: past their end every spot pool counts as down, so such a replay "
                         f"says nothing of the market; replay a job of at most {2 * left:.1f} h, an earlier "
                         "--start-hour, or longer --traces")


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


def _spot_above_on_demand(pools: list) -> None:
    """Warn (one line) where a zone's spot price is above its on-demand price: the figures follow, since
    the policies compare offers by price per work, but the input is most likely not what was meant."""
    above = [p.offer for p in pools if p.offer.price_per_hour > p.offer.on_demand_price_per_hour]
    if above:
        if len({(o.price_per_hour, o.on_demand_price_per_hour) for o in above}) == 1:
            zones = (f"{', '.join(o.zone for o in above)} (spot ${above[0].price_per_hour:.4g}/h, on-demand "
                     f"${above[0].on_demand_price_per_hour:.4g}/h)")
        else:
            zones = ", ".join(f"{o.zone} (spot ${o.price_per_hour:.4g}/h, on-demand "
                              f"${o.on_demand_price_per_hour:.4g}/h)" for o in above)
        _warn(f"spot is priced above on-demand for zones {zones}: a spot run there costs more than on-demand, "
              "and the figures below show it; check --spot-price / --on-demand-price (or --prices)")


def _deadline_reachable(args: argparse.Namespace, spec: JobSpec, od_run) -> None:
    """Warn when on-demand from the start (launched at once, never preempted) misses the deadline: the
    checkpoint stalls on top of the work and one restart. Not a refusal: a spot policy that saves less
    often than on-demand's hourly saves (a large ``--save-cost-seconds``) may still finish in time."""
    if spec.deadline_hours is None or od_run.deadline_met is not False:
        return
    needs = od_run.completion_hours
    print(f"airflow-spot simulate: warning: on-demand from the start, never preempted, finishes at {needs:.2f} h, "
          f"after --deadline-hours {args.deadline_hours:g} (--work-hours {args.work_hours:g}, one restart of "
          f"--restart-overhead-hours {args.restart_overhead_hours:g}, and checkpoint stalls of --save-cost-seconds "
          f"{args.save_cost_seconds:g}): a policy that falls back to on-demand misses it, and the hindsight "
          "optimum, which leaves the stalls out, may count it met; --deadline-hours "
          f"{math.ceil(needs * 100) / 100:g} or more is safe", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    try:
        _check_arguments(args)
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        if args.jobs > MAX_JOBS:  # each job reads the others' events: 50 took a minute, a million never ended
            raise ValueError(f"--jobs is how many jobs of one deployment start together and must be at most "
                             f"{MAX_JOBS} (a row each; more replay for hours), got {args.jobs}")
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        if not names:
            raise ValueError(f"--policies {args.policies!r} names no policy; give one or more of: "
                             f"{', '.join(policy_names())}")
        for n in names:
            if n not in policy_names():
                raise ValueError(f"unknown simulated controller policy {n!r} in --policies; valid policies: "
                                 f"{', '.join(policy_names())}")
        if HINDSIGHT in names and args.deadline_hours is None:
            raise ValueError("the hindsight optimum needs a deadline: pass --deadline-hours, or leave hindsight "
                             "out of --policies")
        _check_outputs(args)
        transfer = _transfer(args)
        try:
            spec = JobSpec(work_hours=args.work_hours, deadline_hours=args.deadline_hours,
                           save_cost_seconds=args.save_cost_seconds,
                           restart_overhead_hours=args.restart_overhead_hours, notice_seconds=args.notice_seconds,
                           nodes=args.nodes, transfer_seconds=transfer.seconds, transfer_dollars=transfer.dollars,
                           segment_seconds=args.segment_minutes * 60.0, probe_miss=args.probe_miss,
                           store_region=args.store_region or None, remote_dollars_per_hour=transfer.dollars_per_hour)
        except ValueError as exc:
            raise ValueError(_cli_words(str(exc))) from None
        traces = load_traces(_trace_paths(args.traces))
        prices = _read_prices(args.prices) if args.prices else None
        if prices is not None:
            stray = sorted(set(prices) - {t.zone for t in traces})
            if stray:
                _warn(f"the prices file {args.prices} lists zones {', '.join(stray)} that no trace covers; they are "
                      f"ignored (the traces cover {', '.join(sorted({t.zone for t in traces}))})")
        if args.zones:
            wanted = list(dict.fromkeys(z.strip() for z in args.zones.split(",") if z.strip()))  # one pool a zone
            if not wanted:
                raise ValueError(f"--zones {args.zones!r} names no zone; give some of "
                                 f"{', '.join(sorted(t.zone for t in traces))}, or leave --zones out for all")
            unknown = sorted(set(wanted) - {t.zone for t in traces})
            if unknown:
                raise ValueError(f"--zones: zones {unknown} have no trace; traces cover "
                                 f"{sorted(t.zone for t in traces)}: give some of those, or other --traces")
            traces = [t for z in wanted for t in traces if t.zone == z]
        check_node_count(traces, args.nodes)
        if args.store_region and args.store_region in {t.zone for t in traces}:
            raise ValueError(f"--store-region {args.store_region} is a zone; give its region "
                             f"({next(t.region for t in traces if t.zone == args.store_region)})")
        if args.store_region:
            check_region(args.store_region)
        market = None
        if prices is None and (args.spot_price is None or args.on_demand_price is None):
            from airflow_spot.market import get_market

            market = get_market("local")
        pools, on_demand = build_pools(traces, spot_price=args.spot_price, on_demand_price=args.on_demand_price,
                                       market=market, prices=prices, nodes=args.nodes, tick_prices=not args.mean_prices)
        start = int(args.start_hour * 3600 // traces[0].gap_seconds)
        _check_window(args, traces, start)
        offs = offsets_for(spec, traces, args.offset_step_hours) if args.offsets else None
        od_run = run_policies(spec, pools, on_demand, ["on-demand"], offset_ticks=start)[0]
        _deadline_reachable(args, spec, od_run)
    except (TraceError, ValueError, KeyError) as exc:
        print(f"airflow-spot simulate: {exc}", file=sys.stderr)
        return 2
    _spot_above_on_demand(pools)
    baseline = od_run.cost
    results = run_policies(spec, pools, on_demand, names, offset_ticks=start, jobs=args.jobs,
                           history_hours=args.history_hours)
    best = None
    if spec.deadline_hours is not None:
        best = next((r.cost for r in results if r.policy == HINDSIGHT), None)
        if best is None:
            best = run_one(spec, pools, on_demand, HINDSIGHT, start).cost
    given = args.prices is not None or args.spot_price is not None or args.on_demand_price is not None
    notes = (read_notes(traces, tick_prices=not args.mean_prices, own_prices=not given)
             + _replay_notes(args, traces, results))
    if best is not None and not math.isfinite(best):
        notes.append("the hindsight optimum found no schedule meeting the deadline on its 0.1 h grid (the work, "
                     "restart and deadline rounded to whole steps): it is left out of the comparison")
    for note in notes:
        print(f"note: {note}")
    deadline = "no deadline" if spec.deadline_hours is None else f"deadline {spec.deadline_hours} h"
    optimum = ""
    if best is not None:
        optimum = f"; hindsight optimum = ${best:.2f}" if math.isfinite(best) else "; hindsight optimum: infeasible"
    print(f"job: {spec.work_hours:g} GPU h x {spec.nodes} node(s), {deadline}, restart "
          f"{spec.restart_overhead_hours:g} h, segments {spec.segment_seconds / 60:g} min, zones {', '.join(t.zone for t in traces)}, "
          f"start hour {args.start_hour:g}, "
          f"{args.jobs} job(s)" + _history_words(args, traces, start)
          + f"; on-demand only = ${baseline:.2f}" + optimum)
    print(format_table(results, baseline, best))
    out: dict = {"spec": spec.__dict__, "zones": [t.zone for t in traces], "on_demand_cost": baseline,
                 "runs": [r.to_dict() for r in results]}
    if best is not None and math.isfinite(best):  # the table's "x hindsight" column, whatever --policies holds
        out["hindsight_cost"] = best
        out["cost_per_hindsight"] = {r.policy: r.cost / best for r in results if best > 0}
    if offs is not None:
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
        if hs is not None:
            out["hindsight_distribution"] = hs.to_dict()
    if args.png:
        print(f"\nwrote {plot(results, args.png, spec)}")
    if args.json_out:
        print(("" if args.png else "\n") + f"wrote {_write_json(args.json_out, out)}")
    return 0
