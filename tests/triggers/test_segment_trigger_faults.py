"""Transient faults seen by the trigger never declare a healthy attempt lost (a false recovery restarts a
healthy job); a loss needs the backend to say so, or silence past the stated window.

The faults are injected around the real pieces (the real local backend and file store, the protocol
script as the training command): a store whose reads fail for a while, a backend whose describe fails.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from airflow_spot.backends.base import InstanceInfo, InstanceState, LaunchSpec, get_backend
from airflow_spot.hooks.spot import SpotHook
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import Heartbeat, JobLayout, Outcome, SegmentRequest
from airflow_spot.triggers.segment import Observation, SegmentTrigger, classify

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(Path(__file__).resolve().parents[1] / "operators" / "protocol_script.py")
OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
T0 = 1_000_000.0
LIMITS = dict(requested_at=T0, startup_timeout=60.0, heartbeat_timeout=20.0, max_attempt_seconds=3600.0)


# ---------------------------------------------------------------------------------------- fault injection
class FlakyStore:
    """The real store, whose reads raise ``OSError`` while ``failing(n)`` says so (n: the read's number)."""

    def __init__(self, store, failing):
        self._store, self._failing, self.reads, self.failed = store, failing, 0, 0

    def get_bytes(self, key: str) -> bytes:
        self.reads += 1
        if self._failing(self.reads):
            self.failed += 1
            raise OSError(f"injected: store read {self.reads} of {key} failed (connection reset)")
        return self._store.get_bytes(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


class FlakyBackend:
    """The real backend, whose describe raises while ``failing(n)`` says so."""

    def __init__(self, backend, failing):
        self._backend, self._failing, self.calls = backend, failing, 0

    async def adescribe(self, instance_ids: list[str]) -> dict[str, InstanceInfo]:
        self.calls += 1
        if self._failing(self.calls):
            raise TimeoutError(f"injected: describe {self.calls} timed out (RequestLimitExceeded)")
        return await self._backend.adescribe(instance_ids)

    def __getattr__(self, name):
        return getattr(self._backend, name)


class FaultyTrigger(SegmentTrigger):
    """The trigger, with its store and backend built by the real hook and then wrapped with faults."""

    store_faults = staticmethod(lambda n: False)
    describe_faults = staticmethod(lambda n: False)

    def _hook(self):
        outer = self

        class Hook(SpotHook):
            def get_store(self, uri):
                outer.store = FlakyStore(super().get_store(uri), outer.store_faults)
                return outer.store

            def get_backend(self):
                outer.backend = FlakyBackend(super().get_backend(), outer.describe_faults)
                return outer.backend

        return Hook(backend=self.backend, backend_options=self.backend_options, aws_conn_id=None)


@pytest.fixture
def job(tmp_path):
    options = {"state_dir": str(tmp_path / "instances"), "terminate_grace_seconds": 2.0}
    backend = get_backend("local", **options)
    uri = f"file://{tmp_path}/job"
    launched = []

    def start(command: list[str], end_step: int, **trigger_kwargs) -> FaultyTrigger:
        spec = LaunchSpec(OFFER, uri, idempotency_token=f"{tmp_path}-a", idle_timeout_seconds=30)
        info = backend.launch(spec)
        launched.append(info.instance_id)
        now = time.time()
        JobLayout(open_store(uri)).write_request(
            info.instance_id, SegmentRequest("seg.try1", uri, 0, 0, end_step, command, created_at=now))
        kwargs = dict(poll_interval=0.1, startup_timeout=20, heartbeat_timeout=10, max_attempt_seconds=90)
        kwargs.update(trigger_kwargs)
        return FaultyTrigger(job_uri=uri, attempt_id="seg.try1", instance_id=info.instance_id, requested_at=now,
                             backend="local", backend_options=options, aws_conn_id=None, **kwargs)

    yield backend, start
    backend.terminate(launched)


def first_event(trigger: SegmentTrigger, timeout: float = 90) -> dict:
    async def go():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(asyncio.wait_for(go(), timeout))


def wait_first_heartbeat(uri: str, attempt: str, timeout: float = 30.0) -> None:
    layout = JobLayout(open_store(uri))
    deadline = time.monotonic() + timeout
    while layout.read_heartbeat(attempt) is None:
        assert time.monotonic() < deadline, "the command never sent a heartbeat"
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------- tests
def test_store_read_errors_and_describe_errors_do_not_lose_a_healthy_attempt(job):
    _, start = job
    trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.05"], end_step=60)
    # every other read fails for the first 40 reads, and 3 of the first 6 describes: a flaky network
    trigger.store_faults = staticmethod(lambda n: n <= 40 and n % 2 == 1)
    trigger.describe_faults = staticmethod(lambda n: n in (1, 3, 4))
    event = first_event(trigger)
    assert event["status"] == "completed", event
    assert event["last_committed_step"] == 60
    assert trigger.store.failed >= 10 and trigger.backend.calls >= 4  # the faults did happen


def test_a_store_unreadable_for_a_while_is_waited_out(job):
    _, start = job
    trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.05"], end_step=60, heartbeat_timeout=10.0)
    wait_first_heartbeat(trigger.job_uri, "seg.try1")
    # 25 reads in a row fail (2 per poll: several seconds with nothing readable, longer than the
    # startup window would have allowed for a missing heartbeat); then the store answers again
    trigger.startup_timeout = 0.5
    trigger.store_faults = staticmethod(lambda n: n <= 25)
    event = first_event(trigger)
    assert event["status"] == "completed", event


def test_a_store_unreadable_past_the_window_is_a_stated_loss(job):
    _, start = job
    trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.05"], end_step=100_000, heartbeat_timeout=1.5)
    trigger.store_faults = staticmethod(lambda n: True)
    event = first_event(trigger)
    assert event["status"] == "lost"
    assert "unreadable for" in event["message"] and "window 2s" in event["message"], event["message"]


def test_classify_store_error_neither_trusts_a_terminal_instance_nor_an_old_heartbeat():
    gone = InstanceInfo("i-1", InstanceState.TERMINATED, OFFER, "file:///job")
    old = Heartbeat("a", step=3, time=T0)

    def obs(now, failing_for, **kw):
        return Observation(now=now, status=None, heartbeat=old, instance=gone, instance_known=True,
                           store_error="OSError: reset", store_failing_for=failing_for, **kw)

    # the status may be there unseen: wait, though the instance is gone and the heartbeat 100 s old
    assert classify(obs(T0 + 100, 5.0), **LIMITS) is None
    verdict = classify(obs(T0 + 100, 21.0), **LIMITS)
    assert verdict[0] is Outcome.LOST and "unreadable for 21s (window 20s)" in verdict[1]
    # the same observation with the store read fine: the instance's end decides at once
    ok = Observation(now=T0 + 100, status=None, heartbeat=old, instance=gone, instance_known=True)
    assert classify(ok, **LIMITS)[0] is Outcome.LOST
