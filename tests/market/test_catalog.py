from __future__ import annotations

from pathlib import Path

import pytest

from airflow_spot.market import MarketSource, get_market
from airflow_spot.market.catalog import CatalogError, CatalogMarket, derive_catalog, read_catalog
from airflow_spot.market.throughput import instance_throughput
from airflow_spot.policy.offers import GpuRequest, Market

SHARED_CATALOG = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "aws_gpu_catalog.csv"


def test_bundled_catalog_offers_spot_per_zone_and_one_on_demand_per_region():
    m = CatalogMarket(regions=["us-west-2"])
    assert isinstance(m, MarketSource)
    offers = m.offers(GpuRequest(names=("V100",)))
    p3 = [o for o in offers if o.instance_type == "p3.2xlarge"]
    spot = [o for o in p3 if o.market is Market.SPOT]
    od = [o for o in p3 if o.market is Market.ON_DEMAND]
    # snapshot: usw2-az1..3 have a spot price, az4 has none
    assert sorted(o.zone for o in spot) == ["usw2-az1", "usw2-az2", "usw2-az3"]
    assert len(od) == 1 and od[0].price_per_hour == 3.06
    assert all(o.on_demand_price_per_hour == 3.06 and o.relative_throughput == 1.0 for o in p3)
    assert m.on_demand_price("p3.2xlarge", "us-west-2") == 3.06
    # p3.2xlarge in us-west-2 has measured traces (us-west-2b: 4.03 h, us-west-2c: 3.11 h)
    assert m.preemption_rate_per_hour("p3.2xlarge", "us-west-2") == pytest.approx(1 / ((4.033 + 3.113) / 2))
    assert m.preemption_rate_per_hour("g5.xlarge", "us-west-2") == pytest.approx(1 / 3.6)


def test_request_filters_and_errors():
    m = get_market("local", regions=["us-east-1"])
    offers = m.offers(GpuRequest(count=1, min_memory_gib=40, markets=("spot",)))
    assert offers and all(o.gpu_memory_gib >= 40 and o.market is Market.SPOT and o.gpu_count == 1 for o in offers)
    with pytest.raises(KeyError, match="no on-demand price"):
        m.on_demand_price("p3.2xlarge", "mars-1")
    with pytest.raises(ValueError, match="known regions"):
        CatalogMarket(regions=["mars-1"])
    with pytest.raises(ValueError, match="valid markets"):
        get_market("local", kind="nope")


def test_throughput_estimates():
    assert instance_throughput("V100", 1) == 1.0
    assert instance_throughput("H100", 1) > instance_throughput("A100", 1) > instance_throughput("T4", 1)
    assert instance_throughput("V100", 8) == pytest.approx(1 + 7 * 0.9)
    assert instance_throughput("V100", 1, {"V100": 1.3}) == 1.3
    with pytest.raises(KeyError):
        instance_throughput("Trainium", 1)


def test_bad_catalog_file(tmp_path):
    bad = tmp_path / "c.csv"
    bad.write_text("instance_type,price\nx,1\n")
    with pytest.raises(CatalogError, match="lacks columns"):
        read_catalog(bad)


@pytest.mark.skipif(not SHARED_CATALOG.is_file(), reason=f"shared catalog not found at {SHARED_CATALOG}")
def test_bundled_catalog_is_what_derive_catalog_makes(tmp_path):
    out = tmp_path / "derived.csv"
    n = derive_catalog(SHARED_CATALOG, out)
    bundled = Path(__file__).resolve().parents[2] / "airflow_spot" / "market" / "data" / "aws_gpu_catalog.csv"
    assert out.read_text() == bundled.read_text()
    assert n == len(read_catalog(out))


def test_graviton_types_are_offered_only_to_arm64_images():
    """As the EC2 market: an x86_64 image (the default) cannot boot a Graviton g5g, so the local catalog
    does not rank one first either; ``architectures`` opens them."""
    from airflow_spot.market.catalog import CatalogMarket, instance_architecture

    assert [instance_architecture(t) for t in ("g5g.xlarge", "c7gd.large", "g4dn.xlarge", "g6e.xlarge", "gr6.4xlarge",
                                               "p4de.24xlarge")] == ["arm64", "arm64"] + ["x86_64"] * 4
    assert instance_architecture("p6e-gb200.36xlarge") == "arm64" and instance_architecture("p5en.48xlarge") == "x86_64"
    default = CatalogMarket().offers(GpuRequest(count=1))
    assert default and not [o for o in default if o.instance_type.startswith("g5g")]
    both = CatalogMarket(architectures=["x86_64", "arm64"]).offers(GpuRequest(count=1))
    assert {o.instance_type.split(".")[0] for o in both} - {o.instance_type.split(".")[0] for o in default} == {"g5g"}
    with pytest.raises(ValueError, match="subset of"):
        CatalogMarket(architectures=["sparc"])
