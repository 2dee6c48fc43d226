"""The bundled market: AWS GPU instance types with on-demand and spot prices from a catalog snapshot.

``data/aws_gpu_catalog.csv`` is derived from ``../shared/data/aws_gpu_catalog.csv`` (SkyPilot catalog v7)
by :func:`derive_catalog` (see ``data/README.md``): NVIDIA training GPUs with an on-demand price, one row
per (instance type, zone). ``data/pool_preemptions.csv`` holds the preemption rates measured on the
spot traces (:func:`airflow_spot.market.traces.SpotTrace.mtbf_seconds`); pools without a measurement get
:data:`DEFAULT_MTBF_HOURS`.

Regenerate both with ``python -m airflow_spot.market.catalog SOURCE_CSV TRACES_DIR``.
"""
from __future__ import annotations

import ast
import csv
import logging
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from airflow_spot.market.base import MarketSource
from airflow_spot.market.throughput import RELATIVE_THROUGHPUT_PER_GPU, instance_throughput
from airflow_spot.market.traces import load_traces
from airflow_spot.policy.offers import GpuRequest, Market, Offer

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "data"
CATALOG_PATH = DATA_DIR / "aws_gpu_catalog.csv"
POOL_PREEMPTIONS_PATH = DATA_DIR / "pool_preemptions.csv"

#: mean of the four measured p3.2xlarge zones (3.0-4.3 h), used for pools nobody measured
DEFAULT_MTBF_HOURS = 3.6

CATALOG_FIELDS = (
    "instance_type", "gpu_name", "gpu_count", "gpu_memory_gib", "vcpus", "memory_gib",
    "on_demand_price", "spot_price", "region", "zone_id",
)
POOL_FIELDS = ("instance_type", "region", "zone", "mtbf_hours", "mean_up_hours", "up_fraction", "preemptions", "trace")


class CatalogError(ValueError):
    """A catalog file that cannot be used."""


@dataclass(frozen=True)
class CatalogRow:
    instance_type: str
    gpu_name: str
    gpu_count: int
    gpu_memory_gib: float
    vcpus: float
    memory_gib: float
    on_demand_price: float
    spot_price: float | None
    region: str
    zone_id: str


def read_catalog(path: str | Path = CATALOG_PATH) -> list[CatalogRow]:
    p = Path(path)
    if not p.is_file():
        raise CatalogError(f"catalog {p} does not exist")
    rows = []
    with p.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = set(CATALOG_FIELDS) - set(reader.fieldnames or ())
        if missing:
            raise CatalogError(f"catalog {p} lacks columns {sorted(missing)}; expected {list(CATALOG_FIELDS)}")
        for n, r in enumerate(reader, start=2):
            try:
                rows.append(CatalogRow(
                    instance_type=r["instance_type"], gpu_name=r["gpu_name"], gpu_count=int(r["gpu_count"]),
                    gpu_memory_gib=float(r["gpu_memory_gib"]), vcpus=float(r["vcpus"]),
                    memory_gib=float(r["memory_gib"]), on_demand_price=float(r["on_demand_price"]),
                    spot_price=float(r["spot_price"]) if r["spot_price"] else None,
                    region=r["region"], zone_id=r["zone_id"],
                ))
            except ValueError as exc:
                raise CatalogError(f"catalog {p} line {n}: {exc}") from exc
    return rows


def derive_catalog(source: str | Path, dest: str | Path = CATALOG_PATH) -> int:
    """Write the bundled subset of SkyPilot's ``vms.csv``: known training GPUs with an on-demand price,
    duplicate zone rows dropped. Returns the number of rows written."""
    seen: set[tuple[str, str]] = set()
    out: list[dict] = []
    with Path(source).open(newline="") as f:
        for r in csv.DictReader(f):
            name = r["AcceleratorName"]
            if name not in RELATIVE_THROUGHPUT_PER_GPU or not r["Price"]:
                continue
            key = (r["InstanceType"], r["AvailabilityZone"])
            if key in seen:
                continue
            seen.add(key)
            info = ast.literal_eval(r["GpuInfo"]) if r["GpuInfo"] else {}
            gpus = info.get("Gpus") or [{}]
            mem_mib = gpus[0].get("MemoryInfo", {}).get("SizeInMiB", 0)
            out.append({
                "instance_type": r["InstanceType"], "gpu_name": name,
                "gpu_count": int(float(r["AcceleratorCount"])), "gpu_memory_gib": round(mem_mib / 1024, 2),
                "vcpus": r["vCPUs"], "memory_gib": r["MemoryGiB"], "on_demand_price": r["Price"],
                "spot_price": r["SpotPrice"], "region": r["Region"], "zone_id": r["AvailabilityZone"],
            })
    out.sort(key=lambda d: (d["region"], d["instance_type"], d["zone_id"]))
    with Path(dest).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CATALOG_FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(out)
    return len(out)


def derive_pool_preemptions(traces_dir: str | Path, dest: str | Path = POOL_PREEMPTIONS_PATH) -> int:
    """Write the measured preemption figures of every preemption trace in ``traces_dir``."""
    traces = [t for t in load_traces(traces_dir) if t.instance_type]
    with Path(dest).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=POOL_FIELDS, lineterminator="\n")
        w.writeheader()
        for t in traces:
            mtbf, up = t.mtbf_seconds(), t.mean_up_seconds()
            w.writerow({
                "instance_type": t.instance_type, "region": t.region, "zone": t.zone,
                "mtbf_hours": f"{mtbf / 3600:.3f}" if mtbf else "", "mean_up_hours": f"{up / 3600:.3f}" if up else "",
                "up_fraction": f"{t.up_fraction():.4f}", "preemptions": t.preemptions(), "trace": t.name,
            })
    return len(traces)


def read_pool_mtbf_hours(path: str | Path = POOL_PREEMPTIONS_PATH) -> dict[tuple[str, str], float]:
    """(instance type, region) -> mean measured MTBF in hours (zone names of traces are per-account
    aliases, the catalog's are zone ids, so measurements are pooled per region)."""
    p = Path(path)
    if not p.is_file():
        return {}
    per: dict[tuple[str, str], list[float]] = {}
    with p.open(newline="") as f:
        for r in csv.DictReader(f):
            if r["mtbf_hours"]:
                per.setdefault((r["instance_type"], r["region"]), []).append(float(r["mtbf_hours"]))
    return {k: sum(v) / len(v) for k, v in per.items()}


def instance_architecture(instance_type: str) -> str:
    """``arm64`` for Graviton instance types, else ``x86_64``: AWS marks Graviton families with a ``g``
    among the letters after the generation (``g5g``, ``c7gd``, Grace's ``p6e-gb200``; ``g4dn``, ``g6e`` and
    ``gr6`` are x86_64)."""
    match = re.match(r"[a-z]+\d+(.*)", instance_type.split(".", 1)[0])
    return "arm64" if match and "g" in match.group(1) else "x86_64"


class CatalogMarket(MarketSource):
    """Offers from the bundled price snapshot.

    :param regions: only these regions (default: every region of the catalog).
    :param catalog_path: another catalog file with the same columns.
    :param throughput_overrides: GPU name -> relative throughput per GPU, replacing the estimates.
    :param default_mtbf_hours: MTBF of pools without a measurement.
    :param architectures: CPU architectures offered (default ``["x86_64"]``, as the EC2 market's: an x86_64
        image cannot boot a Graviton ``g5g``); add ``"arm64"`` to see them.
    """

    def __init__(
        self,
        regions: Iterable[str] | None = None,
        catalog_path: str | Path | None = None,
        throughput_overrides: dict[str, float] | None = None,
        default_mtbf_hours: float = DEFAULT_MTBF_HOURS,
        architectures: Iterable[str] = ("x86_64",),
    ) -> None:
        if default_mtbf_hours <= 0:
            raise ValueError(f"default_mtbf_hours must be positive, got {default_mtbf_hours!r}")
        self.architectures = tuple(architectures)
        if not self.architectures or not set(self.architectures) <= {"x86_64", "arm64"}:
            raise ValueError(f"architectures must be a non-empty subset of ['x86_64', 'arm64'], got {architectures!r}")
        rows = [r for r in read_catalog(catalog_path or CATALOG_PATH)
                if instance_architecture(r.instance_type) in self.architectures]
        self.regions = tuple(regions) if regions else ()
        if self.regions:
            known = {r.region for r in rows}
            unknown = sorted(set(self.regions) - known)
            if unknown:
                raise ValueError(f"regions {unknown} are not in the catalog; known regions: {', '.join(sorted(known))}")
            rows = [r for r in rows if r.region in self.regions]
        self.rows = rows
        self.throughput_overrides = dict(throughput_overrides or {})
        self.default_mtbf_hours = default_mtbf_hours
        self._mtbf = read_pool_mtbf_hours()
        self._on_demand = {(r.instance_type, r.region): r.on_demand_price for r in rows}

    def on_demand_price(self, instance_type: str, region: str) -> float:
        try:
            return self._on_demand[(instance_type, region)]
        except KeyError:
            raise KeyError(f"no on-demand price for {instance_type} in {region} in the catalog") from None

    def preemption_rate_per_hour(self, instance_type: str, region: str, zone: str = "") -> float:
        return 1.0 / self._mtbf.get((instance_type, region), self.default_mtbf_hours)

    def offers(self, request: GpuRequest | None = None) -> list[Offer]:
        request = request or GpuRequest()
        out: list[Offer] = []
        on_demand_done: set[tuple[str, str]] = set()
        for r in self.rows:
            throughput = instance_throughput(r.gpu_name, r.gpu_count, self.throughput_overrides)
            common = dict(
                instance_type=r.instance_type, region=r.region, on_demand_price_per_hour=r.on_demand_price,
                gpu_name=r.gpu_name, gpu_count=r.gpu_count, gpu_memory_gib=r.gpu_memory_gib, vcpus=r.vcpus,
                memory_gib=r.memory_gib, relative_throughput=throughput,
            )
            if r.spot_price is not None:
                out.append(Offer(zone=r.zone_id, market=Market.SPOT, price_per_hour=r.spot_price,
                                 preemption_rate_per_hour=self.preemption_rate_per_hour(r.instance_type, r.region),
                                 **common))
            if (r.instance_type, r.region) not in on_demand_done:
                on_demand_done.add((r.instance_type, r.region))
                # on-demand capacity is regional here; the zone is left to the backend
                out.append(Offer(zone=r.region, market=Market.ON_DEMAND, price_per_hour=r.on_demand_price,
                                 preemption_rate_per_hour=0.0, **common))
        return [o for o in out if request.matches(o)]

    def offers_of_every_count(self, markets: Iterable[Market] = tuple(Market)) -> list[Offer]:
        """Every offer of the catalog, whatever its GPU count (a request names one count): for error
        messages that say what the catalog does have."""
        counts = sorted({r.gpu_count for r in self.rows})
        return [o for n in counts for o in self.offers(GpuRequest(count=n, markets=tuple(markets)))]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m airflow_spot.market.catalog SOURCE_CSV PREEMPTION_TRACES_DIR", file=sys.stderr)
        return 2
    print(f"{derive_catalog(argv[0])} catalog rows -> {CATALOG_PATH}")
    print(f"{derive_pool_preemptions(argv[1])} measured pools -> {POOL_PREEMPTIONS_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
