"""Spot traces: load and validate the measured preemption/availability files, and summarise them.

Format (skypilot-org/spot-traces, data of the NSDI'24 paper "Can't Be Late"):
``{"metadata": {"gap_seconds": G}, "data": [v0, v1, ...]}``, one value per tick of ``G`` seconds, ``1`` = a
spot instance of the pool is running (preemption traces) or could be launched (availability traces),
``0`` = preempted / not available. A preemption is a ``1 -> 0`` step. Note that the paper authors'
own simulator uses the opposite encoding; these files use 1 = up. Multi-node availability traces
(``availability/4-node``, ``16-node``) hold counts ``0..N``: how many instances of the pool could be
launched; a gang job of ``n`` instances is up when the count is ``>= n`` (:meth:`SpotTrace.up_for`).

The file name carries the pool: ``<zone>_<gpu>_<count>.json`` (e.g. ``us-west-2b_v100_1.json``), or
``<zone>_<machine type>.json`` for the GCP traces of the same repository (``us-central1-a_c3-88.json``).

The layout of the SkyPilot spot simulator (the "Can't Be Late" simulator and the SkyNomad artifact's
``data/converted_multi_region_aligned*``) is read too: a folder per pool, ``<zone>_<gpu>_<count>/``,
holding ``full.json`` (the whole trace) and numbered windows of it (``0.json``, ...). Its values are in
the *preempted* convention, ``1`` = preempted or unavailable, the opposite of spot-traces; a file of that
layout, or one whose metadata has ``price_info`` (which that simulator requires), is read that way and
flipped. Its ``price_info`` (``price``, ``on_demand_price``, $/h) prices the pool; where a per-tick
``prices`` series varies, the replay offers and bills the price in effect at each tick
(:attr:`SpotTrace.prices`; :attr:`SpotTrace.spot_price` is then its mean).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

#: a trace shorter than this is most likely a truncated download, not a measurement
MIN_TICKS = 2

#: AWS region names (``us-west-2``, ``us-gov-west-1``); a zone's is the region and one letter
_AWS_REGION_PATTERN = r"[a-z]{2}(?:-[a-z]+)+-\d"
_AWS_ZONE_PATTERN = rf"{_AWS_REGION_PATTERN}[a-z]"
#: GCP zone names are the region, a dash and one letter (``us-central1-a``); the rest of the name is the
#: machine type (``c3-88``), with no GPU count, or (the SkyPilot simulator's H100 traces) ``<gpu>_<count>``
_GCP_REGION_PATTERN = r"[a-z]+-[a-z]+\d+"
_GCP_ZONE_PATTERN = rf"(?P<region>{_GCP_REGION_PATTERN})-[a-z]"
_NAME = re.compile(rf"^(?P<zone>{_AWS_ZONE_PATTERN}|{_GCP_REGION_PATTERN}-[a-z])_(?P<gpu>[a-z0-9]+)_(?P<count>\d+)$")
_GCP_NAME = re.compile(rf"^(?P<zone>{_GCP_ZONE_PATTERN})_(?P<machine>[a-z0-9-]+)$")
_AWS_ZONE = re.compile(_AWS_ZONE_PATTERN)
_GCP_ZONE = re.compile(_GCP_ZONE_PATTERN)
#: the SkyPilot simulator's files inside a pool folder: the whole trace, or one numbered window of it
_SIM_FILE = re.compile(r"^(?:full|\d+)\.json$")
SIM_FULL_TRACE = "full.json"

#: GPU name in trace file names -> instance type measured (AWS, one node)
TRACE_INSTANCE_TYPES: dict[tuple[str, int], str] = {
    ("v100", 1): "p3.2xlarge",
    ("v100", 4): "p3.8xlarge",
    ("v100", 8): "p3.16xlarge",
    ("k80", 1): "p2.xlarge",
    ("k80", 8): "p2.8xlarge",
}


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and what to fix."""


@dataclass(frozen=True)
class SpotTrace:
    """One pool's measured up/down sequence."""

    name: str
    zone: str
    gap_seconds: float
    values: tuple[int, ...]
    gpu: str = ""
    gpu_count: int = 0
    #: $/h of the pool, when the file prices it (the SkyPilot simulator's ``metadata.price_info``)
    spot_price: float | None = None
    on_demand_price: float | None = None
    #: (lowest, highest) of a per-tick spot price series that varies; else None
    spot_price_range: tuple[float, float] | None = None
    #: the spot $/h at each tick, when the file's series varies (``spot_price`` is then its mean); else None
    prices: tuple[float, ...] | None = None
    #: values were stored 1 = preempted (the SkyPilot simulator) and flipped on load
    flipped: bool = False

    @property
    def region(self) -> str:
        return zone_region(self.zone)

    @property
    def instance_type(self) -> str | None:
        return TRACE_INSTANCE_TYPES.get((self.gpu, self.gpu_count))

    @property
    def duration_seconds(self) -> float:
        return len(self.values) * self.gap_seconds

    @property
    def max_count(self) -> int:
        """The largest count in the trace (1 for a one-node trace)."""
        return max(self.values)

    def up_for(self, nodes: int = 1) -> tuple[bool, ...]:
        """Per tick: whether ``nodes`` instances could run (the count is at least ``nodes``)."""
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes!r}")
        return tuple(v >= nodes for v in self.values)

    def preemptions(self) -> int:
        v = self.values
        return sum(1 for a, b in zip(v, v[1:], strict=False) if a >= 1 and b == 0)

    def up_fraction(self) -> float:
        return sum(1 for v in self.values if v >= 1) / len(self.values)

    def mtbf_seconds(self) -> float | None:
        """Mean time between preemptions over the whole trace (what the data README quotes), or None
        when the trace holds no preemption."""
        n = self.preemptions()
        return self.duration_seconds / n if n else None

    def mean_up_seconds(self) -> float | None:
        """Mean length of an up period that ended in a preemption (how long an instance survives)."""
        runs, run = [], 0
        for a, b in zip(self.values, self.values[1:], strict=False):
            if a >= 1:
                run += 1
                if b == 0:
                    runs.append(run)
                    run = 0
        return sum(runs) * self.gap_seconds / len(runs) if runs else None

    def up_at(self, seconds: float) -> bool:
        """Whether the pool is up at ``seconds`` from the trace's start (False past its end)."""
        i = int(seconds // self.gap_seconds)
        return 0 <= i < len(self.values) and self.values[i] >= 1


def zone_region(zone: str) -> str:
    """``us-west-2b`` -> ``us-west-2`` (AWS zone names are the region plus one letter); ``us-central1-a`` ->
    ``us-central1`` (GCP: the region, a dash and one letter)."""
    if _AWS_ZONE.fullmatch(zone):
        return zone[:-1]
    m = _GCP_ZONE.fullmatch(zone)
    if m:
        return m.group("region")
    raise TraceError(f"{zone!r} is not a zone name like 'us-west-2b' (AWS) or 'us-central1-a' (GCP)")


def check_region(region: str) -> str:
    """``region`` when it names a region (``us-west-2``, ``us-central1``), else a TraceError saying what one
    looks like: a store region that names no region would price every instance as remote, silently."""
    if re.fullmatch(_AWS_REGION_PATTERN, region) or re.fullmatch(_GCP_REGION_PATTERN, region):
        return region
    raise TraceError(f"{region!r} is not a region name like 'us-west-2' (AWS) or 'us-central1' (GCP)")


def trace_node_count(path: str | Path) -> int:
    """How many instances a trace file counts: ``N`` when it sits under an ``N-node`` folder (the layout of
    skypilot-org/spot-traces), else 1. A one-node trace holds 0/1 only, so a stray ``2`` there is an error,
    not an "up"."""
    for part in reversed(Path(path).parts[:-1]):
        m = re.fullmatch(r"(\d+)-node", part)
        if m:
            return max(1, int(m.group(1)))
    return 1


def sim_layout_pool(path: str | Path) -> str | None:
    """The pool name when ``path`` is a file of the SkyPilot simulator's layout
    (``<zone>_<gpu>_<count>/full.json`` or ``.../<N>.json``), else None."""
    p = Path(path)
    stem = p.parent.name
    if _SIM_FILE.match(p.name) and (_NAME.match(stem) or _GCP_NAME.match(stem)):
        return stem
    return None


def _price(meta: dict, key: str, name: str) -> float | None:
    info = meta.get("price_info")
    if not isinstance(info, dict) or info.get(key) is None:
        return None
    v = info[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise TraceError(f"{name}: metadata.price_info.{key} must be a positive $/h, got {v!r}")
    return float(v)


def _tick_prices(raw: dict, n: int, name: str) -> tuple[float, tuple[float, ...] | None] | None:
    """The mean of a per-tick spot price series, and the series when it varies (None: no series)."""
    series = raw.get("prices")
    if series is None:
        return None
    if (not isinstance(series, list) or len(series) != n
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in series)):
        raise TraceError(f"{name}: 'prices' must be one positive $/h per value of 'data' ({n})")
    varies = min(series) < max(series)
    return sum(series) / n, (tuple(float(v) for v in series) if varies else None)


def parse_trace(raw: object, name: str = "<trace>", zone: str | None = None,
                max_count: int | None = None, preempted: bool | None = None) -> SpotTrace:
    """Validate a decoded trace document; raise :class:`TraceError` saying what is wrong. Values are 0/1, or
    whole counts up to ``max_count`` (default: the ``N`` of an ``N-node`` folder in ``name``, else 1).
    ``preempted``: the values are 1 = preempted (the SkyPilot simulator's convention) and are flipped;
    None decides by the file: its layout (:func:`sim_layout_pool`) or a ``metadata.price_info``."""
    if max_count is None:
        max_count = trace_node_count(name)
    if not isinstance(raw, dict):
        raise TraceError(f"{name}: expected a JSON object with 'metadata' and 'data', got {type(raw).__name__}")
    meta, data = raw.get("metadata"), raw.get("data")
    if not isinstance(meta, dict) or "gap_seconds" not in meta:
        raise TraceError(f"{name}: missing metadata.gap_seconds (seconds between two values)")
    gap = meta["gap_seconds"]
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 < gap < math.inf:
        raise TraceError(f"{name}: metadata.gap_seconds must be a finite positive number, got {gap!r}")
    if not isinstance(data, list):
        raise TraceError(f"{name}: 'data' must be a list of 0/1 values (or instance counts), got {type(data).__name__}")
    if len(data) < MIN_TICKS:
        raise TraceError(f"{name}: 'data' holds {len(data)} values; a trace needs at least {MIN_TICKS}")
    sim_pool = sim_layout_pool(name)
    if preempted is None:
        preempted = sim_pool is not None or "price_info" in meta
    if preempted:
        max_count = 1  # the simulator's traces are 0/1 (a gang's threshold is applied when they are made)
    for i, v in enumerate(data):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v) \
                or not 0 <= v <= max_count:
            if preempted:
                raise TraceError(f"{name}: data[{i}] is {v!r}; values of the SkyPilot simulator's traces must be "
                                 "1 (preempted) or 0 (available)")
            if max_count == 1:
                raise TraceError(
                    f"{name}: data[{i}] is {v!r}; values must be 0 (down) or 1 (up) (a multi-node availability "
                    "trace of instance counts goes under an 'N-node' folder, e.g. availability/4-node/)"
                )
            raise TraceError(
                f"{name}: data[{i}] is {v!r}; values of a {max_count}-node trace must be a whole count of "
                f"instances from 0 to {max_count}"
            )
    stem = sim_pool or Path(name).stem
    m = _NAME.match(stem) or _GCP_NAME.match(stem)
    parts = m.groupdict() if m else {}
    gpu, count = parts.get("gpu", ""), int(parts.get("count", 0))
    z = zone or parts.get("zone", "") or (meta.get("zone") if isinstance(meta.get("zone"), str) else "")
    if not z:
        raise TraceError(
            f"{name}: cannot tell the zone; name the file '<zone>_<gpu>_<count>.json' (AWS) or "
            "'<zone>_<machine type>.json' (GCP), or pass zone="
        )
    zone_region(z)
    spot, od = _price(meta, "price", name), _price(meta, "on_demand_price", name)
    series = None
    if preempted:
        tick = _tick_prices(raw, len(data), name)
        if tick is not None:
            spot, series = tick
    values = tuple((1 - int(v)) if preempted else int(v) for v in data)
    return SpotTrace(name=stem, zone=z, gap_seconds=float(gap), values=values, gpu=gpu, gpu_count=count,
                     spot_price=spot, on_demand_price=od, flipped=bool(preempted), prices=series,
                     spot_price_range=(min(series), max(series)) if series else None)


def load_trace(path: str | Path, zone: str | None = None) -> SpotTrace:
    """Read and validate one trace file."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file {p} does not exist")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise TraceError(f"{p}: not valid JSON ({exc})") from exc
    return parse_trace(raw, name=str(p), zone=zone)


def _trace_files(path: Path) -> list[Path]:
    """A file as given; a directory's ``*.json``, or, in the SkyPilot simulator's layout, its pool folders'
    ``full.json`` (not their numbered windows, which are samples of it)."""
    if not path.is_dir():
        return [path]
    files = sorted(path.glob("*.json")) or sorted(path.glob(f"*/{SIM_FULL_TRACE}"))
    if not files:
        raise TraceError(f"no *.json trace file in {path} (nor pool folders holding {SIM_FULL_TRACE}, "
                         "the SkyPilot simulator's layout)")
    return files


def load_traces(paths: list[str | Path] | str | Path) -> list[SpotTrace]:
    """Load trace files and directories (see :func:`_trace_files`) as one set: one tick length, one pool
    per zone."""
    given = [paths] if isinstance(paths, (str, Path)) else list(paths)
    # a file named twice (a folder and one of its files, overlapping globs) is one pool, read once
    files = list({f.resolve(): f for p in given for f in _trace_files(Path(p))}.values())
    traces = [load_trace(f) for f in files]
    gaps = {t.gap_seconds for t in traces}
    if len(gaps) > 1:
        raise TraceError(f"traces have different gap_seconds {sorted(gaps)}; replay needs one tick length")
    zones = [t.zone for t in traces]
    if len(set(zones)) != len(zones):
        raise TraceError(_one_pool_per_zone_message(traces, files))
    return traces


def _one_pool_per_zone_message(traces: list[SpotTrace], files: list[Path]) -> str:
    """Say which zones hold several pools (e.g. ``availability/1-node/aws-10-26-2022``: K80 and V100, one
    and eight GPUs, per zone) and how to pick one kind."""
    by_zone: dict[str, list[tuple[str, Path]]] = {}
    for t, f in zip(traces, files, strict=True):
        by_zone.setdefault(t.zone, []).append((t.name[len(t.zone) + 1:] or t.name, f))
    listed = "; ".join(f"{z}: {', '.join(k for k, _ in kinds)}" for z, kinds in sorted(by_zone.items()))
    common = set.intersection(*({k for k, _ in kinds} for kinds in by_zone.values()))
    hint = ""
    if common:
        kind = sorted(common)[0]
        example = ",".join(str(f) for kinds in by_zone.values() for k, f in kinds if k == kind)
        hint = f", e.g. --traces {example}"
    return (f"several traces for one zone ({listed}); a replay takes one pool per zone: pass the files of one "
            f"kind{hint}")


def read_notes(traces: list[SpotTrace], tick_prices: bool = True, own_prices: bool = True) -> list[str]:
    """What a user should know about how the traces were read: flipped values, their own prices, prices
    that vary over time and how they are replayed (``tick_prices`` False: at their mean; printed by
    ``simulate`` and the benchmark). ``own_prices`` False: the prices were given instead of the files',
    so nothing is said of the files' own."""
    notes = []
    flipped = [t.zone for t in traces if t.flipped]
    if flipped:
        notes.append(f"traces of {', '.join(flipped)} are in the SkyPilot simulator's convention (1 = preempted) "
                     "and were read flipped")
    if not own_prices:
        return notes
    priced = [t for t in traces if t.spot_price is not None and t.on_demand_price is not None]
    if priced:
        notes.append("prices from the trace files ($/h spot / on-demand): "
                     + ", ".join(f"{t.zone} {t.spot_price:.4g} / {t.on_demand_price:.4g}" for t in priced))
    for t in traces:
        if t.spot_price_range is not None:
            lo, hi = t.spot_price_range
            how = "offers and charges the price of each tick" if tick_prices else "charges its mean"
            notes.append(f"{t.zone}: the spot price varies over the trace (${lo:.4g}-${hi:.4g}/h, mean "
                         f"${t.spot_price:.4g}/h); the replay {how}")
    return notes


def check_node_count(traces: list[SpotTrace], nodes: int) -> None:
    """Raise :class:`TraceError` unless every trace can show ``nodes`` instances up (a gang replay)."""
    # a zone never up in the window (all 0) is a real observation: a pool that is always down
    short = [t.zone for t in traces if 0 < t.max_count < nodes]
    if short:
        raise TraceError(f"--nodes {nodes}: the traces of {short} never show that many instances up "
                         "(a 1-node trace holds 0/1); use multi-node availability traces or fewer nodes")


def default_traces_dir() -> Path:
    """The spot traces bundled with the package (a copy of ``../shared/data/spot-traces``, see
    ``market/data/README.md``), so ``airflow-spot simulate`` replays real traces wherever it is installed."""
    return Path(__file__).resolve().parent / "data" / "spot-traces"


PREEMPTION_TRACES_SUBDIR = Path("preemption") / "1-node" / "aws-04-22-2023"
