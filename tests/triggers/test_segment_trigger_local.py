"""SegmentTrigger.run() against the real local backend: each way an attempt ends gives one event, and a
trigger rebuilt from its serialised kwargs (a triggerer restart) picks up a running attempt."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from airflow_spot.backends.base import InstanceState, LaunchSpec, get_backend
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout, SegmentRequest
from airflow_spot.triggers.segment import SegmentTrigger

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(Path(__file__).resolve().parents[1] / "operators" / "protocol_script.py")
OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)


@pytest.fixture
def job(tmp_path):
    options = {"state_dir": str(tmp_path / "instances"), "terminate_grace_seconds": 2.0}
    backend = get_backend("local", **options)
    uri = f"file://{tmp_path}/job"
    launched = []

    def start(command: list[str], attempt: str = "seg.try1", end_step: int = 20):
        spec = LaunchSpec(OFFER, uri, idempotency_token=f"{tmp_path}-{attempt}", idle_timeout_seconds=30)
        info = backend.launch(spec)
        launched.append(info.instance_id)
        now = time.time()
        req = SegmentRequest(attempt, uri, 0, 0, end_step, command, created_at=now)
        JobLayout(open_store(uri)).write_request(info.instance_id, req)
        trigger = SegmentTrigger(
            job_uri=uri, attempt_id=attempt, instance_id=info.instance_id, requested_at=now,
            backend="local", backend_options=options, aws_conn_id=None,
            poll_interval=0.1, startup_timeout=20, heartbeat_timeout=10, max_attempt_seconds=60,
        )
        return info, trigger

    yield backend, start
    backend.terminate(launched)


def first_event(trigger: SegmentTrigger, timeout: float = 60) -> dict:
    async def go():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(asyncio.wait_for(go(), timeout))


def test_completed_attempt(job):
    backend, start = job
    _, trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.01"])
    event = first_event(trigger)
    assert event["status"] == "completed" and event["exit_code"] == 0
    assert event["last_committed_step"] == 20


def test_failed_attempt_carries_the_error_tail(job):
    _, start = job
    _, trigger = start([sys.executable, SCRIPT, "--fail", "CUDA out of memory"])
    event = first_event(trigger)
    assert event["status"] == "failed" and event["exit_code"] == 3
    assert "CUDA out of memory" in event["error_tail"]


def test_vanished_instance_is_lost(job):
    backend, start = job
    info, trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.5"], end_step=1000)
    deadline = time.monotonic() + 20
    while JobLayout(open_store(trigger.job_uri)).read_heartbeat(trigger.attempt_id) is None:
        assert time.monotonic() < deadline, "the command never sent a heartbeat"
        time.sleep(0.1)
    os.killpg(backend.record(info.instance_id).pgid, signal.SIGKILL)  # the machine disappears
    event = first_event(trigger)
    assert event["status"] == "lost" and "without a status" in event["message"]
    assert event["last_step"] is not None


def test_silent_command_is_lost_after_the_startup_timeout(job):
    _, start = job
    _, trigger = start([sys.executable, "-c", "import time; time.sleep(60)"])
    trigger.startup_timeout = 1.5
    event = first_event(trigger)
    assert event["status"] == "lost" and "no heartbeat within 2s" in event["message"]


def test_rebuilt_trigger_picks_up_a_running_attempt(job):
    _, start = job
    _, trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.05"], end_step=40)

    async def run_briefly():
        agen = trigger.run()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(agen.__anext__(), 0.8)  # the triggerer dies mid-attempt

    asyncio.run(run_briefly())
    classpath, kwargs = trigger.serialize()
    rebuilt = SegmentTrigger(**kwargs)
    event = first_event(rebuilt)
    assert event["status"] == "completed" and event["last_committed_step"] == 40


def test_on_kill_terminates_the_instance(job):
    backend, start = job
    info, trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.5"], end_step=1000)
    asyncio.run(trigger.on_kill())
    after = backend.describe([info.instance_id])[info.instance_id]
    assert InstanceState(after.state) is InstanceState.TERMINATED
    from airflow_spot.backends.local_state import group_alive

    assert not group_alive(backend.record(info.instance_id).pgid)


def first_event_object(trigger: SegmentTrigger, timeout: float = 60):
    async def go():
        async for event in trigger.run():
            return event

    return asyncio.run(asyncio.wait_for(go(), timeout))


def write_launch(trigger: SegmentTrigger, instance_id: str) -> None:
    from airflow_spot.operators.attempt_record import AttemptLaunch

    AttemptLaunch(
        attempt_id=trigger.attempt_id, segment_index=0, start_step=0, end_step=20, instance_id=instance_id,
        offer=OFFER.to_dict(), requested_at=trigger.requested_at, billed_from=trigger.requested_at,
        reused_instance=False, try_number=1, task_id="seg", resume_step=0,
    ).write(open_store(trigger.job_uri))


@pytest.mark.parametrize("end_step, ends_here", [(20, True), (25, False)])
def test_completed_attempt_ends_the_task_from_the_trigger(job, end_step, ends_here):
    """A completed attempt whose checkpoint reached the end is accounted for in the trigger, which ends the
    task (TaskSuccessEvent with the XComs execute_complete would push); short of the end, the worker decides."""
    from airflow.triggers.base import TaskSuccessEvent

    from airflow_spot.storage.ledger_store import LedgerStore

    _, start = job
    info, trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.01"])
    trigger.end_from_trigger, trigger.end_step = True, end_step
    write_launch(trigger, info.instance_id)
    event = first_event_object(trigger)
    rows = LedgerStore(open_store(trigger.job_uri)).rows()
    if ends_here:
        assert isinstance(event, TaskSuccessEvent)
        summary = event.xcoms["attempt"]
        assert event.xcoms["return_value"] == summary
        assert summary["outcome"] == "completed" and summary["latest_step"] == 20 and summary["steps_done"] == 20
        assert [r.attempt_id for r in rows] == [trigger.attempt_id]
    else:
        assert not isinstance(event, TaskSuccessEvent) and event.payload["status"] == "completed"
        assert rows == []


def test_an_ended_attempt_is_seen_between_describe_rounds(job):
    """With a 30 s poll the first describe round comes at once and the next 30 s later; the attempt's
    status, written a few seconds in, is read between the rounds (every second), not at the next one."""
    _, start = job
    _, trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.1"])
    trigger.poll_interval = 30.0
    started = time.monotonic()
    event = first_event(trigger, timeout=90)
    waited = time.monotonic() - started
    assert event["status"] == "completed" and event["last_committed_step"] == 20, event
    assert waited < 20.0, f"the status was seen only at the next describe round ({waited:.1f} s)"


def test_interim_reads_share_a_budget_and_stop_past_the_poll_interval(job, monkeypatch):
    from airflow_spot.triggers import segment as trigger_module

    _, start = job
    _, trigger = start([sys.executable, SCRIPT])
    trigger.poll_interval = 5.0
    monkeypatch.setattr(trigger_module, "_RUNNING", 10)
    assert trigger._interim_read_seconds() == trigger_module.INTERIM_READ_MIN_SECONDS
    monkeypatch.setattr(trigger_module, "_RUNNING", 200)  # 200 triggers at 50 reads/s: every 4 s
    assert trigger._interim_read_seconds() == pytest.approx(4.0)
    monkeypatch.setattr(trigger_module, "_RUNNING", 1000)  # past the poll interval: rounds only
    assert trigger._interim_read_seconds() is None


@pytest.mark.parametrize("market_options, priced", [({}, True), (None, False)])
def test_the_trigger_prices_the_run_with_the_jobs_market(job, monkeypatch, market_options, priced):
    """The trigger rebuilds the job's market from its market_options to price the completed run; one
    serialised before it carried them (None) bills the launch price rather than guess another market."""
    from airflow.triggers.base import TaskSuccessEvent

    from airflow_spot.market.catalog import CatalogMarket
    from airflow_spot.storage.ledger_store import LedgerStore

    monkeypatch.setattr(CatalogMarket, "billed_price", lambda self, offer, start, end: 0.123)
    _, start = job
    info, trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.01"])
    trigger.end_from_trigger, trigger.end_step, trigger.market_options = True, 20, market_options
    write_launch(trigger, info.instance_id)
    event = first_event_object(trigger)
    assert isinstance(event, TaskSuccessEvent)
    (row,) = LedgerStore(open_store(trigger.job_uri)).rows()
    assert OFFER.price_per_hour != 0.123 and row.price_per_hour == (0.123 if priced else OFFER.price_per_hour)
    assert event.xcoms["attempt"]["price_per_hour"] == row.price_per_hour


@pytest.mark.parametrize("market_options, history, written", [
    ({}, lambda start, end: 0.9, 0.9),      # the price moved: the running attempt is priced at it
    ({}, lambda start, end: 0.4, None),     # never moved from the launch price: nothing written
    ({}, None, None),                       # the history cannot be read: the wait goes on
    (None, lambda start, end: 0.9, None),   # serialised without the job's market: no guess
])
def test_a_waiting_trigger_prices_its_running_attempt_so_far(job, monkeypatch, market_options, history, written):
    from airflow_spot.market.catalog import CatalogMarket
    from airflow_spot.storage.job_view import JobView
    from airflow_spot.triggers import segment as trigger_module

    calls = []

    def billed_price(self, offer, start, end):
        calls.append((start, end))
        if history is None:
            raise RuntimeError("UnauthorizedOperation: ec2:DescribeSpotPriceHistory")
        return history(start, end)

    monkeypatch.setattr(CatalogMarket, "billed_price", billed_price)
    monkeypatch.setattr(trigger_module, "LIVE_PRICE_EVERY_SECONDS", 0.2)
    _, start = job
    info, trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.02"], end_step=100)
    trigger.market_options = market_options
    write_launch(trigger, info.instance_id)
    assert first_event(trigger)["status"] == "completed"
    store = open_store(trigger.job_uri)
    assert bool(calls) == (market_options is not None)  # read during the wait (about 2 s) when it can be
    assert all(s == trigger.requested_at and e > s for s, e in calls)
    live = JobView(store).live_prices()
    if written is None:
        assert live == {}
    else:
        assert live[trigger.attempt_id].price_per_hour == written
        assert trigger.requested_at < live[trigger.attempt_id].through <= time.time()


def test_a_hung_step_is_lost_after_the_stall_timeout_and_its_instance_let_go(job):
    """Heartbeats go on, the step does not: the trigger calls the attempt lost once the step has stayed put
    past stall_timeout, and releases the instance (it would bill until max_attempt_seconds)."""
    backend, start = job
    info, trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.05", "--hang-at", "5"], end_step=100)
    trigger.stall_timeout = 2.0
    began = time.monotonic()
    event = first_event(trigger)
    assert event["status"] == "lost" and "stayed at step 5" in event["message"], event
    assert time.monotonic() - began < 20
    assert event["terminated"] is True
    assert InstanceState(backend.describe([info.instance_id])[info.instance_id].state).is_terminal()


class _TaskInstance:
    dag_id, task_id, run_id, map_index = "dag", "train.seg000", "manual__1", -1


@pytest.mark.parametrize("state, terminated", [("deferred", False), ("failed", True), (None, True)])
def test_on_kill_leaves_a_trigger_moved_to_another_triggerer_running(job, monkeypatch, state, terminated):
    """Airflow 3.3 calls ``on_kill`` for a trigger a triggerer stops running because it was reassigned (its
    heartbeat came late), not only for a user's kill: the task, still deferred, is watched elsewhere, and
    its instance must go on. A task that is no longer deferred (marked failed) or gone was killed."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    asked = []

    def states(**kwargs):
        asked.append(kwargs)
        return {} if state is None else {"manual__1": {"train.seg000": state}}

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(states))
    backend, start = job
    info, trigger = start([sys.executable, SCRIPT, "--step-seconds", "0.5"], end_step=1000)
    trigger.task_instance = _TaskInstance()
    asyncio.run(trigger.on_kill())
    after = backend.describe([info.instance_id])[info.instance_id]
    assert (InstanceState(after.state) is InstanceState.TERMINATED) is terminated
    assert asked == [{"dag_id": "dag", "task_ids": ["train.seg000"], "run_ids": ["manual__1"], "map_index": None}]
    if not terminated:
        backend.terminate([info.instance_id])
