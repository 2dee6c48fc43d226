"""The shared per-scope poller: K deferred triggers cost one batched describe per interval, not K; a
cancelled trigger unsubscribes; the poller stops with its last subscriber; a failed describe reaches the
subscribers as "unknown this round", never as a lost instance."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from airflow_spot.backends.base import InstanceState, LaunchSpec, get_backend, register_backend
from airflow_spot.backends.local import LocalBackend
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.protocol import Outcome
from airflow_spot.triggers.poller import active_pollers, subscribe
from airflow_spot.triggers.segment import Observation, SegmentTrigger, classify

pytestmark = pytest.mark.timeout(120)

OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)


class CountingLocalBackend(LocalBackend):
    """The real local backend, counting its batched describe calls and the ids each one asked for."""

    name = "counting-local"
    calls: list[tuple[float, tuple[str, ...]]] = []

    def describe(self, instance_ids):
        type(self).calls.append((time.monotonic(), tuple(instance_ids)))
        return super().describe(instance_ids)


class FailingLocalBackend(LocalBackend):
    """The local backend whose describe fails while ``failing`` is set (a throttled or unreachable API)."""

    name = "failing-local"
    failing = False

    def describe(self, instance_ids):
        if type(self).failing:
            raise ConnectionError("endpoint unreachable")
        return super().describe(instance_ids)


class HangingLocalBackend(LocalBackend):
    """The local backend whose describe hangs while ``release`` is not set (an endpoint that black-holes)."""

    name = "hanging-local"
    release = threading.Event()
    calls = 0

    def describe(self, instance_ids):
        type(self).calls += 1
        type(self).release.wait(30)
        return super().describe(instance_ids)


register_backend("counting-local", f"{__name__}:CountingLocalBackend")
register_backend("failing-local", f"{__name__}:FailingLocalBackend")


@pytest.fixture
def instances(tmp_path):
    """Launch idle local instances (agents with no request); terminate them at the end."""
    options = {"state_dir": str(tmp_path / "instances"), "terminate_grace_seconds": 1.0}
    backend = get_backend("local", **options)
    launched: list[str] = []

    def launch(n: int) -> list[str]:
        # the agents must outlive the test however slow a loaded machine makes it (its waits add up to more
        # than a minute): one that idles out ends its trigger with an event, and the trigger unsubscribes
        for i in range(n):
            spec = LaunchSpec(OFFER, f"file://{tmp_path}/job{i}", idempotency_token=f"{tmp_path}-{len(launched)}",
                              idle_timeout_seconds=600)
            launched.append(backend.launch(spec).instance_id)
        return launched[-n:]

    yield options, launch
    backend.terminate(launched)


def waiting_trigger(options: dict, instance_id: str, tmp_path, backend: str, interval: float) -> SegmentTrigger:
    # No request is written: the agent idles, no heartbeat comes, and the trigger waits out startup_timeout.
    return SegmentTrigger(
        job_uri=f"file://{tmp_path}/job-{instance_id}", attempt_id=f"a-{instance_id}", instance_id=instance_id,
        requested_at=time.time(), backend=backend, backend_options=options, aws_conn_id=None,
        poll_interval=interval, startup_timeout=300, heartbeat_timeout=300, max_attempt_seconds=600,
    )


async def first_event(trigger: SegmentTrigger):
    async for event in trigger.run():
        return event.payload


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.02)


def test_k_triggers_share_one_describe_per_interval_and_cancellation_unsubscribes(instances, tmp_path):
    options, launch = instances
    ids = launch(4)
    interval = 0.2
    CountingLocalBackend.calls = []

    async def scenario():
        tasks = [asyncio.create_task(first_event(waiting_trigger(options, i, tmp_path, "counting-local", interval)))
                 for i in ids]
        await until(lambda: len(active_pollers()) == 1 and active_pollers()[0].subscriber_count == 4, 30,
                    "the four triggers to subscribe")
        poller = active_pollers()[0]
        await until(lambda: sum(1 for _, asked in CountingLocalBackend.calls if len(asked) == 4) >= 10, 30,
                    "ten rounds with all four instances")
        full = [(t, asked) for t, asked in CountingLocalBackend.calls if len(asked) == 4]
        span = full[-1][0] - full[0][0]
        # Per-trigger polling would make 4 calls per interval; shared polling makes one per round, and rounds
        # are at least one interval apart.
        assert span >= (len(full) - 1) * interval * 0.9
        assert all(sorted(asked) == sorted(ids) for _, asked in full)
        assert poller.describe_calls == len(CountingLocalBackend.calls)

        tasks[0].cancel()  # the task was killed or the triggerer moved the trigger away
        await asyncio.gather(tasks[0], return_exceptions=True)
        assert poller.subscriber_count == 3
        before = len(CountingLocalBackend.calls)
        await until(lambda: len(CountingLocalBackend.calls) >= before + 2, 10, "two more rounds")
        assert ids[0] not in CountingLocalBackend.calls[-1][1]
        assert sorted(CountingLocalBackend.calls[-1][1]) == sorted(ids[1:])

        for task in tasks[1:]:
            task.cancel()
        await asyncio.gather(*tasks[1:], return_exceptions=True)
        assert active_pollers() == [] and poller.subscriber_count == 0
        stopped_at = len(CountingLocalBackend.calls)
        await asyncio.sleep(3 * interval)
        assert len(CountingLocalBackend.calls) == stopped_at, "the poller kept polling without subscribers"

    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_a_terminated_instance_ends_only_its_own_trigger(instances, tmp_path):
    options, launch = instances
    ids = launch(2)
    backend = get_backend("local", **options)

    async def scenario():
        tasks = [asyncio.create_task(first_event(waiting_trigger(options, i, tmp_path, "local", 0.1))) for i in ids]
        await until(lambda: active_pollers() and active_pollers()[0].subscriber_count == 2, 30, "two subscribers")
        await asyncio.to_thread(backend.terminate, [ids[0]])
        event = await asyncio.wait_for(tasks[0], 30)
        assert event["status"] == Outcome.LOST.value and event["instance_id"] == ids[0]
        assert "reason: user" in event["message"]
        assert not tasks[1].done() and active_pollers()[0].subscriber_count == 1
        tasks[1].cancel()
        await asyncio.gather(tasks[1], return_exceptions=True)
        assert active_pollers() == []

    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_failed_describe_is_unknown_this_round_not_lost(instances):
    options, launch = instances
    (iid,) = launch(1)
    backend = FailingLocalBackend(**options)

    async def scenario():
        async with subscribe(backend, iid, interval=0.05) as sub:
            FailingLocalBackend.failing = True
            try:
                seen = await sub.next()
                seen = await sub.next()  # a round that started after the flag was set
            finally:
                FailingLocalBackend.failing = False
            assert seen.error and "endpoint unreachable" in seen.error
            assert seen.instance is None and not seen.known
            verdict = classify(
                Observation(now=time.time(), status=None, heartbeat=None, instance=seen.instance,
                            instance_known=seen.known, instance_error=seen.error),
                requested_at=time.time(), startup_timeout=60, heartbeat_timeout=60, max_attempt_seconds=600,
            )
            assert verdict is None, "a failed describe must not end the attempt"
            seen = await sub.next()
            assert seen.error is None and seen.known and seen.instance.state is InstanceState.RUNNING

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_same_options_share_a_poller_other_scopes_do_not(tmp_path):
    a = LocalBackend(state_dir=str(tmp_path / "a"))
    a_again = LocalBackend(state_dir=str(tmp_path / "a"))
    b = LocalBackend(state_dir=str(tmp_path / "b"))

    async def scenario():
        async with subscribe(a, "i-1", interval=1), subscribe(a_again, "i-2", interval=1):
            assert len(active_pollers()) == 1 and active_pollers()[0].subscriber_count == 2
            async with subscribe(b, "i-3", interval=1):
                assert len(active_pollers()) == 2
        assert active_pollers() == []
        with pytest.raises(ValueError, match="poll interval must be positive"):
            async with subscribe(a, "i-1", interval=0):
                pass

    asyncio.run(scenario())


def test_triggers_of_one_backend_and_connection_share_one_hook(tmp_path):
    def trigger(instance_id: str, state_dir: str) -> SegmentTrigger:
        return SegmentTrigger(job_uri=f"file://{tmp_path}/job", attempt_id="a", instance_id=instance_id,
                              requested_at=0.0, backend="local", backend_options={"state_dir": state_dir},
                              aws_conn_id=None)

    same = trigger("i-1", str(tmp_path / "a"))._hook()
    assert trigger("i-2", str(tmp_path / "a"))._hook() is same
    assert same.get_backend() is trigger("i-3", str(tmp_path / "a"))._hook().get_backend()
    assert trigger("i-4", str(tmp_path / "b"))._hook() is not same


def test_a_hung_describe_fails_its_round_and_starts_no_second_one(instances, monkeypatch):
    """A describe that does not answer (a black-holed endpoint) held every subscriber's wait with it: the
    round now fails after ``DESCRIBE_TIMEOUT_SECONDS`` (unknown this round, as any failed describe), and
    while the hung call's thread still runs no other describe starts beside it."""
    from airflow_spot.triggers import poller

    monkeypatch.setattr(poller, "DESCRIBE_TIMEOUT_SECONDS", 0.2)
    options, launch = instances
    (iid,) = launch(1)
    backend = HangingLocalBackend(**options)
    HangingLocalBackend.release.clear()
    HangingLocalBackend.calls = 0

    async def scenario():
        async with subscribe(backend, iid, interval=0.05) as sub:
            first = await sub.next()
            assert first.error and "took over" in first.error and not first.known
            second = await sub.next()
            assert second.error and "has not returned" in second.error
            assert HangingLocalBackend.calls == 1
            HangingLocalBackend.release.set()
            for _ in range(20):  # bounded: the released call returns, then rounds describe again
                seen = await sub.next()
                if seen.error is None:
                    break
            assert seen.known and seen.instance.state is InstanceState.RUNNING

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        HangingLocalBackend.release.set()
