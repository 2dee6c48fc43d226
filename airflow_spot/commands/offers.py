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
from airflow_spot.cli_types import AWS_CONN_ID_HELP, aws_conn_id, canonical_gpu_names, json_object, known_gpu_names


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
    # GpuRequest checks these too, but in its Python names (count=, min_memory_gib=): say the flags
    if args.gpus < 1:
        raise ValueError(f"--gpus is the GPUs per instance and must be at least 1, got {args.gpus}")
    if not 0 <= args.min_memory < math.inf:
        raise ValueError(f"--min-memory-gib is the GiB of memory per GPU and must be a finite number >= 0, "
                         f"got {args.min_memory:g}")
    if args.max_price is not None and not 0 < args.max_price < math.inf:
        raise ValueError(f"--max-price is a cap on $/h and must be a finite number > 0 (leave it out for no cap), "
                         f"got {args.max_price:g}")
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


def run(args: argparse.Namespace) -> int:
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
        offers = market.offers(request)
        if not offers:
            pool = market.offers(_request(args, filters=False))
            why = request.describe_mismatch(pool) if pool else _nothing_offered(args, market)
            why = _SETTING.sub(lambda m: "(" + _FLAGS[m.group(1)], why)
            print(f"airflow-spot offers: no offer matches the request: {why}", file=sys.stderr)
            return 1
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        print(f"airflow-spot offers: {exc}", file=sys.stderr)
        return 2
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
