"""Reliability review of the deferral path: ``SegmentTrigger.run()`` driven with asyncio against a real file
store (wrapped to inject faults) and a fake backend (no processes, so each test takes seconds).

Two groups:

* DEFECTS (fail on the code as reviewed): each test's docstring states the mechanism and what the user sees.
* VERIFIED CORRECT (pass): behaviour the review checked by running it and found right; kept so that it stays.

Every wait is bounded (``asyncio.wait_for``, loops with a deadline); a store read made to hang is released
when its test ends, so the event loop's threads finish.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import threading
import time

import pytest

from airflow_spot.backends.base import InstanceInfo, InstanceState, TerminationReason
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import AttemptStatus, Heartbeat, JobLayout
from airflow_spot.triggers import poller
from airflow_spot.triggers.segment import SegmentTrigger

pytestmark = pytest.mark.timeout(120)

OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
ATTEMPT = "train.segment_000.try1"


# ------------------------------------------------------------------------------------------------ harness
class FakeBackend:
    """An instance that runs until terminated; records the terminations asked of it."""

    name = "fake"

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.state, self.reason = InstanceState.RUNNING, TerminationReason.NONE
        self.terminated: list[str] = []

    def describe_scope(self) -> str:
        return f"fake-{id(self)}"

    def serialize(self) -> dict:
        return {"id": id(self)}

    async def adescribe(self, ids: list[str]) -> dict[str, InstanceInfo]:
        return {i: InstanceInfo(i, self.state, OFFER, self.uri, reason=self.reason) for i in ids}

    def terminate(self, ids: list[str]) -> None:
        self.terminated.extend(ids)
        self.state, self.reason = InstanceState.TERMINATED, TerminationReason.USER


class FaultyStore:
    """The real file store; ``fault(key)`` may raise (an unreadable object) or block (a hung read)."""

    def __init__(self, store) -> None:
        self._store = store
        self.fault = lambda key: None

    def get_bytes(self, key: str) -> bytes:
        self.fault(key)
        return self._store.get_bytes(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


class Hook:
    def __init__(self, store, backend) -> None:
        self.store, self.backend = store, backend
        self.store_opens = 0
        self.open_fault = lambda n: None

    def get_store(self, uri: str):
        self.store_opens += 1
        self.open_fault(self.store_opens)
        return self.store

    def get_backend(self):
        return self.backend


class ReviewTrigger(SegmentTrigger):
    """The real trigger with the test's hook (its store and backend)."""

    test_hook: Hook | None = None

    def _hook(self):
        return self.test_hook


class Attempt:
    """One attempt's store, backend and a factory of triggers watching it."""

    def __init__(self, tmp_path) -> None:
        self.uri = f"file://{tmp_path}/job"
        self.raw = open_store(self.uri)
        self.layout = JobLayout(self.raw)
        self.store = FaultyStore(self.raw)
        self.backend = FakeBackend(self.uri)
        self.hook = Hook(self.store, self.backend)
        self.requested_at = time.time()

    def kwargs(self, **overrides) -> dict:
        kw = dict(job_uri=self.uri, attempt_id=ATTEMPT, instance_id="i-0001", requested_at=self.requested_at,
                  backend="fake", aws_conn_id=None, poll_interval=0.2, startup_timeout=30.0,
                  heartbeat_timeout=2.0, max_attempt_seconds=60.0)
        kw.update(overrides)
        return kw

    def trigger(self, **overrides) -> ReviewTrigger:
        t = ReviewTrigger(**self.kwargs(**overrides))
        t.test_hook = self.hook
        return t

    def beat(self, step: int = 5, at: float | None = None) -> None:
        self.layout.write_heartbeat(Heartbeat(ATTEMPT, step=step, time=time.time() if at is None else at,
                                              last_committed_step=step))

    def complete(self, step: int = 10) -> None:
        now = time.time()
        self.layout.write_status(AttemptStatus(ATTEMPT, "completed", 0, now - 5, now, last_committed_step=step,
                                               instance_id="i-0001"))


async def first_payload(trigger: SegmentTrigger) -> dict:
    async for event in trigger.run():
        return event.payload
    raise AssertionError("run() ended without an event")


def run_first(trigger: SegmentTrigger, timeout: float) -> dict:
    return asyncio.run(asyncio.wait_for(first_payload(trigger), timeout))


@pytest.fixture
def attempt(tmp_path):
    a = Attempt(tmp_path)
    yield a
    assert not poller.active_pollers(), "a trigger left its shared poller running"


# ================================================================================================ DEFECTS
def test_a_readable_final_status_is_not_discarded_because_the_heartbeat_read_fails(attempt):
    """DEFECT (fixed). The trigger's store read took the status and the heartbeat as one unit, and
    ``_observe`` (now in triggers/observing.py) treated an exception from either as "both
    unknown": the status it just read is thrown away and the last ones read (none) are used. While the
    heartbeat object cannot be read (a GET refused or failing on that key, a heartbeat object this reader
    rejects) the agent's final
    ``completed`` status, which DESIGN.md says wins over everything, is never seen; the interim read in
    ``_next_round`` does see it, and the next ``_observe`` discards it again. After ``heartbeat_timeout``
    the attempt is declared ``lost`` ("store unreadable") and ``_release`` terminates its instance.

    What the user sees: a segment that completed is logged and billed as a lost attempt (a preemption
    charged to ``max_preemptions``), and its warm instance is terminated instead of taking the next segment.

    Fix: read the status on its own first; a status read is final whatever the heartbeat read does (only
    when the status read itself fails is the round a store error)."""
    attempt.beat()
    attempt.complete()
    attempt.store.fault = lambda key: (_ for _ in ()).throw(PermissionError(f"AccessDenied: GET {key}")) \
        if key.endswith(JobLayout.HEARTBEAT_NAME) else None
    event = run_first(attempt.trigger(heartbeat_timeout=1.5), timeout=30)
    assert event["status"] == "completed", event["message"]
    assert attempt.backend.terminated == [], "the completed attempt's instance was terminated"


def test_a_hung_store_read_does_not_hold_the_trigger_past_its_bounds(attempt):
    """DEFECT. Every store read of the wait is ``await asyncio.to_thread(...)`` with no timeout
    (segment.py:336 in ``_observe``; also ``_next_round``'s interim read, :394, and
    ``_await_status_after_notice``, :417).
    A read that hangs (a file:// store on an NFS mount that stopped answering; an S3 endpoint that
    black-holes packets: botocore waits its 60 s read timeout per try, times its retries, twice per round)
    holds ``run()`` for as long as the read hangs: the store-unreadable window (``heartbeat_timeout``) and
    ``max_attempt_seconds`` are only checked after the read returns. Each hung read also pins one thread
    of the loop's default executor, which every trigger's reads, ``_release`` and ``on_kill`` share.

    What the user sees: the segment stays deferred far past its stated limits (here: limits of 1 s and 3 s,
    no event after 10 s) and its instance keeps billing.

    Fix: bound each store read (``asyncio.wait_for(asyncio.to_thread(...), timeout)`` with a timeout well
    inside the heartbeat window) and count a timed-out read as a store error."""
    attempt.beat()
    released = threading.Event()

    def hang(key: str) -> None:
        released.wait(60)  # bounded; released when the test ends

    attempt.store.fault = hang
    trigger = attempt.trigger(heartbeat_timeout=1.0, max_attempt_seconds=3.0)

    async def go():
        try:
            return await asyncio.wait_for(first_payload(trigger), 10)
        except asyncio.TimeoutError:
            return None
        finally:
            released.set()  # the hung reads return, so the loop's threads end with the test

    event = asyncio.run(go())
    assert event is not None, "no event 10 s after the start, with heartbeat_timeout=1 s and max_attempt_seconds=3 s"
    assert event["status"] == "lost"


def test_a_transient_error_opening_the_store_does_not_crash_the_trigger(attempt):
    """DEFECT. ``run()`` opens the store and the backend once, unguarded (segment.py:447-448:
    ``await asyncio.to_thread(hook.get_store, ...)``). For ``s3://`` that reads the Airflow connection and
    builds the S3 client; in the triggerer the connection read goes through the supervisor and the API
    server, so a blip there (or a secrets backend timing out) raises. Every other store error of the wait is
    waited out for ``heartbeat_timeout``; this one escapes ``run()``: Airflow records a trigger failure and
    resumes the task with ``__fail__`` (``TaskDeferralError``), which the segment's retry policy does not
    know, so Airflow's default retry applies.

    What the user sees: a healthy attempt's try fails with "Trigger failure", an Airflow try is spent, and
    the segment sits in up_for_retry for ``retry_delay`` (the next try reattaches to the instance, which
    trained on unwatched meanwhile). A triggerer restart during such a blip fails every deferred segment.

    Fix: retry opening the store/backend with a backoff inside the heartbeat window (as reads are), then
    end as ``lost`` with the error, like a store that stays unreadable."""
    attempt.beat()
    attempt.complete()

    def first_open_fails(n: int) -> None:
        if n == 1:
            raise OSError("Connection to the API server reset while reading connection 'aws_default'")

    attempt.hook.open_fault = first_open_fails
    try:
        event = run_first(attempt.trigger(), timeout=30)
    except OSError as exc:
        pytest.fail(f"the trigger crashed on a transient error opening the store (a trigger failure): {exc}")
    assert event["status"] == "completed"


def test_a_status_outcome_this_release_does_not_know_ends_the_attempt_clearly(attempt):
    """DEFECT (found by reading). ``classify`` (segment.py) turns the status record's outcome into an
    ``Outcome`` with ``Outcome(obs.status.outcome)``: a value this release does not know (written by an agent
    of a newer release, e.g. during a rolling upgrade that reached the instance image first) raises
    ``ValueError`` out of ``run()``, on every try, since the status object stays there.

    What the user sees: "Trigger failure" on each try of the segment, with a bare ValueError, and nothing
    saying that the agent is newer than the provider on the triggerer.

    Fix: an unknown outcome is a terminal ``failed`` whose message names the outcome and says to upgrade
    airflow-spot on the workers and the triggerer; never a crash (and not ``lost``: a retry would read the
    same record)."""
    attempt.beat()
    now = time.time()
    attempt.layout.write_status(AttemptStatus(ATTEMPT, "checkpointed_and_parked", 0, now - 5, now,
                                              last_committed_step=10, instance_id="i-0001"))
    event = run_first(attempt.trigger(), timeout=30)
    assert event["status"] == "failed", event["message"]
    assert "'checkpointed_and_parked'" in event["message"] and "upgrade airflow-spot" in event["message"]
    assert event["exit_code"] == 0 and event["last_committed_step"] == 10
    assert attempt.backend.terminated == []


# ====================================================================================== VERIFIED CORRECT
# The tests below PASS: behaviour checked by running it and found right.

def test_verified_kwargs_round_trip_through_airflows_serde():
    """VERIFIED CORRECT. The worker sends ``serialize()``'s kwargs through ``airflow.sdk.serde`` and JSON
    (task_runner ``_defer_task``), the triggerer rebuilds them with ``serde.deserialize``
    (``Trigger._decrypt_kwargs``) and the class path: every argument comes back with its type (tuples in
    nested options stay tuples, None stays None, floats stay floats) and the rebuilt trigger serialises the
    same."""
    from airflow.sdk.serde import deserialize, serialize

    trigger = SegmentTrigger(
        job_uri="s3://bucket/dag/run", attempt_id=ATTEMPT, instance_id="i-0abc", requested_at=1_700_000_000.25,
        backend="ec2", backend_options={"regions": ("us-east-1", "us-west-2"), "setup": ["echo hi"]},
        aws_conn_id="aws_spot", market_options={"catalog_path": "/x.csv", "zones": ("use1-az1",)},
        poll_interval=7.5, startup_timeout=600, heartbeat_timeout=120.5, max_attempt_seconds=86400,
        stall_timeout=None, end_from_trigger=True, segment_index=3, end_step=4000)
    classpath, kwargs = trigger.serialize()
    wire = deserialize(json.loads(json.dumps(serialize(kwargs))))
    module, _, name = classpath.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**wire)
    assert rebuilt.serialize() == (classpath, kwargs)
    assert rebuilt.backend_options["regions"] == ("us-east-1", "us-west-2")
    assert rebuilt.stall_timeout is None and rebuilt.end_from_trigger is True and rebuilt.end_step == 4000
    assert isinstance(rebuilt.requested_at, float) and rebuilt.requested_at == 1_700_000_000.25


def test_verified_a_triggerer_shutdown_leaves_the_instance_and_a_rebuilt_trigger_picks_it_up(attempt):
    """VERIFIED CORRECT. A plain cancellation (the triggerer shutting down: no user-action message, so no
    ``on_kill``) neither terminates the instance nor leaves the shared poller or the running count behind;
    a trigger rebuilt from ``serialize()`` (the next triggerer) then sees the attempt through to its status."""
    from airflow_spot.triggers import segment as segment_module

    attempt.beat()
    first = attempt.trigger()

    async def shutdown_mid_wait():
        task = asyncio.ensure_future(first_payload(first))
        await asyncio.sleep(1.0)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(shutdown_mid_wait())
    assert attempt.backend.terminated == [] and not poller.active_pollers() and segment_module._RUNNING == 0

    _, kwargs = first.serialize()
    rebuilt = ReviewTrigger(**json.loads(json.dumps(kwargs)))
    rebuilt.test_hook = attempt.hook

    async def resumed():
        task = asyncio.ensure_future(first_payload(rebuilt))
        await asyncio.sleep(0.5)
        attempt.beat(step=9)
        attempt.complete()
        return await asyncio.wait_for(task, 20)

    event = asyncio.run(resumed())
    assert event["status"] == "completed" and attempt.backend.terminated == []


def test_verified_an_instance_clock_behind_does_not_make_a_live_attempt_silent(attempt):
    """VERIFIED CORRECT. Heartbeats stamped by an instance whose clock is an hour behind: silence is judged
    by when the trigger saw each beat change (triggerer clock), so the live attempt is not declared lost;
    it ends with its own status."""
    stop = threading.Event()

    def beats():
        step = 0
        while not stop.wait(0.2):
            step += 1
            attempt.beat(step=step, at=time.time() - 3600)

    writer = threading.Thread(target=beats, daemon=True)
    writer.start()
    trigger = attempt.trigger(heartbeat_timeout=1.0)

    async def go():
        task = asyncio.ensure_future(first_payload(trigger))
        await asyncio.sleep(4.0)  # four heartbeat windows
        assert not task.done(), task.result()
        attempt.complete()
        return await asyncio.wait_for(task, 20)

    try:
        event = asyncio.run(go())
    finally:
        stop.set()
        writer.join(5)
    assert event["status"] == "completed"


def test_verified_an_instance_clock_ahead_does_not_keep_a_dead_attempt_alive(attempt):
    """VERIFIED CORRECT. One heartbeat stamped an hour in the future, then silence (the agent died): the
    beat's first sight counts from the triggerer's clock, so the attempt is lost about one window later,
    not in an hour."""
    attempt.beat(step=3, at=time.time() + 3600)
    started = time.monotonic()
    event = run_first(attempt.trigger(heartbeat_timeout=1.0), timeout=30)
    assert event["status"] == "lost" and "no heartbeat" in event["message"], event["message"]
    assert time.monotonic() - started < 10
    assert attempt.backend.terminated == ["i-0001"] and event["terminated"] is True


def test_verified_two_triggers_for_one_attempt_agree(attempt):
    """VERIFIED CORRECT. Two triggers for the same attempt in one triggerer (the same instance subscribed
    twice to the shared poller, as after a reassignment) both yield the same outcome from the status, and
    the poller is gone once both leave."""
    attempt.beat()
    a, b = attempt.trigger(), attempt.trigger(poll_interval=0.3)

    async def go():
        ta, tb = asyncio.ensure_future(first_payload(a)), asyncio.ensure_future(first_payload(b))
        await asyncio.sleep(0.8)
        attempt.complete()
        return await asyncio.wait_for(asyncio.gather(ta, tb), 20)

    ea, eb = asyncio.run(go())
    assert ea["status"] == eb["status"] == "completed"
    assert ea["last_committed_step"] == eb["last_committed_step"] == 10


@pytest.mark.parametrize("payload", [None, "success-but-not-dag-test", {"status": "lost"},
                                     {"error": "Trigger timeout", "traceback": []}])
def test_verified_execute_complete_rejects_a_payload_it_does_not_know_by_name(payload):
    """VERIFIED CORRECT. An event the resume method did not expect (none, a bare string, a dict without the
    keys, a failure payload) is refused with an ``AirflowException`` naming the attempt and the payload,
    never a KeyError/TypeError deep in the accounting. (A trigger timeout or trigger failure never reaches
    ``execute_complete``: Airflow's ``resume_execution`` turns ``__fail__`` into TaskDeferralTimeout/Error.)"""
    from airflow.sdk.exceptions import AirflowException

    from airflow_spot.operators.segment import SpotSegmentOperator

    with pytest.raises(AirflowException, match="invalid trigger event for attempt"):
        SpotSegmentOperator._validate_event(payload, ATTEMPT)
    good = {"status": "completed", "attempt_id": "another.try2", "instance_id": "i", "message": ""}
    with pytest.raises(AirflowException, match="is for attempt 'another.try2'"):
        SpotSegmentOperator._validate_event(good, ATTEMPT)
