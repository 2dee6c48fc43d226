"""The least-privilege IAM policy in the repo lists exactly the EC2 actions the provider calls.

Every call is recorded through botocore's ``before-call`` event while a whole job's life runs against moto's
server: market read, launch (with an instance profile), describe, async describe, list, terminate.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import airflow_spot.backends
from airflow_spot.backends.base import LaunchSpec, launch_token
from airflow_spot.policy.offers import GpuRequest, Market
from airflow_spot.testing import moto_ec2

POLICY = Path(airflow_spot.backends.__file__).parent / "iam_policy.json"


@pytest.fixture(scope="module")
def endpoint():
    with moto_ec2.moto_ec2() as url:
        yield url


def test_policy_lists_exactly_the_ec2_actions_called(endpoint):
    import boto3

    from airflow_spot.hooks.spot import SpotHook

    moto_ec2.reset(endpoint)  # moto's state is per process: other modules' instances and profiles are gone
    boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1").create_instance_profile(
        InstanceProfileName="spot-training")
    recorder = moto_ec2.CallRecorder()
    hook = SpotHook(backend="ec2", backend_options={"regions": ["us-east-1"], "image_id": "ami-12345678",
                                                     "instance_profile": "spot-training"},
                    market_options={"regions": ["us-east-1"], "spot_prices": "catalog"})
    hook.__dict__["clients"] = recorder.wrap(hook.clients)

    offers = hook.get_market().offers(GpuRequest(count=1, min_memory_gib=16, markets=(Market.SPOT,)))
    # subnets given as a list: the backend reads their zones (DescribeSubnets) to launch in the offer's own
    ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    vpc = ec2.create_vpc(CidrBlock="10.7.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.7.1.0/24", AvailabilityZone=offers[0].zone)["Subnet"]
    hook.backend_options = {**hook.backend_options, "subnet_ids": [subnet["SubnetId"]]}
    backend = hook.get_backend()
    info = backend.launch(LaunchSpec(offer=offers[0], job_uri="s3://b/j", idempotency_token=launch_token("iam"),
                                     tags={"airflow-spot:dag": "d", "airflow-spot:run": "r"}))
    backend.describe([info.instance_id])
    asyncio.run(backend.adescribe([info.instance_id]))
    backend.list_instances({"airflow-spot:run": "r"})
    backend.terminate([info.instance_id])

    called = moto_ec2.iam_actions(recorder.operations)
    allowed = {a for a in moto_ec2.policy_actions(str(POLICY)) if a.split(":")[0] in ("ec2", "iam")}
    assert called == allowed, (
        f"called but not allowed: {called - allowed}; allowed but never called: {allowed - called}"
    )


def test_policy_allows_every_store_call(endpoint):
    import boto3

    from airflow_spot.storage.object_store import open_store

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="iam-bucket")
    recorder = moto_ec2.CallRecorder()
    client = recorder.attach(boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1"))
    store = open_store("s3://iam-bucket/job", client=client)
    store.put_bytes("a/b.json", b"{}")
    assert store.get_bytes("a/b.json") == b"{}" and store.size("a/b.json") == 2
    assert store.list("a/") and store.delete(store.list("a/")) is None
    assert store.region() == "us-east-1"  # checkpoint_region="auto"
    called = moto_ec2.iam_actions(recorder.operations)
    allowed = {a for a in moto_ec2.policy_actions(str(POLICY)) if a.startswith("s3:")}
    assert called <= allowed, f"store calls the policy does not allow: {called - allowed}"
