"""The baselines' pool choice: a stated rule, never the order the zones were listed in."""
from __future__ import annotations

import math

from airflow_spot.simulate.engine import View


def pick_by_rule(view: View, pools) -> int:
    """The baselines' pool choice, independent of the order zones are listed in: the cheapest per unit
    of work, then the one up the longest (a pool up since before the traces begin counts as up the
    longest), then the pool name."""
    def key(i: int):
        p = view.pools[i]
        up = view.now - view.up_since[p.name] if p.name in view.up_since else math.inf
        return (p.offer.price_per_hour / p.offer.relative_throughput, -up if view.up[i] else math.inf, p.name)

    return min(pools, key=key)
