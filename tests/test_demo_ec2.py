"""``airflow-spot demo --backend ec2``: refused without ``--moto`` (nothing else can play EC2 here), and the
spot prices it seeds into moto come from the bundled catalog for instance types moto's EC2 describes, with
distinct zones so a reclaimed pool's price move sends the retry elsewhere. (The full run takes ~6 min on
two busy cores: run it with ``airflow-spot demo --backend ec2 --moto --verify``.)"""
from __future__ import annotations

import subprocess
import sys

import pytest

from airflow_spot.demo_ec2 import catalog_spot_prices

pytestmark = pytest.mark.timeout(120)


def test_ec2_backend_without_moto_is_refused_with_the_fix():
    done = subprocess.run([sys.executable, "-m", "airflow_spot.cli", "demo", "--backend", "ec2"],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 2 and "add --moto" in done.stderr, done.stdout + done.stderr


def test_seeded_prices_are_the_catalogs_per_type_with_distinct_zones():
    from airflow_spot.market.catalog import read_catalog

    prices = catalog_spot_prices("us-east-1")
    rows = [r for r in read_catalog() if r.region == "us-east-1" and r.spot_price]
    assert {"g5.xlarge", "g6e.xlarge"} <= {t for t, _ in prices}
    for instance_type in ("g5.xlarge", "g6e.xlarge"):
        row = sorted(p for (t, _), p in prices.items() if t == instance_type)
        assert len(row) == len(set(row)) == 6
        cheapest_pool = min(r.spot_price for r in rows if r.instance_type == instance_type)
        assert row[0] == pytest.approx(cheapest_pool, rel=1e-3)
