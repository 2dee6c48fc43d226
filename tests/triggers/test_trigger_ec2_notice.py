"""The spot interruption notice is visible from the Airflow side on the ec2 backend.

On EC2 only the instance can read its notice (IMDS ``spot/instance-action``), so the training process
reports it in its heartbeat (``notice_at``); the trigger logs it, reads the status often while the
emergency save runs (not once per poll interval), and its event carries ``notice_at``, which the ledger
row keeps with the steps the attempt kept.

Real pieces: moto's server on 127.0.0.1 through the ``aws_default`` connection, the ec2 backend, the data
plane playing the instance (agent from the user data, a local IMDSv2), ``SpotSession`` in the example
torch script, the trigger on the shared poller.
"""
from __future__ import annotations

import asyncio
import sys
import time

import pytest

from airflow_spot.backends.base import InstanceState, LaunchSpec, TerminationReason, launch_token
from airflow_spot.operators.accounting import record_attempt
from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout, Outcome, SegmentRequest
from airflow_spot.testing import moto_ec2
from airflow_spot.testing.ec2_dataplane import Ec2DataPlane
from airflow_spot.testing.polling import wait_for
from airflow_spot.triggers.segment import SegmentTrigger

pytest.importorskip("moto")
pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)

REGION = "us-east-1"
OFFER = Offer("g5.xlarge", REGION, "us-east-1b", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
#: long enough that the attempt's own status, not the reclaim, must end the wait
NOTICE_WINDOW = 90.0


def test_notice_through_imds_reaches_the_event_and_the_ledger(tmp_path):
    from airflow_spot.hooks.spot import SpotHook

    uri = f"file://{tmp_path}/job"
    options = {"regions": [REGION], "image_id": "ami-12345678", "python": sys.executable}
    command = [sys.executable, "-m", "airflow_spot.examples.train_tiny", "--total-steps", "100000",
               "--step-sleep", "0.02", "--final-weights", str(tmp_path / "w.pt")]
    with moto_ec2.moto_ec2(), Ec2DataPlane(tmp_path / "plane", region=REGION, notice_window_seconds=NOTICE_WINDOW,
                                            env={"SPOT_NOTICE_POLL_SECONDS": "0.2"}) as plane:
        backend = SpotHook(backend="ec2", backend_options=options).get_backend()
        info = backend.launch(LaunchSpec(OFFER, uri, idempotency_token=launch_token(tmp_path), idle_timeout_seconds=60))
        layout = JobLayout(open_store(uri))
        requested = time.time()
        layout.write_request(info.instance_id, SegmentRequest("seg.try1", uri, 0, 0, 100000, command,
                                                              created_at=requested, min_interval_seconds=1.0))
        trigger = SegmentTrigger(job_uri=uri, attempt_id="seg.try1", instance_id=info.instance_id,
                                 requested_at=requested, backend="ec2", backend_options=options,
                                 aws_conn_id="aws_default", poll_interval=5.0, startup_timeout=240.0,
                                 heartbeat_timeout=120.0, max_attempt_seconds=280.0)

        async def scenario() -> tuple[dict, float]:
            task = asyncio.create_task(_first_event(trigger))
            # training runs and has committed a checkpoint before the notice
            await asyncio.to_thread(wait_for, lambda: (hb := layout.read_heartbeat("seg.try1")) is not None
                                    and (hb.last_committed_step or 0) > 0, 240, "a committed checkpoint")
            assert not task.done(), task.result()
            await asyncio.to_thread(plane.preempt, info.instance_id)
            return await asyncio.wait_for(task, 120), plane.played[info.instance_id].notice_issued_at

        event, noticed = asyncio.run(asyncio.wait_for(scenario(), 280))
        assert plane.errors == []
        # the trigger released the instance itself, long before the reclaim (the worker need not)
        described = backend.describe([info.instance_id])[info.instance_id]
        assert event["terminated"] is True and InstanceState(described.state).is_terminal(), (event, described)
        assert TerminationReason(described.reason) is TerminationReason.USER, described

    assert event["status"] == Outcome.PREEMPTED.value and event["exit_code"] == 75, event
    # the process saw the notice after the data plane issued it, and the event says when
    assert event["notice_at"] is not None and event["notice_at"] >= noticed, (event, noticed)
    # decided by the attempt's own status while the instance still ran (the reclaim comes 90 s later)
    assert event["instance_state"] == "running", event
    assert event["last_committed_step"] == event["last_step"] > 0, event

    # the worker's accounting keeps the notice time next to the steps kept
    store = open_store(uri)
    launch = AttemptLaunch("seg.try1", 0, 0, 100000, info.instance_id, OFFER.to_dict(), requested, requested,
                           False, 1, "train", resume_step=0)
    row = record_attempt(store, launch, Outcome.PREEMPTED, event, steps_after=event["last_committed_step"],
                         now=time.time())
    assert row["notice_at"] == event["notice_at"] and row["steps_done"] == event["last_committed_step"]
    assert LedgerStore(store).read("seg.try1").notice_at == event["notice_at"]


async def _first_event(trigger: SegmentTrigger) -> dict:
    async for event in trigger.run():
        return event.payload
