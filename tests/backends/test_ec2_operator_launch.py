"""The segment operator's launch on the ec2 backend (moto server): the market's ranking, falling down it on
capacity refusals, a config error failing at once, and a repeated try reusing its instance (ClientToken).

Refusals are answered on the client side through botocore's ``before-call`` event (moto never refuses).
"""
from __future__ import annotations

import time
from datetime import datetime
from types import SimpleNamespace

import pytest

from airflow_spot.operators import planning
from airflow_spot.policy.offers import GpuRequest, Market
from airflow_spot.storage.object_store import open_store
from airflow_spot.testing import moto_ec2

pytest.importorskip("moto")

#: the two cheapest pools, whatever the catalog says; everything else keeps catalog prices
PRICES = {"g5.xlarge@us-east-1a": 0.03, "g5.xlarge@us-east-1b": 0.04}


@pytest.fixture(scope="module")
def endpoint():
    with moto_ec2.moto_ec2() as url:
        yield url


@pytest.fixture
def operator(endpoint, tmp_path):
    from airflow.sdk import DAG

    from airflow_spot.operators.segment import SpotSegmentOperator

    moto_ec2.reset(endpoint)
    with DAG("ec2_launch", schedule=None, start_date=datetime(2024, 1, 1)):
        op = SpotSegmentOperator(
            task_id="segment_000", command=["python", "train.py"], checkpoint_uri=f"file://{tmp_path}/job",
            start_step=0, end_step=10, total_steps=10, gpus=GpuRequest(count=1, markets=(Market.SPOT,)),
            backend="ec2", backend_options={"regions": ["us-east-1"], "image_id": "ami-12345678"},
            market_options={"regions": ["us-east-1"], "spot_prices": "catalog", "price_overrides": PRICES},
        )
    return op


def launch(op, tmp_path, try_number: int = 1):
    store = open_store(f"file://{tmp_path}/job")
    now = time.time()
    plan = planning.plan(op.hook.get_market(), op.gpus, now=now, done_steps=0, total_steps=10, job_started_at=now,
                         deadline=None, ledger_rows=[])
    context = {"ti": SimpleNamespace(try_number=try_number), "run_id": "manual__1"}
    return plan, op._get_instance(context, store, plan, [])


def test_launch_takes_the_cheapest_pool_and_a_repeated_try_gets_the_same_instance(operator, tmp_path):
    plan, (info, reused) = launch(operator, tmp_path)
    assert plan.ranked[0].pool == "g5.xlarge@us-east-1a" and not reused
    seen = operator.hook.get_backend().describe([info.instance_id])[info.instance_id]
    assert seen.offer.pool == "g5.xlarge@us-east-1a" and seen.tags["airflow-spot:task"] == "segment_000"
    assert seen.tags["airflow-spot:dag"] == "ec2_launch" and seen.tags["airflow-spot:run"] == "manual__1"
    _, (again, _) = launch(operator, tmp_path)  # a worker that died after the launch and tries again
    assert again.instance_id == info.instance_id
    assert len(operator.hook.get_backend().list_instances({"airflow-spot:run": "manual__1"})) == 1


def test_capacity_refused_in_the_best_pool_falls_to_the_next(operator, tmp_path):
    client = operator.hook.get_backend().client("us-east-1")
    moto_ec2.refuse(client, "RunInstances", "InsufficientInstanceCapacity",
                    when=lambda body: body.get("Placement.AvailabilityZone") == "us-east-1a")
    _, (info, _) = launch(operator, tmp_path)
    assert operator.hook.get_backend().describe([info.instance_id])[info.instance_id].offer.pool == (
        "g5.xlarge@us-east-1b")


def test_capacity_refused_everywhere_is_a_retryable_preemption(operator, tmp_path):
    from airflow_spot.operators.segment import SegmentPreempted

    moto_ec2.refuse(operator.hook.get_backend().client("us-east-1"), "RunInstances", "InsufficientInstanceCapacity")
    with pytest.raises(SegmentPreempted, match="no offer could be launched now"):
        launch(operator, tmp_path)


@pytest.mark.parametrize("code", ["InvalidAMIID.NotFound", "UnauthorizedOperation"])
def test_configuration_errors_fail_the_task_at_the_first_offer(operator, tmp_path, code):
    from airflow.sdk.exceptions import AirflowFailException

    moto_ec2.refuse(operator.hook.get_backend().client("us-east-1"), "RunInstances", code)
    with pytest.raises(AirflowFailException, match=code):
        launch(operator, tmp_path)


def test_a_request_over_the_price_cap_names_the_problem(operator):
    market = operator.hook.get_market()
    request = GpuRequest(count=1, max_price_per_hour=0.001, markets=(Market.SPOT,))
    with pytest.raises(planning.NoOfferError):
        now = time.time()
        planning.plan(market, request, now=now, done_steps=0, total_steps=10, job_started_at=now, deadline=None,
                      ledger_rows=[])
    assert "price cap" in request.describe_mismatch(market.offers(GpuRequest(count=1, markets=(Market.SPOT,))))


def test_the_price_cap_travels_with_the_launch_and_a_pool_now_above_it_falls_to_the_next(endpoint, tmp_path):
    """With ``max_price_per_hour`` the spot launch asks EC2 for that MaxPrice, so the running instance never
    pays more (EC2 interrupts it, with its notice, when the pool's price passes the cap). A pool whose price
    rose past the cap since the market's quote is refused (SpotMaxPriceTooLow; moto prices nothing, so the
    refusal is played here as EC2 answers it) and the launch takes the next pool."""
    from airflow.sdk import DAG

    from airflow_spot.operators.segment import SpotSegmentOperator

    moto_ec2.reset(endpoint)
    with DAG("ec2_cap", schedule=None, start_date=datetime(2024, 1, 1)):
        op = SpotSegmentOperator(
            task_id="segment_000", command=["python", "train.py"], checkpoint_uri=f"file://{tmp_path}/job",
            start_step=0, end_step=10, total_steps=10,
            gpus=GpuRequest(count=1, markets=(Market.SPOT,), max_price_per_hour=0.045),
            backend="ec2", backend_options={"regions": ["us-east-1"], "image_id": "ami-12345678"},
            market_options={"regions": ["us-east-1"], "spot_prices": "catalog", "price_overrides": PRICES},
        )
    asked = []

    def now_above_cap(body):
        asked.append((body.get("Placement.AvailabilityZone"), body.get("InstanceMarketOptions.SpotOptions.MaxPrice")))
        return body.get("Placement.AvailabilityZone") == "us-east-1a"  # its price is 0.05 now: over 0.045

    moto_ec2.refuse(op.hook.get_backend().client("us-east-1"), "RunInstances", "SpotMaxPriceTooLow",
                    when=now_above_cap)
    _, (info, _) = launch(op, tmp_path)
    assert asked == [("us-east-1a", "0.045000"), ("us-east-1b", "0.045000")]
    assert op.hook.get_backend().describe([info.instance_id])[info.instance_id].offer.pool == "g5.xlarge@us-east-1b"
