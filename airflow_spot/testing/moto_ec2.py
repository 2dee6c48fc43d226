"""EC2 on moto's threaded server on 127.0.0.1, reached through an Airflow ``aws_default`` connection.

moto has no EC2 state machine and fixed spot prices; these helpers play the parts AWS would: a spot
reclaim (the state reason AWS gives), and single refusals (capacity, permissions) answered on the client
side through botocore's ``before-call`` event, the mechanism botocore's own ``Stubber`` uses.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator

from airflow_spot.testing.moto_s3 import moto_server


@contextlib.contextmanager
def aws_connection(endpoint_url: str, conn_id: str = "aws_default", region: str = "us-east-1") -> Iterator[None]:
    """Define the Airflow AWS connection ``conn_id`` pointing at ``endpoint_url`` (environment variable)."""
    name = f"AIRFLOW_CONN_{conn_id.upper()}"
    saved = os.environ.get(name)
    os.environ[name] = json.dumps({"conn_type": "aws", "login": "testing", "password": "testing",
                                   "extra": {"region_name": region, "endpoint_url": endpoint_url}})
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def moto_ec2(conn_id: str = "aws_default") -> Iterator[str]:
    """A moto server in this process (so tests can edit its instances) and the Airflow connection to it."""
    with moto_server() as endpoint, aws_connection(endpoint, conn_id):
        yield endpoint


def reset(endpoint_url: str) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(endpoint_url + "/moto-api/reset", method="POST"), timeout=10)


def reclaim_spot_instance(instance_id: str, region: str = "us-east-1") -> None:
    """Terminate an instance the way a spot reclaim does (state reason ``Server.SpotInstanceTermination``)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.instances import StateReason

    inst = ec2_backends[DEFAULT_ACCOUNT_ID][region].get_instance(instance_id)
    inst._state.name, inst._state.code = "terminated", 48
    inst.state_reason = StateReason("Server.SpotInstanceTermination: Spot Instance termination",
                                    "Server.SpotInstanceTermination")


@contextlib.contextmanager
def after_run_instances(callback: Callable[[dict[str, str]], None]) -> Iterator[None]:
    """Call ``callback(instance tags)`` in moto's server thread after each ``RunInstances`` has created its
    instance and before the reply goes out: the point where a caller killed mid-call leaves an instance it
    never heard of. Needs moto's server in this process; the patch is undone on exit."""
    from moto.ec2.responses.instances import InstanceResponse

    original = InstanceResponse.run_instances

    def run_instances(self):
        result = original(self)
        callback(dict(self._parse_tag_specification().get("instance", {})))
        return result

    InstanceResponse.run_instances = run_instances
    try:
        yield
    finally:
        InstanceResponse.run_instances = original


def moto_instance(instance_id: str, region: str = "us-east-1"):
    """moto's own record of an instance (user data, placement) without an API call."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends

    return ec2_backends[DEFAULT_ACCOUNT_ID][region].get_instance(instance_id)


def user_data(instance_id: str, region: str = "us-east-1") -> str:
    """The decoded user data moto keeps for an instance (what the instance would run at boot)."""
    raw = moto_instance(instance_id, region).user_data
    value = raw[0] if isinstance(raw, list) else raw
    if hasattr(value, "decode") and not isinstance(value, bytes):
        return value.decode()  # moto's Base64EncodedString
    import base64

    return base64.b64decode(value).decode()


def refuse(client, operation: str, code: str, when: Callable[[dict], bool] = lambda params: True,
           message: str = "refused by the test") -> None:
    """Make ``client`` answer ``operation`` with the error ``code`` whenever ``when(body)`` holds (``body``:
    the serialised query parameters, e.g. ``body["InstanceType"]``); other calls go to the server."""
    from botocore.awsrequest import AWSResponse

    def handler(model, params, **_):
        body = params.get("body") if isinstance(params.get("body"), dict) else {}
        if model.name != operation or not when(body):
            return None
        response = AWSResponse(url="", status_code=400, headers={}, raw=None)
        parsed = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": 400}}
        return response, parsed

    client.meta.events.register(f"before-call.ec2.{operation}", handler)


def lag_describe(client) -> None:
    """Make ``client``'s ``DescribeInstances`` answer "no instances", as EC2 may for a moment after
    ``RunInstances`` (eventual consistency)."""
    from botocore.awsrequest import AWSResponse

    def handler(model, **_):
        return AWSResponse(url="", status_code=200, headers={}, raw=None), {"Reservations": []}

    client.meta.events.register("before-call.ec2.DescribeInstances", handler)


class CallRecorder:
    """Records ``service:Operation`` of every call made by the clients it is attached to."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def attach(self, client):
        service = client.meta.service_model.service_name

        def handler(model, **_):
            self.calls.append(f"{service}:{model.name}")

        client.meta.events.register("before-call.*.*", handler)
        return client

    def wrap(self, clients):
        """The same :class:`~airflow_spot.backends.base.Clients`, recording every call of every client made."""
        from airflow_spot.backends.base import Clients

        recorder = self

        class _Entered:
            def __init__(self, ctx) -> None:
                self.ctx = ctx

            async def __aenter__(self):
                return recorder.attach(await self.ctx.__aenter__())

            async def __aexit__(self, *exc):
                return await self.ctx.__aexit__(*exc)

        async def ec2_async(region: str):
            return _Entered(await clients.ec2_async(region))

        return Clients(ec2=lambda region: self.attach(clients.ec2(region)),
                       ec2_async=ec2_async if clients.ec2_async else None, describe=clients.describe)

    @property
    def operations(self) -> set[str]:
        return set(self.calls)


#: IAM actions an API operation needs (beyond its own name, e.g. tags given at launch need CreateTags)
_IMPLIED = {
    "ec2:RunInstances": {"ec2:RunInstances", "ec2:CreateTags", "iam:PassRole"},
    "s3:CreateMultipartUpload": {"s3:PutObject"}, "s3:UploadPart": {"s3:PutObject"},
    "s3:CompleteMultipartUpload": {"s3:PutObject"}, "s3:HeadObject": {"s3:GetObject"},
    "s3:ListObjectsV2": {"s3:ListBucket"}, "s3:DeleteObjects": {"s3:DeleteObject"},
}


def iam_actions(operations: set[str]) -> set[str]:
    """The IAM actions that allow these ``service:Operation`` calls."""
    out: set[str] = set()
    for op in operations:
        out |= _IMPLIED.get(op, {op})
    return out


def policy_actions(path: str) -> set[str]:
    """Every action an IAM policy document allows."""
    with open(path) as f:
        doc = json.load(f)
    out: set[str] = set()
    for statement in doc["Statement"]:
        actions = statement["Action"]
        out |= {actions} if isinstance(actions, str) else set(actions)
    return out
