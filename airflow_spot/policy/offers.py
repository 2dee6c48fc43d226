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


@dataclass(frozen=True)
class GpuRequest:
    """What a segment needs. Validated on construction so a DAG fails at parse time, not at launch.

    :param count: GPUs per instance (exact).
    :param min_memory_gib: minimum memory per GPU.
    :param names: allowed GPU names (e.g. ``("A10G", "L4")``); empty means any.
    :param max_price_per_hour: do not take offers above this price.
    :param regions: allowed regions; empty means any.
    :param markets: allowed markets; on-demand is allowed by default so a deadline can fall back to it.
    """

    count: int = 1
    min_memory_gib: float = 0.0
    names: tuple[str, ...] = ()
    max_price_per_hour: float | None = None
    regions: tuple[str, ...] = ()
    markets: tuple[Market, ...] = field(default=(Market.SPOT, Market.ON_DEMAND))

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"GpuRequest.count must be a positive integer, got {self.count!r}")
        if self.min_memory_gib < 0:
            raise ValueError(f"GpuRequest.min_memory_gib must be >= 0, got {self.min_memory_gib!r}")
        if self.max_price_per_hour is not None and self.max_price_per_hour <= 0:
            raise ValueError(
                f"GpuRequest.max_price_per_hour must be positive or None, got {self.max_price_per_hour!r}"
            )
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "regions", tuple(self.regions))
        object.__setattr__(self, "markets", tuple(Market(m) for m in self.markets))
        if not self.markets:
            raise ValueError("GpuRequest.markets must allow at least one of 'spot', 'on-demand'")

    def matches(self, offer: Offer) -> bool:
        return (
            offer.gpu_count == self.count
            and offer.gpu_memory_gib >= self.min_memory_gib
            and (not self.names or offer.gpu_name in self.names)
            and (self.max_price_per_hour is None or offer.price_per_hour <= self.max_price_per_hour)
            and (not self.regions or offer.region in self.regions)
            and Market(offer.market) in self.markets
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["names"] = list(self.names)
        d["regions"] = list(self.regions)
        d["markets"] = [Market(m).value for m in self.markets]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "GpuRequest":
        d = dict(d)
        d["names"] = tuple(d.get("names", ()))
        d["regions"] = tuple(d.get("regions", ()))
        d["markets"] = tuple(Market(m) for m in d.get("markets", ("spot", "on-demand")))
        return cls(**d)
