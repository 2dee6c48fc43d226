"""On the ec2 backend (moto's server on 127.0.0.1, through the ``aws_default`` connection), an instance
absent from a ``DescribeInstances`` answer is not a lost attempt: EC2's describe lags ``RunInstances``
(eventual consistency), and one answer that misses an id must not restart a healthy job. Absence decides
only once it has lasted past the heartbeat window with no heartbeat in it.

The absence is real moto behaviour for an id moto never launched; the single missed answer is given on the
client side through botocore's ``before-call`` event (the trigger's own aiobotocore client, every other
call goes to moto).
"""
from __future__ import annotations

import asyncio
import time

import pytest

from airflow_spot.backends.base import Clients, LaunchSpec, launch_token
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.testing import moto_ec2
from airflow_spot.triggers.poller import active_pollers
from airflow_spot.triggers.segment import SegmentTrigger

pytest.importorskip("moto")
pytestmark = pytest.mark.timeout(180)

REGION = "us-east-1"
OPTIONS = {"regions": [REGION], "image_id": "ami-12345678"}
OFFER = Offer("g5.xlarge", REGION, "us-east-1a", Market.SPOT, 0.5, 1.006, "A10G", 1, 24.0)


@pytest.fixture(scope="module")
def endpoint():
    with moto_ec2.moto_ec2() as url:
        yield url


class OmittingClients:
    """The hook's clients, whose async ``DescribeInstances`` answers "no instances" for the first ``omit``
    calls (a describe that misses the id once); ``calls`` counts the describes, ``omitted`` the faked ones."""

    def __init__(self, clients: Clients, omit: int) -> None:
        self.inner, self.omit, self.calls, self.omitted = clients, omit, 0, 0

    def _handler(self, model, **_):
        from botocore.awsrequest import AWSResponse

        self.calls += 1
        if self.omitted < self.omit:
            self.omitted += 1
            return AWSResponse(url="", status_code=200, headers={}, raw=None), {"Reservations": []}
        return None

    def wrap(self) -> Clients:
        outer = self

        class Entered:
            def __init__(self, ctx) -> None:
                self.ctx = ctx

            async def __aenter__(self):
                client = await self.ctx.__aenter__()
                client.meta.events.register("before-call.ec2.DescribeInstances", outer._handler)
                return client

            async def __aexit__(self, *exc):
                return await self.ctx.__aexit__(*exc)

        async def ec2_async(region: str):
            return Entered(await self.inner.ec2_async(region))

        return Clients(ec2=self.inner.ec2, ec2_async=ec2_async, describe=self.inner.describe + "|omitting")


class OmittingTrigger(SegmentTrigger):
    """The real trigger on the real ec2 hook, with :class:`OmittingClients` around the hook's clients."""

    omit = 0

    def _hook(self):
        from airflow_spot.hooks.spot import SpotHook

        hook = SpotHook(backend=self.backend, backend_options=self.backend_options, aws_conn_id=self.aws_conn_id)
        self.omitting = OmittingClients(hook.clients, self.omit)
        hook.__dict__["clients"] = self.omitting.wrap()
        return hook


def trigger(tmp_path, instance_id: str, omit: int = 0, **limits) -> OmittingTrigger:
    kwargs = dict(poll_interval=0.2, startup_timeout=120.0, heartbeat_timeout=60.0, max_attempt_seconds=150.0)
    kwargs.update(limits)
    t = OmittingTrigger(job_uri=f"file://{tmp_path}/job", attempt_id="seg.try1", instance_id=instance_id,
                        requested_at=time.time(), backend="ec2", backend_options=OPTIONS,
                        aws_conn_id="aws_default", **kwargs)
    t.omit = omit
    return t


async def first_event(t: SegmentTrigger) -> dict:
    async for event in t.run():
        return event.payload


def test_an_id_moto_never_knew_is_lost_only_after_the_heartbeat_window(endpoint, tmp_path):
    moto_ec2.reset(endpoint)
    t = trigger(tmp_path, "i-0123456789abcdef0", heartbeat_timeout=2.0)
    started = time.time()
    event = asyncio.run(asyncio.wait_for(first_event(t), 120))
    waited = time.time() - started
    assert event["status"] == "lost", event
    assert "unknown to the backend for" in event["message"] and "(window 2s)" in event["message"], event
    # at least two describes answered without it, the window apart: one answer never decided
    assert waited > 2.0 and t.omitting.calls >= 2, (waited, t.omitting.calls)


def test_a_describe_that_misses_a_running_instance_once_does_not_lose_it(endpoint, tmp_path):
    moto_ec2.reset(endpoint)
    from airflow_spot.hooks.spot import SpotHook

    boto = SpotHook(backend="ec2", backend_options=OPTIONS).get_backend()
    info = boto.launch(LaunchSpec(OFFER, f"file://{tmp_path}/job", idempotency_token=launch_token(tmp_path)))
    t = trigger(tmp_path, info.instance_id, omit=1)

    async def scenario() -> dict:
        task = asyncio.create_task(first_event(t))
        deadline = time.monotonic() + 60
        # the first answer missed the instance; wait for two more rounds that saw it
        while not (getattr(t, "omitting", None) and t.omitting.omitted == 1 and t.omitting.calls >= 3):
            assert time.monotonic() < deadline, "the trigger's poller never made three describes"
            assert not task.done(), f"the trigger ended on a describe that missed the instance: {task.result()}"
            await asyncio.sleep(0.05)
        assert not task.done(), f"the trigger ended on a describe that missed the instance: {task.result()}"
        # now the cloud does say so: a spot reclaim
        await asyncio.to_thread(moto_ec2.reclaim_spot_instance, info.instance_id, REGION)
        return await asyncio.wait_for(task, 60)

    event = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert event["status"] == "preempted" and event["instance_reason"] == "preempted", event
    assert active_pollers() == []
