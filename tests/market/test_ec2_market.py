"""The live EC2 market against moto's server on 127.0.0.1 (through the Airflow ``aws_default`` connection).

moto answers 0.00001 $/h for every spot pool, so prices are seeded from the bundled catalog
(``spot_prices="catalog"``) or set per pool (``price_overrides``/``price_overrides_path``).
"""
from __future__ import annotations

import json

import pytest

from airflow_spot.market.catalog import read_catalog
from airflow_spot.market.ec2 import Ec2Market, MarketError, gpu_model
from airflow_spot.policy.offer_ranking import rank_offers
from airflow_spot.policy.offers import GpuRequest, Market
from airflow_spot.testing import moto_ec2


@pytest.fixture(scope="module")
def endpoint():
    with moto_ec2.moto_ec2() as url:
        yield url


@pytest.fixture
def clients(endpoint):
    from airflow_spot.hooks.spot import SpotHook

    return SpotHook(backend="ec2").clients


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_offers_span_regions_with_gpu_specs_catalog_prices_and_risk(clients):
    market = Ec2Market(regions=["us-east-1", "us-west-2"], clients=clients, spot_prices="catalog")
    offers = market.offers(GpuRequest(count=1, min_memory_gib=20))
    assert {o.region for o in offers} == {"us-east-1", "us-west-2"}
    assert all(o.gpu_count == 1 and o.gpu_memory_gib >= 20 for o in offers)
    g5 = [o for o in offers if o.instance_type == "g5.xlarge" and o.is_spot]
    assert {o.zone for o in g5} >= {"us-east-1a", "us-west-2a"}  # zones come from the API
    catalog = {(r.instance_type, r.region): r for r in read_catalog()}
    for o in g5:
        row = catalog[("g5.xlarge", o.region)]
        assert o.gpu_name == "A10G" and 20 < o.gpu_memory_gib <= 24  # GpuInfo from DescribeInstanceTypes
        assert o.price_per_hour == row.spot_price and o.on_demand_price_per_hour == row.on_demand_price
        assert o.preemption_rate_per_hour > 0 and o.relative_throughput == 0.9
    on_demand = [o for o in offers if o.market is Market.ON_DEMAND and o.instance_type == "g5.xlarge"]
    assert sorted(o.zone for o in on_demand) == ["us-east-1", "us-west-2"]
    assert not [o for o in offers if o.instance_type.startswith("g5g")]  # Graviton: not for an x86_64 image


def test_spot_prices_are_cached_for_their_ttl(clients):
    recorder = moto_ec2.CallRecorder()
    clock = Clock()
    market = Ec2Market(regions=["us-east-1"], clients=recorder.wrap(clients), price_ttl_seconds=60, clock=clock)
    request = GpuRequest(count=1, markets=(Market.SPOT,))
    reads = []
    for advance in (0, 30, 31, 0):
        clock.now += advance
        market.offers(request if advance != 30 else GpuRequest(count=4, markets=(Market.SPOT,)))
        reads.append(recorder.calls.count("ec2:DescribeSpotPriceHistory"))
    # read at first, not again within 60 s (even for another GPU count), again after 61 s, then cached again
    assert reads[0] >= 1 and reads[1] == reads[0] and reads[2] > reads[1] and reads[3] == reads[2]
    types_reads = recorder.calls.count("ec2:DescribeInstanceTypes")
    market.offers(request)
    assert recorder.calls.count("ec2:DescribeInstanceTypes") == types_reads  # types are read once per market


def test_moved_prices_make_the_next_choice_the_then_cheapest_pool(clients, tmp_path):
    prices = tmp_path / "prices.json"
    market = Ec2Market(regions=["us-east-1"], clients=clients, price_ttl_seconds=0, spot_prices="catalog",
                       price_overrides_path=str(prices))
    request = GpuRequest(count=1, markets=(Market.SPOT,))
    assert len({o.instance_type for o in market.offers(request)}) > 5  # every other pool: catalog prices
    prices.write_text(json.dumps({"g5.xlarge@us-east-1a": 0.03, "g5.xlarge@us-east-1c": 0.05}))
    assert rank_offers(market.offers(request), now=0.0)[0].pool == "g5.xlarge@us-east-1a"
    prices.write_text(json.dumps({"g5.xlarge@us-east-1a": 0.06, "g5.xlarge@us-east-1c": 0.05}))
    assert rank_offers(market.offers(request), now=0.0)[0].pool == "g5.xlarge@us-east-1c"


def test_request_filters_models_zones_and_price_cap(clients):
    market = Ec2Market(regions=["us-east-1", "us-west-2"], clients=clients, spot_prices="catalog")
    only_l4 = market.offers(GpuRequest(count=1, names=("L4",)))
    assert only_l4 and {o.gpu_name for o in only_l4} == {"L4"}
    no_t4 = market.offers(GpuRequest(count=1, exclude_names=("T4",)))
    assert no_t4 and "T4" not in {o.gpu_name for o in no_t4}
    zoned = market.offers(GpuRequest(count=1, zones=("us-west-2b",)))
    assert {o.zone for o in zoned} == {"us-west-2b", "us-west-2"}  # the zone, and on-demand of its region
    capped = market.offers(GpuRequest(count=1, max_price_per_hour=0.5))
    assert capped and all(o.price_per_hour <= 0.5 for o in capped)
    everything = market.offers(GpuRequest(count=1))
    why = GpuRequest(count=1, names=("H100",), max_price_per_hour=0.01).describe_mismatch(everything)
    assert "gpu names" in why  # no single-H100 type here
    why = GpuRequest(count=1, max_price_per_hour=0.01).describe_mismatch(everything)
    assert "price cap" in why and "cheapest otherwise matching offer costs $" in why


def test_bad_configuration_is_refused_with_the_fix(clients, tmp_path):
    with pytest.raises(ValueError, match="unknown AWS region"):
        Ec2Market(regions=["us-east-9"], clients=clients)
    with pytest.raises(ValueError, match="'<instance type>@<zone>'"):
        Ec2Market(clients=clients, price_overrides={"g5.xlarge": 0.3})
    with pytest.raises(ValueError, match="not among the market's regions"):
        Ec2Market(regions=["us-east-1"], clients=clients).offers(GpuRequest(regions=("eu-west-1",)))
    with pytest.raises(ValueError, match="must be a list of non-empty strings"):
        GpuRequest(zones="us-east-1a")
    with pytest.raises(ValueError, match="both allowed"):
        GpuRequest(names=("T4",), exclude_names=("T4",))
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(MarketError, match="not valid JSON"):
        Ec2Market(clients=clients, price_overrides_path=str(bad)).offers(GpuRequest())


@pytest.mark.parametrize("code", ["UnauthorizedOperation", "AccessDenied"])
def test_permission_refusals_name_the_policy(clients, code):
    market = Ec2Market(regions=["us-east-1"], clients=clients)
    moto_ec2.refuse(market._client("us-east-1"), "DescribeInstanceTypes", code)
    with pytest.raises(MarketError, match=f"DescribeInstanceTypes in us-east-1 failed: {code}.*iam_policy.json"):
        market.offers(GpuRequest())


def test_gpu_models_map_onto_the_throughput_table():
    assert gpu_model("A100", 80.0) == "A100-80GB" and gpu_model("A100", 40.0) == "A100"
    assert gpu_model("V100", 32.0) == "V100-32GB" and gpu_model("L4", 22.4) == "L4"


def _pool_offer(market: Market = Market.SPOT, price: float = 0.40, zone: str = "us-east-1a"):
    from airflow_spot.policy.offers import Offer

    return Offer(instance_type="g5.xlarge", region="us-east-1", zone=zone, market=market, price_per_hour=price,
                 on_demand_price_per_hour=1.006, gpu_name="A10G", gpu_count=1, gpu_memory_gib=24.0,
                 relative_throughput=0.9, preemption_rate_per_hour=0.28)


@pytest.fixture
def stubbed():
    """A real botocore EC2 client whose answers are given (moto ignores the price history's window and
    answers one fixed price); the Stubber still checks every request against EC2's service model."""
    import boto3
    from botocore.stub import Stubber

    from airflow_spot.backends.base import Clients

    client = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    with Stubber(client) as stub:
        yield stub, Clients(ec2=lambda region: client)
        stub.assert_no_pending_responses()


def test_a_finished_spot_run_pays_the_price_in_effect_over_it_not_the_launch_price(stubbed):
    from datetime import UTC, datetime

    stub, clients = stubbed
    start, end = 1_790_000_000.0, 1_790_003_600.0

    def entry(zone, price, at):
        return {"InstanceType": "g5.xlarge", "ProductDescription": "Linux/UNIX", "AvailabilityZone": zone,
                "SpotPrice": price, "Timestamp": datetime.fromtimestamp(at, UTC)}

    stub.add_response(
        "describe_spot_price_history",
        # the change in effect at the start (a day old), one 30 minutes in, and another zone's (not this pool)
        {"SpotPriceHistory": [entry("us-east-1a", "0.80", start + 1800), entry("us-east-1b", "5.0", start + 60),
                              entry("us-east-1a", "0.20", start - 86400)]},
        {"InstanceTypes": ["g5.xlarge"], "ProductDescriptions": ["Linux/UNIX"], "AvailabilityZone": "us-east-1a",
         "StartTime": datetime.fromtimestamp(start, UTC), "EndTime": datetime.fromtimestamp(end, UTC)},
    )
    market = Ec2Market(regions=["us-east-1"], clients=clients, wall_clock=lambda: end + 60)
    # launched at a quote of $0.40/h (cached); $0.20/h was in effect at the start, $0.80/h from 30 min in
    assert market.billed_price(_pool_offer(price=0.40), start, end) == pytest.approx(0.50)


def test_the_history_window_stays_within_what_ec2_answers(stubbed):
    """EC2 answers from 90 days back up to now: an end past the clock (a clock ahead on the instance) is
    clipped to now, and a start older than 90 days to 90 days back."""
    from datetime import UTC, datetime

    stub, clients = stubbed
    now = 1_790_000_000.0
    stub.add_response("describe_spot_price_history", {"SpotPriceHistory": []}, {
        "InstanceTypes": ["g5.xlarge"], "ProductDescriptions": ["Linux/UNIX"], "AvailabilityZone": "us-east-1a",
        "StartTime": datetime.fromtimestamp(now - 90 * 86400 + 60, UTC), "EndTime": datetime.fromtimestamp(now, UTC)})
    market = Ec2Market(regions=["us-east-1"], clients=clients, wall_clock=lambda: now)
    assert market.billed_price(_pool_offer(price=0.40), now - 100 * 86400, now + 300) == 0.40  # no change known


def test_runs_without_a_price_history_pay_their_launch_price_without_asking(stubbed, tmp_path):
    _, clients = stubbed  # no response queued: any call would fail the test
    start, end = 1_790_000_000.0, 1_790_003_600.0
    market = Ec2Market(regions=["us-east-1"], clients=clients)
    assert market.billed_price(_pool_offer(Market.ON_DEMAND, price=1.006, zone="us-east-1"), start, end) == 1.006
    assert market.billed_price(_pool_offer(), start, start) == 0.40  # nothing ran
    catalog = Ec2Market(regions=["us-east-1"], clients=clients, spot_prices="catalog")
    assert catalog.billed_price(_pool_offer(price=0.39), start, end) == 0.39
    what_if = Ec2Market(regions=["us-east-1"], clients=clients, price_overrides={"g5.xlarge@us-east-1a": 0.21})
    assert what_if.billed_price(_pool_offer(price=0.21), start, end) == 0.21


def test_a_refused_history_read_says_what_is_missing_and_the_row_keeps_the_launch_price(stubbed, caplog):
    from airflow_spot.operators.accounting import billed_price

    stub, clients = stubbed
    stub.add_client_error("describe_spot_price_history", service_error_code="UnauthorizedOperation",
                          service_message="not authorized to perform ec2:DescribeSpotPriceHistory")
    market = Ec2Market(regions=["us-east-1"], clients=clients, wall_clock=lambda: 1_790_003_700.0)
    offer = _pool_offer(price=0.40)
    with pytest.raises(MarketError, match="iam_policy.json"):
        market.billed_price(offer, 1_790_000_000.0, 1_790_003_600.0)
    stub.add_client_error("describe_spot_price_history", service_error_code="UnauthorizedOperation")
    assert billed_price(market, offer, 1_790_000_000.0, 1_790_003_600.0) is None  # the caller bills the launch price
    assert "g5.xlarge@us-east-1a (spot)" in caplog.text and "billing the launch price $0.4000/h" in caplog.text


@pytest.mark.parametrize("kwargs, says", [
    ({"price_ttl_seconds": "300"}, "price_ttl_seconds must be a finite number >= 0"),
    ({"price_ttl_seconds": float("nan")}, "price_ttl_seconds must be a finite number >= 0"),
    ({"default_mtbf_hours": 0}, "default_mtbf_hours must be a finite number > 0"),
])
def test_market_numbers_that_are_no_numbers_say_so(kwargs, says):
    """A string from a JSON option (``--market-options '{"price_ttl_seconds": "300"}'``) was a bare
    TypeError from a comparison; every value now gets the same message, naming the option."""
    from airflow_spot.market.ec2 import Ec2Market

    with pytest.raises(ValueError, match=says):
        Ec2Market(clients=object(), **kwargs)
