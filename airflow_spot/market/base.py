"""The market interface: where offers, on-demand prices and preemption risk come from.

The bundled :class:`~airflow_spot.market.catalog.CatalogMarket` implements it from a price snapshot; an EC2
market (``describe_spot_price_history`` through the Amazon provider's ``EC2Hook``) implements the same
three methods, so the operators and the simulator need no change to use it.

Named ``MarketSource`` so it does not clash with :class:`airflow_spot.policy.offers.Market`, the enum of
purchase options (spot / on-demand).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from airflow_spot.policy.offers import GpuRequest, Offer


class MarketSource(ABC):
    """A source of offers. Implementations do I/O (files, cloud APIs); the policies stay pure."""

    @abstractmethod
    def offers(self, request: GpuRequest) -> list[Offer]:
        """Every offer matching ``request``: spot offers per zone and one on-demand offer per region and
        instance type, each carrying its on-demand price, relative throughput and preemption rate."""

    @abstractmethod
    def on_demand_price(self, instance_type: str, region: str) -> float:
        """On-demand $/h of ``instance_type`` in ``region``.

        :raises KeyError: when the market has no on-demand price for it.
        """

    @abstractmethod
    def preemption_rate_per_hour(self, instance_type: str, region: str, zone: str = "") -> float:
        """Expected spot preemptions per hour of running in the pool (a prior; jobs refine it)."""


_MARKETS = ("catalog",)


def get_market(backend_name: str = "local", kind: str | None = None, **options) -> MarketSource:
    """The market for a backend.

    :param backend_name: the backend that will launch the offers (``local`` or ``ec2``).
    :param kind: ``catalog`` (default: the bundled price snapshot; also used for ``ec2`` until a live
        EC2 price market exists).
    :param options: keyword arguments of the market class (e.g. ``regions``, ``catalog_path``,
        ``throughput_overrides``).
    """
    from airflow_spot.market.catalog import CatalogMarket

    chosen = kind or "catalog"
    if chosen not in _MARKETS:
        raise ValueError(f"unknown market {chosen!r} for backend {backend_name!r}; valid markets: {', '.join(_MARKETS)}")
    return CatalogMarket(**options)
