"""EC2 launch faults against moto's server on 127.0.0.1: transient errors say "try again soon" (not "fix your
configuration"), a ``RunInstances`` whose reply was lost still yields its instance, and a launch token whose
instance ended launches a fresh one instead of returning the dead one.

moto cannot produce throttling, 5xx or network errors: botocore's ``before-call`` event answers a call on the
client side (the mechanism its ``Stubber`` uses) and ``after-call`` loses a reply after the server acted, both
after botocore's own retries (they run inside the call these events wrap).
"""
from __future__ import annotations

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)
from test_ec2_backend import endpoint, hook, recorder, spec  # noqa: F401 - the module's moto fixtures

from airflow_spot.backends.base import InstanceState, LaunchError, launch_token
from airflow_spot.backends import ec2 as ec2_backend
from airflow_spot.backends.ec2 import TAG_TOKEN
from airflow_spot.testing import moto_ec2

pytest.importorskip("moto")


def answer_error(client, operation: str, code: str, status: int) -> None:
    """``operation`` answers ``code`` with HTTP ``status`` (what botocore raises once its retries ran out)."""

    def handler(model, **_):
        if model.name == operation:
            parsed = {"Error": {"Code": code, "Message": f"{code} (simulated)"},
                      "ResponseMetadata": {"HTTPStatusCode": status}}
            return AWSResponse(url="", status_code=status, headers={}, raw=None), parsed
        return None

    client.meta.events.register(f"before-call.ec2.{operation}", handler)


def fail_before(client, operation: str, exc: Exception) -> None:
    """``operation`` never reaches EC2: the network fails first."""

    def handler(model, **_):
        if model.name == operation:
            raise exc

    client.meta.events.register(f"before-call.ec2.{operation}", handler)


def lose_reply(client, operation: str, exc: Exception) -> None:
    """``operation`` reaches EC2 and takes effect, but its reply is lost: the caller gets ``exc``."""

    def handler(model, **_):
        if model.name == operation:
            raise exc

    client.meta.events.register(f"after-call.ec2.{operation}", handler)


def managed(backend) -> list:
    return [i for i in backend.list_instances() if not InstanceState(i.state).is_terminal()]


# ---------------------------------------------------------------- 1. transient errors are not config errors
@pytest.mark.parametrize("code, status", [
    ("RequestLimitExceeded", 503), ("InternalError", 500), ("Unavailable", 503), ("ServiceUnavailable", 503),
    ("SomethingNew", 502),  # any other 5xx
])
def test_transient_ec2_errors_say_try_again_soon(hook, code, status):
    backend = hook.get_backend()
    answer_error(backend.client("us-east-1"), "RunInstances", code, status)
    with pytest.raises(LaunchError) as err:
        backend.launch(spec())
    assert err.value.transient and not err.value.capacity, err.value
    assert code in str(err.value) and "Nothing to fix" in str(err.value)
    assert err.value.tried == ["g5.xlarge@us-east-1a"]
    assert managed(backend) == []


@pytest.mark.parametrize("exc", [
    EndpointConnectionError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
    ConnectTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
    ReadTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
    ConnectionClosedError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
], ids=lambda e: type(e).__name__)
def test_network_errors_are_transient(hook, exc):
    backend = hook.get_backend()
    fail_before(backend.client("us-east-1"), "RunInstances", exc)
    with pytest.raises(LaunchError) as err:
        backend.launch(spec())
    assert err.value.transient and not err.value.capacity, err.value
    assert "got no answer from EC2" in str(err.value) and "endpoint_url" in str(err.value)


def test_a_throttled_lookup_before_the_launch_is_transient_too(hook):
    backend = hook.get_backend()
    answer_error(backend.client("us-east-1"), "DescribeInstances", "RequestLimitExceeded", 503)
    with pytest.raises(LaunchError) as err:
        backend.launch(spec())
    assert err.value.transient and "DescribeInstances" in str(err.value)


@pytest.mark.parametrize("code, status, capacity, says", [
    # EC2 sends InsufficientInstanceCapacity with a 500: still "try the next offer", not transient
    ("InsufficientInstanceCapacity", 500, True, "InsufficientInstanceCapacity"),
    ("AccessDenied", 403, False, "iam_policy.json"),
    ("InvalidAMIID.NotFound", 400, False, "AMIs are regional"),
])
def test_capacity_and_configuration_errors_are_not_transient(hook, code, status, capacity, says):
    backend = hook.get_backend()
    answer_error(backend.client("us-east-1"), "RunInstances", code, status)
    with pytest.raises(LaunchError) as err:
        backend.launch(spec())
    assert err.value.capacity is capacity and not err.value.transient and says in str(err.value)


def test_missing_credentials_are_a_configuration_error(hook):
    backend = hook.get_backend()
    fail_before(backend.client("us-east-1"), "DescribeInstances", NoCredentialsError())
    with pytest.raises(LaunchError) as err:
        backend.launch(spec())
    assert not err.value.capacity and not err.value.transient and "credentials" in str(err.value)


# ---------------------------------------------------------------- 2. a RunInstances that failed but launched
@pytest.mark.parametrize("exc", [
    ReadTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
    ConnectionClosedError(endpoint_url="https://ec2.us-east-1.amazonaws.com"),
    ClientError({"Error": {"Code": "InternalError", "Message": "simulated"},
                 "ResponseMetadata": {"HTTPStatusCode": 500}}, "RunInstances"),
], ids=lambda e: type(e).__name__)
def test_a_launch_whose_reply_was_lost_returns_the_instance_it_launched(hook, exc):
    backend = hook.get_backend()
    lose_reply(backend.client("us-east-1"), "RunInstances", exc)
    info = backend.launch(spec())
    live = managed(backend)
    assert [i.instance_id for i in live] == [info.instance_id], "one instance, and the caller knows it"
    assert info.state in (InstanceState.PENDING, InstanceState.RUNNING)


def test_a_timeout_that_launched_nothing_is_transient(hook):
    backend = hook.get_backend()
    fail_before(backend.client("us-east-1"), "RunInstances", ReadTimeoutError(endpoint_url="https://ec2"))
    with pytest.raises(LaunchError) as err:
        backend.launch(spec())
    assert err.value.transient and managed(backend) == []


# ---------------------------------------------------------------- 3. a token whose instance ended
def test_a_token_whose_instance_ended_launches_a_fresh_one_and_stays_idempotent(hook):
    backend = hook.get_backend()
    token = launch_token("dag", "run", "task", "try1", "g5.xlarge@us-east-1a")
    first = backend.launch(spec(token=token))
    backend.terminate([first.instance_id])
    fresh = backend.launch(spec(token=token))
    assert fresh.instance_id != first.instance_id
    assert fresh.state in (InstanceState.PENDING, InstanceState.RUNNING)
    assert fresh.tags[TAG_TOKEN] == ec2_backend.derived_token(token, 1)
    again = backend.launch(spec(token=token))  # a redelivered call: the same fresh instance
    assert again.instance_id == fresh.instance_id
    moto_ec2.reclaim_spot_instance(fresh.instance_id)
    third = backend.launch(spec(token=token))
    assert third.instance_id not in (first.instance_id, fresh.instance_id)
    assert third.tags[TAG_TOKEN] == ec2_backend.derived_token(token, 2)
    assert [i.instance_id for i in managed(backend)] == [third.instance_id]


def test_ec2_answering_the_token_with_its_ended_instance_launches_under_the_next_token(hook):
    """Real EC2 remembers a ClientToken for at least 24 h after its instance terminated (moto ignores it):
    it answers RunInstances with that instance, or with IdempotentInstanceTerminated once describe forgot it."""
    backend = hook.get_backend()
    token = launch_token("ended")
    client = backend.client("us-east-1")
    moto_ec2.refuse(client, "RunInstances", "IdempotentInstanceTerminated",
                    when=lambda body: body.get("ClientToken") == token)

    def old_reply(model, params, **_):
        if model.name == "RunInstances" and params["body"].get("ClientToken") == ec2_backend.derived_token(token, 1):
            old = {"InstanceId": "i-0123456789abcdef0", "State": {"Name": "terminated", "Code": 48}}
            return AWSResponse(url="", status_code=200, headers={}, raw=None), {"Instances": [old]}
        return None

    client.meta.events.register("before-call.ec2.RunInstances", old_reply)
    info = backend.launch(spec(token=token))
    assert info.state in (InstanceState.PENDING, InstanceState.RUNNING)
    assert info.tags[TAG_TOKEN] == ec2_backend.derived_token(token, 2)


def test_a_token_that_keeps_ending_gives_up_on_the_pool(hook):
    backend = hook.get_backend()
    moto_ec2.refuse(backend.client("us-east-1"), "RunInstances", "IdempotentInstanceTerminated")
    with pytest.raises(LaunchError) as err:
        backend.launch(spec())
    assert err.value.capacity and not err.value.transient
    assert f"{ec2_backend.MAX_RELAUNCHES + 1} instances launched for this launch token" in str(err.value)
    assert "try the next offer" in str(err.value)
