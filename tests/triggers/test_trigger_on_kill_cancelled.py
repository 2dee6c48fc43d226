"""SegmentTrigger.on_kill releases the instance even when it is cancelled while it runs.

Airflow's triggerer cancels a trigger whose task a user killed and then awaits its ``on_kill``; until the
trigger reports finished, every sync with the triggerer's supervisor (about once a second) cancels it
again, which lands inside ``on_kill`` when the termination takes a moment (seen in tests/e2e/test_e2e_ec2.py
on a loaded machine). The termination must still happen. Real local backend, real instance process.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path

import pytest

from airflow_spot.backends.base import InstanceState, LaunchSpec, get_backend
from airflow_spot.backends.local_state import group_alive
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout, SegmentRequest
from airflow_spot.triggers.segment import SegmentTrigger

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(Path(__file__).resolve().parents[1] / "operators" / "protocol_script.py")
OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)


def test_on_kill_cancelled_at_its_first_await_still_terminates_the_instance(tmp_path):
    options = {"state_dir": str(tmp_path / "instances"), "terminate_grace_seconds": 2.0}
    backend = get_backend("local", **options)
    uri = f"file://{tmp_path}/job"
    info = backend.launch(LaunchSpec(OFFER, uri, idempotency_token=f"{tmp_path}-kill", idle_timeout_seconds=30))
    try:
        now = time.time()
        JobLayout(open_store(uri)).write_request(info.instance_id, SegmentRequest(
            "seg.try1", uri, 0, 0, 1000, [sys.executable, SCRIPT, "--step-seconds", "0.5"], created_at=now))
        trigger = SegmentTrigger(job_uri=uri, attempt_id="seg.try1", instance_id=info.instance_id,
                                 requested_at=now, backend="local", backend_options=options, aws_conn_id=None)

        async def killed_then_cancelled_again():
            task = asyncio.create_task(trigger.on_kill())
            await asyncio.sleep(0)  # on_kill runs up to its first await
            task.cancel("the triggerer's next sync")
            with contextlib.suppress(asyncio.CancelledError):
                await task

        asyncio.run(killed_then_cancelled_again())  # returns once the loop's worker threads are done
        after = backend.describe([info.instance_id])[info.instance_id]
        assert InstanceState(after.state) is InstanceState.TERMINATED
        assert not group_alive(backend.record(info.instance_id).pgid)
    finally:
        backend.terminate([info.instance_id])


def test_a_killed_attempt_is_billed_up_to_its_kill(tmp_path):
    """No execute_complete follows a kill: without the trigger's row its instance time was never billed."""
    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.storage.ledger_store import LedgerStore

    options = {"state_dir": str(tmp_path / "instances"), "terminate_grace_seconds": 2.0}
    backend = get_backend("local", **options)
    uri = f"file://{tmp_path}/job"
    info = backend.launch(LaunchSpec(OFFER, uri, idempotency_token=f"{tmp_path}-bill", idle_timeout_seconds=30))
    store = open_store(uri)
    try:
        now = time.time()
        AttemptLaunch("seg.try1", 0, 0, 1000, info.instance_id, OFFER.to_dict(), now, now - 100.0, False, 1,
                      "seg").write(store)
        JobLayout(store).write_request(info.instance_id, SegmentRequest(
            "seg.try1", uri, 0, 0, 1000, [sys.executable, SCRIPT, "--step-seconds", "0.2"], created_at=now))
        deadline = time.time() + 60
        while JobLayout(store).read_heartbeat("seg.try1") is None and time.time() < deadline:
            time.sleep(0.2)
        trigger = SegmentTrigger(job_uri=uri, attempt_id="seg.try1", instance_id=info.instance_id,
                                 requested_at=now, backend="local", backend_options=options, aws_conn_id=None)
        asyncio.run(trigger.on_kill())
        row = LedgerStore(store).read("seg.try1")
        assert row is not None and row.outcome == "abandoned"
        assert row.started_at == now - 100.0 and row.ended_at >= now
        assert JobLayout(store).read_kill("seg.try1") == row.ended_at  # recorded for any later accountant
        assert row.cost == pytest.approx(row.billed_seconds / 3600 * OFFER.price_per_hour)
        assert InstanceState(backend.describe([info.instance_id])[info.instance_id].state) is InstanceState.TERMINATED
    finally:
        backend.terminate([info.instance_id])
