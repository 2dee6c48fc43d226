"""``airflow-spot offers``: the offers a GPU request would get now, ranked by expected $ per training step.

Examples::

    airflow-spot offers --gpus 1 --min-memory-gib 16                      # local: the bundled catalog
    airflow-spot offers --backend ec2 --gpus 1 --regions us-east-1,us-west-2 --limit 10
    airflow-spot offers --backend ec2 --gpus 1 --gpu-names A10G,L4 --max-price 1.5 --market-options '{...}'

The ``$/step`` column is the price of one training step that takes ``--step-seconds`` on one V100 (scaled
by the offer's relative throughput), inflated by the expected preemption overhead of the pool: the same
quantity the operators rank by.
"""
from __future__ import annotations

import argparse
import math
import re
import sys

from airflow_spot.backends.base import backend_class, backend_names
from airflow_spot.policy.offer_ranking import cost_per_step, rank_offers
from airflow_spot.policy.offers import GpuRequest, Market
from airflow_spot.cli_types import (
    AWS_CONN_ID_HELP, MAX_PRICE_PER_HOUR, aws_conn_id, canonical_gpu_names, json_object, known_gpu_names,
)

#: the longest --step-seconds taken (a day): far above it the $/step column is a typo's
MAX_STEP_SECONDS = 86_400.0


def _names(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="local",
                        help=f"backend whose market to ask ({', '.join(backend_names())})")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per instance (exact)")
    parser.add_argument("--min-memory-gib", dest="min_memory", type=float, default=0.0, metavar="GIB",
                        help="minimum memory per GPU (--min-memory is the same)")
    parser.add_argument("--min-memory", dest="min_memory", type=float, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)  # the older spelling; `estimate` has --min-memory-gib
    parser.add_argument("--regions", type=_names, default=[], help="comma-separated regions, e.g. us-east-1,us-west-2")
    parser.add_argument("--zones", type=_names, default=[], help="comma-separated zones, e.g. us-east-1a")
    parser.add_argument("--gpu-names", type=_names, default=[], help="allowed GPU models, e.g. A10G,L4 (any case)")
    parser.add_argument("--exclude-gpus", type=_names, default=[], help="GPU models never to take, e.g. K80,T4 (any case)")
    parser.add_argument("--max-price", type=float, default=None, metavar="USD_PER_HOUR", help="cap on $/h")
    parser.add_argument("--spot-only", action="store_true", help="leave out on-demand offers")
    parser.add_argument("--step-seconds", type=float, default=1.0,
                        help="seconds one training step takes on one V100, for the $/step column (default 1)")
    parser.add_argument("--limit", type=int, default=20, help="print at most this many offers (default 20)")
    parser.add_argument("--market-options", type=json_object("--market-options"), default={}, metavar="JSON",
                        help="the market's kwargs, e.g. '{\"price_ttl_seconds\": 60}'")
    parser.add_argument("--aws-conn-id", type=aws_conn_id, default="aws_default", help=AWS_CONN_ID_HELP)


def _request(args: argparse.Namespace, *, filters: bool) -> GpuRequest:
    markets = (Market.SPOT,) if args.spot_only else (Market.SPOT, Market.ON_DEMAND)
    if not filters:
        return GpuRequest(count=args.gpus, regions=tuple(args.regions), markets=markets)
    return GpuRequest(count=args.gpus, min_memory_gib=args.min_memory, names=tuple(args.gpu_names),
                      exclude_names=tuple(args.exclude_gpus), max_price_per_hour=args.max_price,
                      regions=tuple(args.regions), zones=tuple(args.zones), markets=markets)


#: GpuRequest's settings, as its no-match message names them -> this command's flags
_FLAGS = {"count=": "--gpus ", "min_memory_gib=": "--min-memory-gib ", "names=": "--gpu-names ",
          "exclude_names=": "--exclude-gpus ", "regions=": "--regions ", "zones=": "--zones ",
          "max_price_per_hour=": "--max-price "}
_SETTING = re.compile(r"\((" + "|".join(map(re.escape, _FLAGS)) + r")")


def _nothing_offered(args: argparse.Namespace, market) -> str:
    """Why not even the count and regions alone leave an offer. Only the bundled catalog is asked again: a
    cloud market, without the regions, would query every region."""
    asked = f"{args.gpus} GPU(s) per instance" + (f" in regions {list(args.regions)}" if args.regions else "")
    if not hasattr(market, "offers_of_every_count"):
        return f"the market offers nothing with {asked}"
    offered = market.offers_of_every_count(_request(args, filters=False).markets)
    there = [o for o in offered if not args.regions or o.region in args.regions]
    if not there:
        return f"the market offers nothing in regions {list(args.regions)}; its regions: {sorted({o.region for o in offered})}"
    return f"the market offers nothing with {asked}; its instances there have {sorted({o.gpu_count for o in there})} GPUs"


def _check(args: argparse.Namespace) -> None:
    """Refuse what no market could answer, naming the flag; spell GPU names as the markets do."""
    from airflow_spot.operators.validation import SpotTrainingConfigError, validate_option_names

    if not 0 < args.step_seconds < math.inf:  # also NaN
        raise ValueError(f"--step-seconds is the seconds one step takes on one V100 and must be a finite number "
                         f"> 0, got {args.step_seconds:g}")
    if args.step_seconds > MAX_STEP_SECONDS:
        raise ValueError(f"--step-seconds is the seconds one step takes on one V100 and must be at most "
                         f"{MAX_STEP_SECONDS:,.0f} (a day), got {args.step_seconds:g}")
    # GpuRequest checks these too, but in its Python names (count=, min_memory_gib=): say the flags
    if args.gpus < 1:
        raise ValueError(f"--gpus is the GPUs per instance and must be at least 1, got {args.gpus}")
    if not 0 <= args.min_memory < math.inf:
        raise ValueError(f"--min-memory-gib is the GiB of memory per GPU and must be a finite number >= 0, "
                         f"got {args.min_memory:g}")
    if args.max_price is not None and not 0 < args.max_price < math.inf:
        raise ValueError(f"--max-price is a cap on $/h and must be a finite number > 0 (leave it out for no cap), "
                         f"got {args.max_price:g}")
    if args.max_price is not None and args.max_price > MAX_PRICE_PER_HOUR:
        raise ValueError(f"--max-price is a cap on $/h and must be at most {MAX_PRICE_PER_HOUR:,.0f}: no instance "
                         f"costs that much (leave it out for no cap), got {args.max_price:g}")
    if args.limit < 1:
        raise ValueError(f"--limit is how many offers to print and must be at least 1, got {args.limit}")
    try:
        validate_option_names(args.backend, None, args.market_options)
    except SpotTrainingConfigError as exc:
        raise ValueError(str(exc).replace("market_options:", "--market-options:", 1)) from None
    overrides = args.market_options.get("throughput_overrides")
    known = known_gpu_names(overrides if isinstance(overrides, dict) else ())
    args.gpu_names = canonical_gpu_names("--gpu-names", args.gpu_names, known)
    args.exclude_gpus = canonical_gpu_names("--exclude-gpus", args.exclude_gpus, known)
    both = [n for n in args.gpu_names if n in args.exclude_gpus]
    if both:
        raise ValueError(f"GPU models {both} are both in --gpu-names and in --exclude-gpus; drop them from one")
    _check_places(args)


def _check_places(args: argparse.Namespace) -> None:
    """Refuse a region or zone the market can never offer, as ``SpotTraining`` does at parse time: an unknown
    zone would otherwise leave only the on-demand offers of its region, silently."""
    from airflow_spot.operators.validation import SpotTrainingConfigError, validate_places

    if not args.regions and not args.zones:
        return
    try:
        validate_places(GpuRequest(count=args.gpus, regions=tuple(args.regions), zones=tuple(args.zones)),
                        args.backend, args.market_options)
    except SpotTrainingConfigError as exc:
        # its words are SpotTraining's (gpus: ... in regions; airflow-spot offers lists ...): say the flags
        text = str(exc).removeprefix("gpus: ")
        text = text.replace(" in regions;", " in --regions;").replace(
            " (airflow-spot offers lists the zones of each offer)",
            "; leave out --zones to see the zone of each offer")
        raise ValueError(("--zones: " if "zones" in text.split(";")[0] else "--regions: ") + text) from None


def _check_zones_offered(args: argparse.Namespace, pool: list) -> None:
    """A zone that no spot offer of the market is in (whatever the other filters) would leave only the
    on-demand offers of its region: say so instead of listing those."""
    if not args.zones:
        return
    offered = {o.zone for o in pool if Market(o.market) is Market.SPOT}
    missing = [z for z in args.zones if z not in offered]
    if missing:
        where = f" in --regions {','.join(args.regions)}" if args.regions else ""
        near = sorted(offered)
        raise ValueError(
            f"--zones: no offer of {args.gpus} GPU(s) per instance is in zone(s) {missing}{where}; "
            + (f"the zones with such offers{where or ''}: {', '.join(near[:40])}"
               + (f" ... ({len(near)} in all)" if len(near) > 40 else "")
               if near else "the market offers no spot instance with that many GPUs there")
            + " (leave out --zones to see the zone of each offer)")


def run(args: argparse.Namespace) -> int:
    from airflow_spot.commands.airflow_lookups import airflow_logs_to_stderr

    with airflow_logs_to_stderr():  # Airflow's log lines (the connection's, ...) are no part of the table
        code, offers = _offers(args)
    if code:
        return code
    ranked = rank_offers(offers, now=0.0)
    print(f"{'type':<16}{'zone':<14}{'market':<10}{'gpu':<12}{'$/h':>9}{'od $/h':>9}{'$/step':>12}"
          f"{'risk/h':>8}")
    for offer in ranked[: args.limit]:
        per_step = cost_per_step(offer) * args.step_seconds / 3600.0
        gpu = f"{offer.gpu_count}x{offer.gpu_name}"
        print(f"{offer.instance_type:<16}{offer.zone:<14}{Market(offer.market).value:<10}{gpu:<12}"
              f"{offer.price_per_hour:>9.4f}{offer.on_demand_price_per_hour:>9.4f}{per_step:>12.3e}"
              f"{offer.preemption_rate_per_hour:>8.3f}")
    if len(ranked) > args.limit:
        print(f"... {len(ranked) - args.limit} more (raise --limit)")
    return 0


def _offers(args: argparse.Namespace) -> tuple[int, list]:
    """``(0, offers)``, or ``(exit code, [])`` after saying on stderr why there are none."""
    from airflow_spot.market import get_market

    try:
        _check(args)
        request = _request(args, filters=True)
        options = dict(args.market_options)
        if args.regions and "regions" not in options and getattr(backend_class(args.backend), "uses_clients", False):
            options["regions"] = list(args.regions)
        clients = None
        if getattr(backend_class(args.backend), "uses_clients", False):
            from airflow_spot.commands.airflow_lookups import clients_for

            clients = clients_for(args.aws_conn_id)
        market = get_market(args.backend, clients=clients, **options)
        pool = market.offers(_request(args, filters=False)) if args.zones else None
        _check_zones_offered(args, pool or [])
        offers = market.offers(request)
        if not offers:
            pool = market.offers(_request(args, filters=False)) if pool is None else pool
            why = request.describe_mismatch(pool) if pool else _nothing_offered(args, market)
            why = _SETTING.sub(lambda m: "(" + _FLAGS[m.group(1)], why)
            print(f"airflow-spot offers: no offer matches the request: {why}", file=sys.stderr)
            return 1, []
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        print(f"airflow-spot offers: {exc}", file=sys.stderr)
        return 2, []
    return 0, offers
