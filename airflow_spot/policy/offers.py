"""Offers and GPU requests: the vocabulary shared by the market, the backends and the policies."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class Market(str, Enum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"


@dataclass(frozen=True)
class Offer:
    """One way to get an instance now: type + zone + market + price + GPU spec + interruption risk.

    ``relative_throughput`` is training steps per unit time of the whole instance relative to one V100
    (1.0); the ranking policies divide price by it to get a cost per unit of work.
    """

    instance_type: str
    region: str
    zone: str
    market: Market
    price_per_hour: float
    on_demand_price_per_hour: float
    gpu_name: str
    gpu_count: int
    gpu_memory_gib: float
    vcpus: float = 0.0
    memory_gib: float = 0.0
    relative_throughput: float = 1.0
    preemption_rate_per_hour: float = 0.0

    @property
    def pool(self) -> str:
        """A spot capacity pool: one instance type in one zone."""
        return f"{self.instance_type}@{self.zone}"

    @property
    def is_spot(self) -> bool:
        return Market(self.market) is Market.SPOT

    def to_dict(self) -> dict:
        d = asdict(self)
        d["market"] = Market(self.market).value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Offer":
        d = dict(d)
        d["market"] = Market(d["market"])
        return cls(**d)


_EXAMPLES = {"names": ["A10G", "L4"], "exclude_names": ["K80"], "regions": ["us-east-1"], "zones": ["us-east-1a"]}

#: per filter of ``GpuRequest.describe_mismatch`` that names values, what an offer has for it
_PRESENT = {
    "gpu count": lambda o: o.gpu_count,
    "gpu names": lambda o: o.gpu_name,
    "regions": lambda o: o.region,
}


def _strings(name: str, value: object) -> tuple[str, ...]:
    """A sequence-of-strings field as a tuple. A bare string is refused (``tuple("A10G")`` would be its
    letters); a set is sorted so that the request, and the DAG serialised from it, is the same at each parse."""
    rule = f"GpuRequest.{name} must be a list of non-empty strings"
    if isinstance(value, str):
        raise ValueError(f"{rule}, e.g. {[value] if value else _EXAMPLES[name]!r}, not the bare string {value!r}")
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=str)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{rule}, e.g. {_EXAMPLES[name]!r}, got {value!r}")
    return tuple(value)


#: numeric fields of GpuRequest: (must be, an example, integer only, smallest allowed, smallest excluded)
_NUMBERS = {
    "count": ("a positive integer (GPUs per instance)", "count=1", True, 1, False),
    "min_memory_gib": ("a number >= 0 (GiB of memory per GPU)", "min_memory_gib=16", False, 0, False),
    "max_price_per_hour": ("a number > 0 ($/h of the whole instance) or None for no cap",
                           "max_price_per_hour=2.5", False, 0, True),
}


def _check_number(name: str, value: object) -> None:
    """Refuse a numeric field that is not a number (a string such as ``"16"``, a bool, nan) or is out of
    range, naming the field, the value and the fix; otherwise the first comparison with an offer fails with a
    bare TypeError (``'<' not supported between instances of 'str' and 'int'``)."""
    rule, example, integer, low, exclusive = _NUMBERS[name]
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or value != value:
        got = (f"the string {value!r} (write the number without quotes)" if isinstance(value, str)
               else f"{value!r} ({type(value).__name__})")
        raise ValueError(f"GpuRequest.{name} must be {rule}, e.g. {example}, got {got}")
    if value < low or (exclusive and value == low):
        raise ValueError(f"GpuRequest.{name} must be {rule}, e.g. {example}, got {value!r}")


def zone_id_prefix(region: str) -> str:
    """The prefix of the AWS zone ids of ``region`` (``us-east-1`` -> ``use1``, ``ap-northeast-1`` -> ``apne1``)."""
    parts = region.split("-")
    words = {"northeast": "ne", "southeast": "se", "northwest": "nw", "southwest": "sw", "gov": "g"}
    return parts[0] + "".join(words.get(p, p[:1]) for p in parts[1:-1]) + parts[-1]


@dataclass(frozen=True)
class GpuRequest:
    """What a segment needs. Validated on construction so a DAG fails at parse time, not at launch.

    :param count: GPUs per instance (exact).
    :param min_memory_gib: minimum memory per GPU.
    :param names: allowed GPU names (e.g. ``("A10G", "L4")``); empty means any.
    :param max_price_per_hour: do not take offers above this price ($/h of the whole instance).
    :param regions: allowed regions; empty means any.
    :param markets: allowed markets; on-demand is allowed by default so a deadline can fall back to it.
    :param exclude_names: GPU names never to take (applied after ``names``).
    :param zones: allowed availability zones, named as the job's market names them: ids like ``use1-az1``
        for the bundled catalog (the ``local`` backend), names like ``us-east-1a`` for the ``ec2`` market;
        empty means any. On-demand offers are regional and pass when their region has an allowed zone.
    """

    count: int = 1
    min_memory_gib: float = 0.0
    names: tuple[str, ...] = ()
    max_price_per_hour: float | None = None
    regions: tuple[str, ...] = ()
    markets: tuple[Market, ...] = field(default=(Market.SPOT, Market.ON_DEMAND))
    exclude_names: tuple[str, ...] = ()
    zones: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("names", "exclude_names", "regions", "zones"):
            object.__setattr__(self, name, _strings(name, getattr(self, name)))
        _check_number("count", self.count)
        _check_number("min_memory_gib", self.min_memory_gib)
        if self.max_price_per_hour is not None:
            _check_number("max_price_per_hour", self.max_price_per_hour)
        if not isinstance(self.markets, (list, tuple, set, frozenset)):
            raise ValueError(f"GpuRequest.markets must be a list, e.g. ['spot', 'on-demand'], got {self.markets!r}")
        wrong = [m for m in self.markets if m not in {*Market, *(x.value for x in Market)}]
        if wrong:
            raise ValueError(f"GpuRequest.markets {wrong} are not markets; valid: "
                             f"{', '.join(repr(x.value) for x in Market)}")
        object.__setattr__(self, "markets", tuple(Market(m) for m in self.markets))
        if not self.markets:
            raise ValueError("GpuRequest.markets must allow at least one of 'spot', 'on-demand'")
        both = sorted(set(self.names) & set(self.exclude_names))
        if both:
            raise ValueError(f"GpuRequest: GPU names {both} are both allowed (names) and excluded (exclude_names)")
        if self.regions and self.zones:
            stray = [z for z in self.zones if not any(z.startswith(r) for r in self.regions) and "-az" not in z]
            if stray:
                raise ValueError(f"GpuRequest: zones {stray} are in none of the allowed regions {list(self.regions)}")

    def matches(self, offer: Offer) -> bool:
        return (
            offer.gpu_count == self.count
            and offer.gpu_memory_gib >= self.min_memory_gib
            and (not self.names or offer.gpu_name in self.names)
            and offer.gpu_name not in self.exclude_names
            and (self.max_price_per_hour is None or offer.price_per_hour <= self.max_price_per_hour)
            and (not self.regions or offer.region in self.regions)
            and self._zone_allowed(offer)
            and Market(offer.market) in self.markets
        )

    def _zone_allowed(self, offer: Offer) -> bool:
        if not self.zones:
            return True
        if offer.zone in self.zones:
            return True
        # on-demand offers name their region, not a zone: allowed when the request allows a zone there, by
        # its name (us-east-1a) or by its id (use1-az1, as the local catalog names zones)
        ids = zone_id_prefix(offer.region) + "-az"
        return offer.zone == offer.region and any(z.startswith(offer.region) or z.startswith(ids) for z in self.zones)

    def describe_mismatch(self, offers: list[Offer]) -> str:
        """Why none of ``offers`` matches: the first filter that removed the last candidates, for an error
        message that says which constraint to relax."""
        checks = [
            ("gpu count", lambda o: o.gpu_count == self.count, f"count={self.count}"),
            ("gpu memory", lambda o: o.gpu_memory_gib >= self.min_memory_gib, f"min_memory_gib={self.min_memory_gib}"),
            ("gpu names", lambda o: not self.names or o.gpu_name in self.names, f"names={list(self.names)}"),
            ("excluded gpus", lambda o: o.gpu_name not in self.exclude_names,
             f"exclude_names={list(self.exclude_names)}"),
            ("regions", lambda o: not self.regions or o.region in self.regions, f"regions={list(self.regions)}"),
            ("zones", self._zone_allowed, f"zones={list(self.zones)}"),
            ("markets", lambda o: Market(o.market) in self.markets, f"markets={[m.value for m in self.markets]}"),
            ("price cap", lambda o: self.max_price_per_hour is None or o.price_per_hour <= self.max_price_per_hour,
             f"max_price_per_hour={self.max_price_per_hour}"),
        ]
        left = list(offers)
        if not left:
            return "the market has no offers at all"
        for label, keep, setting in checks:
            kept = [o for o in left if keep(o)]
            if not kept:
                hint = ""
                if label == "price cap":
                    cheapest = min(o.price_per_hour for o in left)
                    hint = f"; the cheapest otherwise matching offer costs ${cheapest:.4f}/h"
                elif label in _PRESENT:  # say what the candidates do have, so the fix is a choice, not a guess
                    values = sorted({_PRESENT[label](o) for o in left})
                    more = f" and {len(values) - 20} more" if len(values) > 20 else ""
                    hint = f"; they have {label} {values[:20]}{more}"
                return f"no offer is left after the {label} filter ({setting}) out of {len(left)} candidates{hint}"
            left = kept
        return f"{len(left)} offers match"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["names"] = list(self.names)
        d["regions"] = list(self.regions)
        d["exclude_names"] = list(self.exclude_names)
        d["zones"] = list(self.zones)
        d["markets"] = [Market(m).value for m in self.markets]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "GpuRequest":
        d = dict(d)  # names, regions, exclude_names, zones: checked and made tuples in __post_init__
        markets = d.get("markets", ("spot", "on-demand"))  # checked and converted in __post_init__
        d["markets"] = markets if isinstance(markets, str) else tuple(markets)
        return cls(**d)
