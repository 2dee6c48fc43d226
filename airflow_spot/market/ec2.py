"""The live EC2 market: GPU instance types from ``DescribeInstanceTypes`` and current spot prices from
``DescribeSpotPriceHistory``, across the configured regions; on-demand prices, relative throughput and the
preemption prior come from the bundled catalog (the Pricing API is not needed at launch).

Spot prices are the newest per pool (type + zone), cached for ``price_ttl_seconds``; instance types are
cached for the market's life (they do not change during a job). ``price_overrides`` (and a JSON file at
``price_overrides_path``, re-read on every call) replace API prices per pool, for what-if runs and for
endpoints whose prices mean nothing (moto answers 0.00001 for everything); ``spot_prices="catalog"``
takes the bundled snapshot's spot price of the type in the region instead of the API's.

A finished attempt pays the spot price in effect while it ran (``billed_price``): the pool's history from
its start to its end, time-weighted, not the price it was launched at.

Example::

    get_market("ec2", regions=["us-east-1", "us-west-2"], clients=hook.clients)
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from airflow_spot.market.aws_regions import validate_regions
from airflow_spot.market.base import MarketSource
from airflow_spot.market.catalog import DEFAULT_MTBF_HOURS, CATALOG_PATH, read_catalog, read_pool_mtbf_hours
from airflow_spot.market.throughput import RELATIVE_THROUGHPUT_PER_GPU, instance_throughput
from airflow_spot.policy.ledger import mean_price
from airflow_spot.policy.offers import GpuRequest, Market, Offer

log = logging.getLogger(__name__)

PRODUCT = "Linux/UNIX"
#: how far back DescribeSpotPriceHistory answers (90 days), less a minute for the call's own time
HISTORY_SECONDS = 90 * 86400.0 - 60.0


class MarketError(RuntimeError):
    """The market could not be read (permissions, endpoint); says which call failed and how to fix it."""


def gpu_model(name: str, memory_gib: float) -> str:
    """EC2's GpuInfo name mapped onto the throughput table's names (A100 with 80 GB is its own row)."""
    if name == "A100" and memory_gib >= 70:
        return "A100-80GB"
    if name == "V100" and memory_gib >= 30:
        return "V100-32GB"
    return name


class Ec2Market(MarketSource):
    """Offers from the EC2 API of ``regions``.

    :param regions: regions to offer from.
    :param clients: :class:`~airflow_spot.backends.base.Clients` from the Airflow layer (default: boto3's chain).
    :param price_ttl_seconds: how long a spot price read is reused.
    :param spot_prices: ``api`` (DescribeSpotPriceHistory) or ``catalog`` (the bundled snapshot's price).
    :param price_overrides: ``{"<type>@<zone>": $/h}`` replacing the spot price of a pool.
    :param price_overrides_path: JSON file with the same mapping, re-read on each call.
    :param throughput_overrides: GPU name -> relative throughput per GPU (see ``airflow-spot estimate``).
    :param default_mtbf_hours: prior MTBF of pools without a measurement.
    :param architectures: CPU architectures the job's image runs on (an x86_64 AMI cannot boot a Graviton
        ``g5g``); default ``["x86_64"]``.
    :param clock: monotonic seconds (tests pass their own).
    :param wall_clock: epoch seconds, to keep a price-history window within what EC2 answers.
    """

    uses_clients = True  # built with the Airflow layer's clients (get_market), as the ec2 backend is

    def __init__(
        self,
        regions: Iterable[str] | str = ("us-east-1",),
        clients=None,
        price_ttl_seconds: float = 300.0,
        spot_prices: str = "api",
        price_overrides: dict[str, float] | None = None,
        price_overrides_path: str | None = None,
        throughput_overrides: dict[str, float] | None = None,
        default_mtbf_hours: float = DEFAULT_MTBF_HOURS,
        catalog_path: str | None = None,
        architectures: Iterable[str] = ("x86_64",),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.architectures = tuple(architectures)
        if not self.architectures or not set(self.architectures) <= {"x86_64", "arm64"}:
            raise ValueError(f"architectures must be a non-empty subset of ['x86_64', 'arm64'], got {architectures!r}")
        self.regions = validate_regions([regions] if isinstance(regions, str) else list(regions))
        if spot_prices not in ("api", "catalog"):
            raise ValueError(f"spot_prices must be 'api' or 'catalog', got {spot_prices!r}")
        for name, value, least in (("price_ttl_seconds", price_ttl_seconds, 0.0),
                                   ("default_mtbf_hours", default_mtbf_hours, None)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value < math.inf \
                    or (value < least if least is not None else not value > 0):
                raise ValueError(f"{name} must be a finite number {'>= 0' if least is not None else '> 0'}, "
                                 f"got {value!r}")
        self.price_overrides = self._check_overrides(price_overrides or {}, "price_overrides")
        self.price_overrides_path = price_overrides_path
        self.spot_prices = spot_prices
        self.price_ttl_seconds = float(price_ttl_seconds)
        self.throughput_overrides = dict(throughput_overrides or {})
        self.default_mtbf_hours = default_mtbf_hours
        if clients is None:
            from airflow_spot.backends.ec2 import default_clients

            clients = default_clients()
        self.clients = clients
        self.clock = clock
        self.wall_clock = wall_clock
        rows = read_catalog(catalog_path or CATALOG_PATH)
        self._on_demand = {(r.instance_type, r.region): r.on_demand_price for r in rows}
        self._catalog_spot = {(r.instance_type, r.region): r.spot_price for r in rows if r.spot_price is not None}
        self._mtbf = read_pool_mtbf_hours()
        self._types: dict[str, dict[str, dict]] = {}
        self._prices: dict[str, tuple[float, dict[tuple[str, str], float]]] = {}

    @staticmethod
    def _check_overrides(value: Any, name: str) -> dict[str, float]:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and "@" in k and isinstance(v, (int, float)) and v > 0 for k, v in value.items()
        ):
            raise ValueError(f"{name} must map '<instance type>@<zone>' to a positive $/h, e.g. "
                             f"{{'g5.xlarge@us-east-1a': 0.42}}, got {value!r}")
        return {k: float(v) for k, v in value.items()}

    def _overrides(self) -> dict[str, float]:
        out = dict(self.price_overrides)
        if self.price_overrides_path:
            path = Path(self.price_overrides_path)
            try:
                out.update(self._check_overrides(json.loads(path.read_text()), f"price_overrides_path {path}"))
            except FileNotFoundError:
                pass  # no what-if prices right now
            except json.JSONDecodeError as exc:
                raise MarketError(f"price_overrides_path {path} is not valid JSON: {exc}") from exc
        return out

    def _client(self, region: str):
        if self.clients.ec2 is None:
            raise MarketError("ec2 market: no EC2 client factory was handed down")
        return self.clients.ec2(region)

    def _call(self, region: str, what: str, fn):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            hint = (" (attach airflow_spot/backends/iam_policy.json to the connection's identity)"
                    if code in ("UnauthorizedOperation", "AccessDenied", "AccessDeniedException") else "")
            raise MarketError(f"ec2 market: {what} in {region} failed: {code}: {exc}{hint}") from exc
        except BotoCoreError as exc:
            raise MarketError(f"ec2 market: {what} in {region} failed: {exc}") from exc

    # ------------------------------------------------------------------ reads
    def gpu_types(self, region: str) -> dict[str, dict]:
        """``{instance type: {"gpu_name", "gpu_count", "gpu_memory_gib", "vcpus", "memory_gib"}}`` of the
        region's NVIDIA GPU instance types with a known training throughput."""
        if region not in self._types:
            def read() -> dict[str, dict]:
                out = {}
                # only types the catalog prices on demand here: one short read instead of every type
                names = sorted(t for t, r in self._on_demand if r == region)
                if not names:
                    return out
                pages = self._client(region).get_paginator("describe_instance_types").paginate(
                    Filters=[{"Name": "instance-type", "Values": names}])
                for page in pages:
                    for t in page.get("InstanceTypes", []):
                        gpus = (t.get("GpuInfo") or {}).get("Gpus") or []
                        if not gpus or gpus[0].get("Manufacturer", "NVIDIA") != "NVIDIA":
                            continue
                        archs = (t.get("ProcessorInfo") or {}).get("SupportedArchitectures") or ["x86_64"]
                        if not set(archs) & set(self.architectures):
                            continue
                        g = gpus[0]
                        memory = g.get("MemoryInfo", {}).get("SizeInMiB", 0) / 1024
                        name = gpu_model(g.get("Name", ""), memory)
                        if name not in RELATIVE_THROUGHPUT_PER_GPU and name not in self.throughput_overrides:
                            continue
                        out[t["InstanceType"]] = {
                            "gpu_name": name, "gpu_count": int(sum(x.get("Count", 0) for x in gpus)),
                            "gpu_memory_gib": round(memory, 2),
                            "vcpus": float(t.get("VCpuInfo", {}).get("DefaultVCpus", 0)),
                            "memory_gib": round(t.get("MemoryInfo", {}).get("SizeInMiB", 0) / 1024, 2),
                        }
                return out

            self._types[region] = self._call(region, "DescribeInstanceTypes", read)
        return self._types[region]

    def spot_prices_now(self, region: str) -> dict[tuple[str, str], float]:
        """``{(type, zone): $/h}`` of every GPU type of the region: the newest price per pool, cached for
        ``price_ttl_seconds`` (one read serves every request, whatever GPUs it asks for)."""
        instance_types = sorted(self.gpu_types(region))
        cached = self._prices.get(region)
        if cached is not None and self.clock() - cached[0] <= self.price_ttl_seconds:
            return cached[1]

        def read() -> dict[tuple[str, str], float]:
            newest: dict[tuple[str, str], tuple[datetime, float]] = {}
            paginator = self._client(region).get_paginator("describe_spot_price_history")
            # StartTime=now asks for the price in force now, one entry per pool
            pages = paginator.paginate(InstanceTypes=instance_types, ProductDescriptions=[PRODUCT],
                                       StartTime=datetime.now(UTC))
            for page in pages:
                for p in page.get("SpotPriceHistory", []):
                    key = (p["InstanceType"], p["AvailabilityZone"])
                    stamp = p.get("Timestamp") or datetime.min.replace(tzinfo=UTC)
                    if key not in newest or stamp > newest[key][0]:
                        newest[key] = (stamp, float(p["SpotPrice"]))
            return {k: v for k, (_, v) in newest.items()}

        prices = self._call(region, "DescribeSpotPriceHistory", read) if instance_types else {}
        self._prices[region] = (self.clock(), prices)
        return prices

    def price_changes(self, offer: Offer, start: float, end: float) -> list[tuple[float, float]]:
        """``[(epoch seconds, $/h)]``: the spot price changes of ``offer``'s pool from ``start`` to ``end``,
        and the change before ``start`` still in effect then (DescribeSpotPriceHistory returns it with
        the window's own changes). EC2 answers for the last 90 days up to now: the window is clipped to
        them (before them the price then in effect is taken for the older part)."""
        now = self.wall_clock()
        start, end = max(start, now - HISTORY_SECONDS), min(end, now)
        if end <= start:
            return []

        def read() -> list[tuple[float, float]]:
            out: list[tuple[float, float]] = []
            paginator = self._client(offer.region).get_paginator("describe_spot_price_history")
            pages = paginator.paginate(
                InstanceTypes=[offer.instance_type], ProductDescriptions=[PRODUCT], AvailabilityZone=offer.zone,
                StartTime=datetime.fromtimestamp(start, UTC), EndTime=datetime.fromtimestamp(end, UTC))
            for page in pages:
                for p in page.get("SpotPriceHistory", []):
                    if p.get("AvailabilityZone", offer.zone) == offer.zone and "Timestamp" in p:
                        out.append((p["Timestamp"].timestamp(), float(p["SpotPrice"])))
            return out

        return self._call(offer.region, "DescribeSpotPriceHistory", read)

    # ------------------------------------------------------------------ MarketSource
    def billed_price(self, offer: Offer, start: float, end: float) -> float:
        """The spot price in effect over the run, time-weighted (:func:`~airflow_spot.policy.ledger.mean_price`).

        On-demand offers, ``spot_prices="catalog"`` and pools with a what-if price (``price_overrides``) have
        no history: they pay the price they were launched at. Which pools have a what-if price is read now,
        at the end of the run (``price_overrides_path`` is re-read): a file changed during it decides."""
        if (not offer.is_spot or self.spot_prices == "catalog" or end <= start
                or f"{offer.instance_type}@{offer.zone}" in self._overrides()):
            return offer.price_per_hour
        return mean_price(self.price_changes(offer, start, end), start, end, quoted=offer.price_per_hour)

    def on_demand_price(self, instance_type: str, region: str) -> float:
        try:
            return self._on_demand[(instance_type, region)]
        except KeyError:
            raise KeyError(f"no on-demand price for {instance_type} in {region} in the bundled catalog") from None

    def preemption_rate_per_hour(self, instance_type: str, region: str, zone: str = "") -> float:
        return 1.0 / self._mtbf.get((instance_type, region), self.default_mtbf_hours)

    def offers(self, request: GpuRequest | None = None) -> list[Offer]:
        request = request or GpuRequest()
        regions = [r for r in self.regions if not request.regions or r in request.regions]
        if request.regions and not regions:
            raise ValueError(f"the request's regions {list(request.regions)} are not among the market's regions "
                             f"{list(self.regions)}; add them to market_options['regions']")
        overrides = self._overrides()
        out: list[Offer] = []
        for region in regions:
            types = {t: spec for t, spec in self.gpu_types(region).items()
                     if spec["gpu_count"] == request.count and spec["gpu_memory_gib"] >= request.min_memory_gib
                     and (t, region) in self._on_demand}
            prices = self.spot_prices_now(region) if Market.SPOT in request.markets and types else {}
            for instance_type, spec in sorted(types.items()):
                on_demand = self._on_demand[(instance_type, region)]
                common = dict(
                    instance_type=instance_type, region=region, on_demand_price_per_hour=on_demand,
                    relative_throughput=instance_throughput(spec["gpu_name"], spec["gpu_count"],
                                                            self.throughput_overrides),
                    **spec,
                )
                for (t, zone), api_price in sorted(prices.items()):
                    if t != instance_type:
                        continue
                    price = overrides.get(f"{t}@{zone}")
                    if price is None:
                        price = self._catalog_spot.get((t, region)) if self.spot_prices == "catalog" else api_price
                    if price is None:
                        continue
                    out.append(Offer(zone=zone, market=Market.SPOT, price_per_hour=price,
                                     preemption_rate_per_hour=self.preemption_rate_per_hour(t, region, zone),
                                     **common))
                out.append(Offer(zone=region, market=Market.ON_DEMAND, price_per_hour=on_demand,
                                 preemption_rate_per_hour=0.0, **common))
        return [o for o in out if request.matches(o)]
