"""Where offers come from: the bundled AWS catalog, GPU throughput estimates, measured spot traces.

``get_market(backend_name, **options)`` returns the market the operators use; every market implements
:class:`~airflow_spot.market.base.MarketSource`.
"""
from __future__ import annotations

from airflow_spot.market.base import MarketSource, get_market

__all__ = ["MarketSource", "get_market"]
