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

    def billed_price(self, offer: Offer, start: float, end: float) -> float:
        """The mean $/h an instance of ``offer`` running from ``start`` to ``end`` (epoch seconds) pays.

        The default is the price it was launched at: a market without a price history cannot say more.
        A market that keeps one (the live EC2 market) integrates the spot price in effect over the run.

        :raises MarketError: (or the cloud's error) when the history cannot be read; the caller then
            bills the launch price and says so.
        """
        return offer.price_per_hour

    #: the deployment's availability log (:class:`airflow_spot.storage.availability.AvailabilityLog`),
    #: attached by the caller that knows the deployment's store; None: the market reports no history
    availability_log = None

    def with_availability_log(self, log) -> MarketSource:
        """Attach the deployment's availability log (returns ``self``)."""
        self.availability_log = log
        return self

    def observations(self, now: float, since: float | None = None) -> list:
        """What the deployment observed of each spot pool and when: launch outcomes, capacity refusals and
        preemptions (:class:`airflow_spot.policy.observations.PoolEvent`) at or before ``now`` (and from
        ``since``). The default reads the attached availability log; a live market may add its own
        observations (e.g. probes) by overriding this."""
        if self.availability_log is None:
            return []
        return self.availability_log.read(since=since, until=now)


_MARKETS = ("catalog", "ec2")


def market_class(backend_name: str = "local", kind: str | None = None) -> type[MarketSource]:
    """The market class ``get_market`` builds for a backend (``kind`` as there)."""
    chosen = kind or ("ec2" if backend_name == "ec2" else "catalog")
    if chosen not in _MARKETS:
        raise ValueError(
            f"unknown market {chosen!r} for backend {backend_name!r}; valid markets: {', '.join(_MARKETS)}"
        )
    if chosen == "ec2":
        from airflow_spot.market.ec2 import Ec2Market

        return Ec2Market
    from airflow_spot.market.catalog import CatalogMarket

    return CatalogMarket


def get_market(backend_name: str = "local", kind: str | None = None, clients=None, **options) -> MarketSource:
    """The market for a backend.

    :param backend_name: the backend that will launch the offers (``local`` or ``ec2``).
    :param kind: ``catalog`` (the bundled price snapshot; default for ``local``) or ``ec2`` (live spot prices
        and instance types from the EC2 API; default for the ``ec2`` backend).
    :param clients: cloud clients from the Airflow layer (:class:`airflow_spot.backends.base.Clients`);
        the ``ec2`` market needs them (or falls back to boto3's default chain).
    :param options: keyword arguments of the market class (e.g. ``regions``, ``catalog_path``,
        ``throughput_overrides``; see :class:`~airflow_spot.market.ec2.Ec2Market` for the live market's).
    """
    cls = market_class(backend_name, kind)
    if getattr(cls, "uses_clients", False):
        return cls(clients=clients, **options)
    return cls(**options)
