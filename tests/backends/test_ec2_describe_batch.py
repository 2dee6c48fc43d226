"""``describe`` of more ids than EC2 takes in one filter (200 values, else ``FilterLimitExceeded``) stays
one paginated ``DescribeInstances`` per region, answers exactly the ids asked, and never sends a filter
EC2 would refuse (checked on every request through botocore's ``before-call`` event; moto itself does not
enforce the limit)."""
from __future__ import annotations

import asyncio

import pytest

from airflow_spot.backends.ec2 import MAX_FILTER_VALUES, TAG_MANAGED
from airflow_spot.testing import moto_ec2

pytest.importorskip("moto")
pytestmark = pytest.mark.timeout(300)

REGION = "us-east-1"


@pytest.fixture(scope="module")
def endpoint():
    with moto_ec2.moto_ec2() as url:
        yield url


def run(endpoint: str, n: int, managed: bool) -> list[str]:
    import boto3

    ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name=REGION)
    tags = [{"ResourceType": "instance", "Tags": [{"Key": TAG_MANAGED, "Value": "true"}]}] if managed else []
    reply = ec2.run_instances(ImageId="ami-12345678", InstanceType="g5.xlarge", MinCount=n, MaxCount=n,
                              TagSpecifications=tags)
    return [i["InstanceId"] for i in reply["Instances"]]


class FilterLimit:
    """Refuses, as EC2 does, a DescribeInstances whose filters carry more than 200 values in total."""

    def __init__(self) -> None:
        self.describes, self.values = 0, []

    def __call__(self, model, params, **_):
        from botocore.awsrequest import AWSResponse

        body = params.get("body") if isinstance(params.get("body"), dict) else {}
        count = sum(1 for k in body if k.startswith("Filter.") and ".Value." in k)
        self.describes += 1
        self.values.append(count)
        if count > MAX_FILTER_VALUES:
            parsed = {"Error": {"Code": "FilterLimitExceeded", "Message": "The maximum number of filter values "
                                "specified on a single call is 200"}, "ResponseMetadata": {"HTTPStatusCode": 400}}
            return AWSResponse(url="", status_code=400, headers={}, raw=None), parsed
        return None


@pytest.mark.parametrize("n", [5, MAX_FILTER_VALUES, MAX_FILTER_VALUES + 50])
def test_describe_of_many_ids_is_one_call_within_ec2s_filter_limit(endpoint, n):
    from airflow_spot.hooks.spot import SpotHook

    moto_ec2.reset(endpoint)
    ours = run(endpoint, n, managed=True)
    others = run(endpoint, 3, managed=True)  # another job's instances: not asked, never answered
    stranger = run(endpoint, 1, managed=False)
    asked = ours + ["i-0123456789abcdef0"]  # an id EC2 does not know: simply absent
    backend = SpotHook(backend="ec2", backend_options={"regions": [REGION]}).get_backend()
    limit = FilterLimit()
    backend.client(REGION).meta.events.register("before-call.ec2.DescribeInstances", limit)
    seen = backend.describe(asked)
    assert set(seen) == set(ours), (len(seen), set(seen) & set(others + stranger))
    assert limit.describes == 1 and max(limit.values) <= MAX_FILTER_VALUES, limit.values

    async def adescribe():
        return await backend.adescribe(asked)

    seen_async = asyncio.run(adescribe())
    assert set(seen_async) == set(ours)
    assert all(seen_async[i].state == seen[i].state for i in ours)
