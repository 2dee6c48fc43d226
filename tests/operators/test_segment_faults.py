"""Faults between the operator's steps that must lose no work, kill no running attempt and spend no budget
on finished work (found by a review of the failure paths)."""
from __future__ import annotations

import time
from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest

from airflow_fixtures import (  # noqa: F401
    airflow_db, backend_options, instance_count, job_store, protocol_command, run_dag, ti_states,
)
from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.operators.segment import SpotSegmentOperator
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout

pytestmark = pytest.mark.timeout(300)

LOCAL_OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.5, 1.0, "A10G", 1, 24.0)


def launch_job_instances(tmp_path, op, *tokens):
    """The local backend and one instance per token, tagged as ``op``'s job's (no DAG around it)."""
    from airflow_spot.backends.base import LaunchSpec, get_backend
    from airflow_spot.operators.segment import job_tags

    backend = get_backend("local", **backend_options(tmp_path))
    tags = job_tags("d", "r", op.job_name, f"file://{tmp_path}/job")
    op._tags = lambda context: tags
    return backend, [backend.launch(LaunchSpec(LOCAL_OFFER, f"file://{tmp_path}/job", idempotency_token=token,
                                               tags=tags, idle_timeout_seconds=60)) for token in tokens]


class StateStoreRefusesOnTry1(SpotSegmentOperator):
    """The execution API refuses the first try's task state record after its request was written (the
    same as a worker that died between the two)."""

    def _remember_attempt(self, context, launch):
        if context["ti"].try_number == 1:
            raise RuntimeError("execution API: task_state_store set failed (simulated)")
        super()._remember_attempt(context, launch)


def test_a_try_whose_record_was_lost_is_reattached_not_run_over(airflow_db, tmp_path):  # noqa: F811
    """Try 2 finds try 1's attempt through the store (its launch and request, no ledger row) and waits for
    it, instead of taking its busy instance as a warm one (its request would queue behind try 1's, be
    declared lost, and the instance's termination would kill try 1's run)."""
    from airflow.sdk import DAG

    with DAG("lost_record", schedule=None, start_date=datetime(2024, 1, 1), catchup=False) as dag:
        StateStoreRefusesOnTry1(
            task_id="segment",
            command=protocol_command("--step-seconds", "0.1"),
            checkpoint_uri=f"file://{tmp_path}/jobs/{{{{ run_id }}}}",
            start_step=0, end_step=60, total_steps=60,
            backend="local", backend_options=backend_options(tmp_path),
            retries=3, retry_delay=timedelta(seconds=0.5), deferrable=True,
            poll_interval=0.2, startup_timeout=5.0, heartbeat_timeout=30.0,
        )
    dr = run_dag(dag)
    store = job_store(tmp_path, dr.run_id)
    rows = LedgerStore(store).rows()
    assert ti_states(dr) == {"segment": ("success", 2)}  # try 2 waited for try 1's attempt
    assert [(r.attempt_id, r.outcome) for r in rows] == [("segment.try1", "completed")]
    assert JobLayout(store).read_status("segment.try1").outcome == "completed"
    assert instance_count(tmp_path) == 1


def test_the_busy_filter_keeps_an_unaccounted_attempts_instance_out_of_the_warm_ones(tmp_path):
    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    from airflow_spot.storage.protocol import AttemptStatus, SegmentRequest

    layout = JobLayout(store)
    now = time.time()
    layout.write_request("i-busy", SegmentRequest("seg.try1", uri, 0, 0, 10, ["true"], created_at=now))
    layout.write_request("i-done", SegmentRequest("seg.try0", uri, 0, 0, 10, ["true"], created_at=now))
    layout.write_status(AttemptStatus("seg.try0", "completed", 0, now, now, 10))
    assert SpotSegmentOperator._busy(store, ["i-busy", "i-done", "i-idle"]) == {"i-busy"}


@pytest.mark.parametrize("status", ["preempted", "lost"])
def test_a_segment_taken_after_its_end_checkpoint_is_done_not_retried(tmp_path, status):
    """A reclaim between the end checkpoint's commit and the agent's status (or a status never written)
    leaves all the segment's work saved: it succeeds, with no retry and no budget failure."""
    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    JobLayout(store).checkpoint_store().save(10, lambda f: f.write(b"end-of-segment state"))
    offer = Offer("g5.xlarge", "us-east-1", "us-east-1a", Market.SPOT, 0.5, 1.0, "A10G", 1, 24.0)
    now = time.time()
    AttemptLaunch(attempt_id="seg.try1", segment_index=0, start_step=0, end_step=10, instance_id="i-gone",
                  offer=offer.to_dict(), requested_at=now - 600, billed_from=now - 600, reused_instance=False,
                  try_number=1, task_id="seg", resume_step=0).write(store)
    op = SpotSegmentOperator(task_id="seg", command=["python", "x.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=20, backend="local",
                             backend_options={"state_dir": str(tmp_path / "inst")}, max_preemptions=0)
    pushed = {}
    ti = SimpleNamespace(try_number=1, id=None, max_tries=op.retries,
                         xcom_push=lambda key, value: pushed.update({key: value}))
    event = {"status": status, "attempt_id": "seg.try1", "instance_id": "i-gone", "terminated": True,
             "message": "instance was reclaimed by the market before the agent wrote a status",
             "ended_at": now, "last_step": 10, "last_committed_step": 10}
    result = op.execute_complete({"ti": ti, "run_id": "r"}, event)
    assert result["outcome"] == status and pushed["attempt"] == result  # billed as what happened
    (row,) = LedgerStore(store).rows()
    assert row.outcome == status and row.steps_done == 10


def test_a_throttled_launch_is_waited_out_in_the_same_try(airflow_db, tmp_path, monkeypatch):  # noqa: F811
    """A transient launch error (RequestLimitExceeded, a 5xx, a timeout) is neither a configuration error
    that fails the task for good nor a capacity refusal the policy learns from: the segment decides again
    after the capacity recheck, in the same try."""
    from airflow_fixtures import FAST_SEGMENT_OPTIONS, build_dag

    from airflow_spot.backends.base import LaunchError
    from airflow_spot.backends.local import LocalBackend
    from airflow_spot.operators.planning import AvailabilityRecorder

    real_launch, failures = LocalBackend.launch, []

    def launch(self, spec):
        if len(failures) < 3:
            error = LaunchError("RequestLimitExceeded: Request limit exceeded.", capacity=False)
            error.transient = True
            failures.append(spec.offer.pool)
            raise error
        return real_launch(self, spec)

    monkeypatch.setattr(LocalBackend, "launch", launch)
    dag = build_dag(
        "throttled_launch", tmp_path, command=protocol_command("--step-seconds", "0.02"), total_steps=20,
        steps_per_segment=20, backend_options=backend_options(tmp_path), max_preemptions=1, retries=0,
        segment_options={**FAST_SEGMENT_OPTIONS, "capacity_recheck_seconds": 0.5},
    )
    dr = run_dag(dag)
    assert ti_states(dr)["train.segment_000"] == ("success", 1)
    assert len(failures) == 3
    store = job_store(tmp_path, dr.run_id)
    assert [e.kind for e in AvailabilityRecorder(store, None, "j").job_events()] == ["launched"]
    assert [r.outcome for r in LedgerStore(store).rows()] == ["completed"]


def test_an_instance_that_lost_its_attempt_is_never_warm_and_is_terminated_again(tmp_path):
    """Both terminations of a lost attempt's instance can fail (the trigger's, execute_complete's): the
    next segment must not hand that instance a request, and tries its termination once more."""
    from airflow_spot.backends.base import InstanceState
    from airflow_spot.policy.ledger import LedgerRow

    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    op = SpotSegmentOperator(task_id="seg", command=["python", "x.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=20, backend="local",
                             backend_options=backend_options(tmp_path))
    backend, (lost, idle) = launch_job_instances(tmp_path, op, "t-lost", "t-idle")
    try:
        now = time.time()
        LedgerStore(store).write(LedgerRow(
            attempt_id="seg.try1", instance_id=lost.instance_id, instance_type="g5.xlarge", zone="use1-az1",
            market="spot", price_per_hour=0.5, on_demand_price_per_hour=1.0, started_at=now - 60, ended_at=now,
            steps_done=0, outcome="lost", segment_index=0))
        warm = op._warm_instances({"run_id": "r"}, store)
        assert [i.instance_id for i in warm] == [idle.instance_id]
        assert InstanceState(backend.describe([lost.instance_id])[lost.instance_id].state).is_terminal()
        assert not InstanceState(backend.describe([idle.instance_id])[idle.instance_id].state).is_terminal()
    finally:
        backend.terminate([lost.instance_id, idle.instance_id])


def test_an_instance_whose_agent_has_exited_is_never_warm(tmp_path, monkeypatch):
    """A review of the warm-instance paths: an agent that exited after its idle timeout serves no request,
    but its instance is still listed running while it shuts down (seconds on EC2). Handed a request, the
    attempt waited out startup_timeout and ended lost, spending a preemption. Such an instance is not
    reused (the agent's liveness record says it exited)."""
    import json

    from airflow_spot.backends.base import InstanceInfo, InstanceState
    from airflow_spot.hooks.spot import SpotHook

    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    op = SpotSegmentOperator(task_id="seg", command=["python", "x.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=20, backend="local",
                             backend_options=backend_options(tmp_path))
    listed = [InstanceInfo(i, InstanceState.RUNNING, LOCAL_OFFER, uri) for i in ("i-going", "i-idle")]
    monkeypatch.setattr(SpotHook, "get_backend", lambda self: SimpleNamespace(list_instances=lambda tags=None: listed))
    op._tags = lambda context: {}
    liveness = {"schema": 1, "pid": 1, "attempt_id": None, "time": time.time()}
    store.put_bytes(JobLayout.agent_key("i-going"), json.dumps(
        {**liveness, "instance_id": "i-going", "state": "exited", "exit_reason": "idle"}).encode())
    store.put_bytes(JobLayout.agent_key("i-idle"), json.dumps(
        {**liveness, "instance_id": "i-idle", "state": "idle"}).encode())
    assert [i.instance_id for i in op._warm_instances({"run_id": "r"}, store, [])] == ["i-idle"]


def test_a_later_try_with_no_record_is_found_behind_an_older_tries_accounted_record(tmp_path):
    """The task state store keeps try 1's record; try 2 asked its instance and died before recording: try 3
    must wait for try 2's attempt, not launch a second instance next to it."""
    from airflow_spot.policy.ledger import LedgerRow
    from airflow_spot.storage.protocol import AttemptStatus, SegmentRequest

    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    layout = JobLayout(store)
    offer = LOCAL_OFFER
    now = time.time()
    for n in (1, 2):
        AttemptLaunch(attempt_id=f"seg.try{n}", segment_index=0, start_step=0, end_step=10, instance_id=f"i-{n}",
                      offer=offer.to_dict(), requested_at=now - 600 + n, billed_from=now - 600 + n,
                      reused_instance=False, try_number=n, task_id="seg", resume_step=0).write(store)
        layout.write_request(f"i-{n}", SegmentRequest(f"seg.try{n}", uri, 0, 0, 10, ["true"], created_at=now))
    LedgerStore(store).write(LedgerRow(
        attempt_id="seg.try1", instance_id="i-1", instance_type="g5.xlarge", zone="use1-az1", market="spot",
        price_per_hour=0.5, on_demand_price_per_hour=1.0, started_at=now - 599, ended_at=now - 300, steps_done=3,
        outcome="preempted", segment_index=0))
    layout.write_status(AttemptStatus("seg.try2", "completed", 0, now - 598, now - 10, 10))  # it ended, unaccounted
    op = SpotSegmentOperator(task_id="seg", command=["python", "x.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=20, backend="local", backend_options=backend_options(tmp_path))
    state = {SpotSegmentOperator.ATTEMPT_STATE_KEY: {"attempt_id": "seg.try1", "instance_id": "i-1", "try_number": 1}}
    ti = SimpleNamespace(try_number=3, id="ti-3", max_tries=op.retries)
    context = {"ti": ti, "run_id": "r", "task_state_store": SimpleNamespace(get=state.get)}
    launch = op._reattach(context, store)
    assert launch is not None and launch.attempt_id == "seg.try2"
    del state[SpotSegmentOperator.ATTEMPT_STATE_KEY]  # no record at all: the same answer
    assert op._reattach(context, store).attempt_id == "seg.try2"
    ti.try_number = 2  # try 2 itself (a redelivered message) does not wait for its own attempt this way
    assert op._reattach(context, store) is None


def test_an_earlier_tries_attempt_whose_instance_went_without_a_status_is_billed_not_waited_for(tmp_path):
    """Try 1's worker died and its instance ended (no status): try 2 launches anew, and try 1's attempt,
    which nobody will ever account for, is billed to its last heartbeat as abandoned (no budget spent)."""
    from airflow_spot.storage.protocol import Heartbeat

    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    layout = JobLayout(store)
    offer = LOCAL_OFFER
    now = time.time()
    _try1_launched(store, offer, "i-vanished", now - 900)
    layout.write_heartbeat(Heartbeat("seg.try1", step=4, time=now - 300, last_committed_step=2))
    op = SpotSegmentOperator(task_id="seg", command=["python", "x.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=20, backend="local", backend_options=backend_options(tmp_path))
    ti = SimpleNamespace(try_number=2, id="ti-2", max_tries=op.retries)
    assert op._reattach({"ti": ti, "run_id": "r", "task_state_store": None}, store) is None
    row = LedgerStore(store).read("seg.try1")
    assert row is not None and row.outcome == "abandoned"
    assert (row.started_at, row.ended_at) == (pytest.approx(now - 900), pytest.approx(now - 300))
    assert (row.steps_done, row.steps_lost) == (2, 2)
    assert row.cost == pytest.approx(600 / 3600 * 0.5)


def test_a_try_after_a_clear_does_not_wait_for_the_killed_attempt(tmp_path):
    """Review: clearing a deferred segment kills its trigger (on_kill ends the instance; the agent then
    reports ``preempted``) and starts a new try, whose task state record still names the killed attempt.
    Reattaching to it turned the kill into a preemption (execute_complete's row over on_kill's abandoned
    one, the budget spent). Attempts from before the clear are not this try's, as without a record."""
    from datetime import timezone

    from airflow_spot.storage.protocol import AttemptStatus

    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    layout = JobLayout(store)
    offer = LOCAL_OFFER
    now = time.time()
    _try1_launched(store, offer, "i-1", now - 600)
    layout.write_status(AttemptStatus("seg.try1", "preempted", 143, now - 600, now - 5, 4))  # the kill's
    op = SpotSegmentOperator(task_id="seg", command=["python", "x.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=20, backend="local", backend_options=backend_options(tmp_path))
    state = {SpotSegmentOperator.ATTEMPT_STATE_KEY: {"attempt_id": "seg.try1", "instance_id": "i-1", "try_number": 1}}
    ti = SimpleNamespace(try_number=2, id="ti-2", max_tries=op.retries + 1)
    cleared = SimpleNamespace(start_date=datetime.fromtimestamp(now - 10, timezone.utc))  # reset by the clear
    context = {"ti": ti, "run_id": "r", "task_state_store": SimpleNamespace(get=state.get), "dag_run": cleared}
    assert op._reattach(context, store) is None
    # a crashed worker's try (no clear: the run started before the attempt) is still waited for
    context["dag_run"] = SimpleNamespace(start_date=datetime.fromtimestamp(now - 900, timezone.utc))
    assert op._reattach(context, store).attempt_id == "seg.try1"


def _killed_try1(tmp_path):
    """Try 1's attempt killed 20 s ago, and the ``preempted`` status its instance's termination brought
    about 5 s later; the segment's operator."""
    from airflow_spot.storage.protocol import AttemptStatus

    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    layout = JobLayout(store)
    now = time.time()
    _try1_launched(store, LOCAL_OFFER, "i-1", now - 600)
    layout.write_kill("seg.try1", now - 20)
    layout.write_status(AttemptStatus("seg.try1", "preempted", 143, now - 600, now - 15, 4))  # the kill's
    op = SpotSegmentOperator(task_id="seg", command=["python", "x.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=20, backend="local", backend_options=backend_options(tmp_path))
    return store, layout, op, now


def _try1_launched(store, offer, instance_id: str, at: float) -> None:
    """Try 1's launch record and request, as the operator writes them."""
    from airflow_spot.storage.protocol import SegmentRequest

    AttemptLaunch(attempt_id="seg.try1", segment_index=0, start_step=0, end_step=10, instance_id=instance_id,
                  offer=offer.to_dict(), requested_at=at, billed_from=at, reused_instance=False,
                  try_number=1, task_id="seg", resume_step=0).write(store)
    JobLayout(store).write_request(instance_id, SegmentRequest("seg.try1", store.uri, 0, 0, 10, ["true"],
                                                               created_at=at))


def test_a_retry_after_a_kill_in_the_worker_does_not_wait_for_the_killed_attempt(tmp_path):
    """Review of the kill record: a segment waiting in a worker is killed without a clear (its
    execution_timeout, the worker's graceful shutdown: on_kill records the kill and ends the instance; the
    agent then writes ``preempted``) and Airflow retries it. The run started before the attempt, so the
    clear rule does not apply: try 2 reattached to the killed attempt and execute_complete billed the kill
    as a preemption (the budget spent, one more try). A recorded kill now says it: billed abandoned, to the
    kill, and a new attempt is due."""
    from datetime import timezone

    from airflow_spot.storage.protocol import AttemptStatus

    store, layout, op, now = _killed_try1(tmp_path)
    state = {SpotSegmentOperator.ATTEMPT_STATE_KEY: {"attempt_id": "seg.try1", "instance_id": "i-1", "try_number": 1}}
    ti = SimpleNamespace(try_number=2, id="ti-2", max_tries=op.retries)
    run = SimpleNamespace(start_date=datetime.fromtimestamp(now - 900, timezone.utc))  # no clear
    for record in (state, {}):  # with the task state record, and without one (the store's records)
        store.delete([LedgerStore.key("seg.try1")])
        context = {"ti": ti, "run_id": "r", "task_state_store": SimpleNamespace(get=record.get), "dag_run": run}
        assert op._reattach(context, store) is None
        row = LedgerStore(store).read("seg.try1")
        assert row is not None and row.outcome == "abandoned" and row.ended_at == pytest.approx(now - 20)
    # an attempt that ended on its own before the kill (its status first) is waited for and judged as before
    store.delete([LedgerStore.key("seg.try1")])
    layout.write_status(AttemptStatus("seg.try1", "preempted", 143, now - 600, now - 30, 4))
    context = {"ti": ti, "run_id": "r", "task_state_store": SimpleNamespace(get=state.get), "dag_run": run}
    assert op._reattach(context, store).attempt_id == "seg.try1"
    # so is one that completed its segment, though the kill landed before its status (kill_seen)
    layout.write_status(AttemptStatus("seg.try1", "completed", 0, now - 600, now - 15, 10, kill_seen=True))
    assert op._reattach(context, store).attempt_id == "seg.try1"


def test_execute_complete_bills_a_status_the_kill_brought_about_as_abandoned(tmp_path):
    """Review of the kill record: killed in a worker (non-deferrable), the task's process lives on a few
    seconds after on_kill (SIGTERM, then SIGKILL 5 s later), and its wait sees the ``preempted`` status the
    termination brought about: execute_complete wrote a preemption row (counted, on the page) although the
    kill is in the store. Billed abandoned, to the kill; no preemption, no SegmentPreempted."""
    from airflow.sdk.exceptions import AirflowException

    from airflow_spot.operators.segment import SegmentPreempted

    store, layout, op, now = _killed_try1(tmp_path)
    pushed = {}
    ti = SimpleNamespace(try_number=1, id=None, max_tries=op.retries,
                         xcom_push=lambda key, value: pushed.update({key: value}))
    event = {"status": "preempted", "attempt_id": "seg.try1", "instance_id": "i-1", "message": "agent reported",
             "ended_at": now - 15, "last_step": 4}
    with pytest.raises(AirflowException, match="killed") as raised:
        op.execute_complete({"ti": ti, "run_id": "r"}, event)
    assert not isinstance(raised.value, SegmentPreempted)
    row = LedgerStore(store).read("seg.try1")
    assert row.outcome == "abandoned" and row.ended_at == pytest.approx(now - 20)
    assert "attempt" not in pushed


def test_an_instance_still_running_a_killed_attempt_is_terminated_again_not_left_busy(tmp_path):
    """Review of the kill record: the kill's termination can fail (the trigger's on_kill, the worker's); its
    attempt then trains on with no status and no ledger row, and the next segment left that "busy" instance
    running beside its own attempt (two trainers in one store) until the finish task. The store says it was
    killed: terminated once more, as a lost attempt's instance is."""
    from airflow_spot.backends.base import InstanceState
    from airflow_spot.storage.protocol import SegmentRequest

    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    layout = JobLayout(store)
    op = SpotSegmentOperator(task_id="seg2", command=["python", "x.py"], checkpoint_uri=uri, start_step=10,
                             end_step=20, total_steps=20, segment_index=1, backend="local",
                             backend_options=backend_options(tmp_path))
    backend, (killed, busy) = launch_job_instances(tmp_path, op, "t-killed", "t-busy")
    try:
        now = time.time()
        for attempt_id, info in (("seg.try1", killed), ("other.try1", busy)):
            layout.write_request(info.instance_id, SegmentRequest(attempt_id, uri, 0, 0, 10, ["true"], created_at=now))
        layout.write_kill("seg.try1", now - 5)
        assert op._warm_instances({"run_id": "r"}, store, []) == []
        assert InstanceState(backend.describe([killed.instance_id])[killed.instance_id].state).is_terminal()
        # an attempt nobody killed is still left alone (its try's record was lost: a later try waits for it)
        assert not InstanceState(backend.describe([busy.instance_id])[busy.instance_id].state).is_terminal()
    finally:
        backend.terminate([killed.instance_id, busy.instance_id])


@pytest.mark.parametrize("skew", [-60.0, 60.0])
def test_a_kill_is_told_from_a_preemption_by_the_agents_word_not_by_skewed_clocks(tmp_path, skew):
    """Known gap of the kill record: the kill's time (the killer's clock) was compared with the status's
    end (the instance's clock), so an instance clock a minute behind made the kill's ``preempted`` status
    a preemption, and one a minute ahead made a real preemption before the kill the kill's. The agent now
    says whether the kill record was there when it wrote the status (``kill_seen``), which the killer
    writes before it ends the instance; the clocks decide only for a status that does not say."""
    from airflow_spot.operators import accounting
    from airflow_spot.storage.protocol import AttemptStatus

    uri = f"file://{tmp_path}/job"
    store, layout = open_store(uri), JobLayout(open_store(uri))
    now = time.time()
    _try1_launched(store, LOCAL_OFFER, "i-1", now - 600)
    layout.write_kill("seg.try1", now - 20)
    launch = AttemptLaunch.read(store, "seg.try1")
    # the status the kill brought about, written 5 s after it by an instance clock `skew` s off
    the_kills = AttemptStatus("seg.try1", "preempted", 143, now - 600, now - 15 + skew, 4, kill_seen=True)
    layout.write_status(the_kills)
    assert SpotSegmentOperator._the_kills(store, "seg.try1", {"ended_at": the_kills.ended_at}, now - 20)
    row = accounting.account_abandoned(store, launch, now=now)
    assert row["outcome"] == "abandoned" and row["ended_at"] == pytest.approx(now - 20)

    # a real preemption 10 s before the kill, by the same skewed clock: the agent found no kill record
    store.delete([JobLayout.status_key("seg.try1"), JobLayout.ledger_key("seg.try1")])
    own = AttemptStatus("seg.try1", "preempted", 75, now - 600, now - 30 + skew, 4, kill_seen=False)
    layout.write_status(own)
    assert not SpotSegmentOperator._the_kills(store, "seg.try1", {"ended_at": own.ended_at}, now - 20)
    row = accounting.account_abandoned(store, launch, now=now)
    assert row["outcome"] == "preempted" and row["ended_at"] == pytest.approx(now - 30 + skew)

    # a status of an older agent says nothing: its clock decides, as before
    old = AttemptStatus("seg.try1", "preempted", 143, now - 600, now - 15, 4)
    assert old.kill_seen is None and not old.before_kill(now - 20) and old.before_kill(now - 10)


def test_instances_whose_agent_never_reaches_the_store_fail_the_segment_after_two(airflow_db, tmp_path):  # noqa: F811
    """An image that does not start the agent (here the interpreter that should run it exits at once) boots
    instances that never write to the job's store: each attempt ends lost. That used to be retried through
    the whole preemption budget, one more instance each time, with nothing saying why. Two such losses in a
    row fail the segment with what to check; the losses are not logged as the pool's preemptions for the
    deployment's other jobs."""
    from airflow.sdk import DAG

    from airflow_spot.storage.availability import AvailabilityLog, deployment_availability_uri

    options = {**backend_options(tmp_path), "python": "/bin/true"}  # "python -m airflow_spot.training.agent" exits 0
    with DAG("agent_never_starts", schedule=None, start_date=datetime(2024, 1, 1), catchup=False) as dag:
        SpotSegmentOperator(
            task_id="segment", command=protocol_command("--step-seconds", "0.1"),
            checkpoint_uri=f"file://{tmp_path}/jobs/{{{{ run_id }}}}", start_step=0, end_step=20, total_steps=20,
            backend="local", backend_options=options, max_preemptions=8, code_retries=1, retries=9,
            retry_delay=timedelta(seconds=0.2), deferrable=True, poll_interval=0.2, startup_timeout=3.0,
            heartbeat_timeout=5.0,
        )
    dr = run_dag(dag)
    store = job_store(tmp_path, dr.run_id)
    rows = LedgerStore(store).rows()
    assert ti_states(dr) == {"segment": ("failed", 2)}, (ti_states(dr), [(r.attempt_id, r.outcome) for r in rows])
    assert [r.outcome for r in rows] == ["lost", "lost"]
    log = AvailabilityLog(open_store(deployment_availability_uri(store.uri, None)))
    assert not [e for e in log.read() if e.kind == "preempted"]


@pytest.mark.parametrize("end_saved", [True, False])
def test_a_failed_termination_of_a_lost_attempts_instance_still_ends_as_the_loss(tmp_path, monkeypatch, end_saved):
    """execute_complete terminates a preempted or lost attempt's instance when the trigger did not: a backend
    error there (a throttled TerminateInstances) used to fail the try with that error instead of the loss,
    skipping the "done all the same" check of a segment whose end checkpoint was saved. The loss stands; the
    next try's let-go terminates the instance again."""
    from airflow_spot.hooks.spot import SpotHook
    from airflow_spot.operators.segment import SegmentPreempted

    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    if end_saved:
        JobLayout(store).checkpoint_store().save(10, lambda f: f.write(b"end-of-segment state"))
    now = time.time()
    _try1_launched(store, LOCAL_OFFER, "i-silent", now - 600)
    asked = []

    def terminate(ids):
        asked.append(ids)
        raise RuntimeError("RequestLimitExceeded (simulated)")

    monkeypatch.setattr(SpotHook, "get_backend", lambda self: SimpleNamespace(terminate=terminate))
    op = SpotSegmentOperator(task_id="seg", command=["python", "x.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=20, backend="local", backend_options=backend_options(tmp_path))
    ti = SimpleNamespace(try_number=1, id=None, max_tries=op.retries, xcom_push=lambda key, value: None)
    event = {"status": "lost", "attempt_id": "seg.try1", "instance_id": "i-silent", "terminated": False,
             "message": "no heartbeat within the timeout", "ended_at": now, "last_step": 10 if end_saved else 3}
    if end_saved:
        assert op.execute_complete({"ti": ti, "run_id": "r"}, event)["outcome"] == "lost"
    else:
        with pytest.raises(SegmentPreempted, match="lost on i-silent"):
            op.execute_complete({"ti": ti, "run_id": "r"}, event)
    assert asked == [["i-silent"]]
    assert LedgerStore(store).read("seg.try1").outcome == "lost"


def test_only_losses_since_the_budgets_start_say_the_agent_never_reaches_the_store(tmp_path):
    """Two lost attempts whose agents never wrote to the store fail the segment; a user who fixed the image
    and cleared the task starts the budgets again, so the losses before the clear do not fail the first new
    loss at once."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_spot.policy.ledger import LedgerRow

    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    now = time.time()
    for i, ended in enumerate((now - 3600, now - 3000, now - 10)):
        LedgerStore(store).write(LedgerRow(
            attempt_id=f"seg.try{i + 1}", instance_id=f"i-{i}", instance_type="g5.xlarge", zone="use1-az1",
            market="spot", price_per_hour=0.5, on_demand_price_per_hour=1.0, started_at=ended - 300,
            ended_at=ended, steps_done=0, outcome="lost", segment_index=0))
    op = SpotSegmentOperator(task_id="seg", command=["python", "x.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=20, backend="local", backend_options=backend_options(tmp_path))
    event = {"message": "no heartbeat"}
    op._fail_if_instances_never_reach_the_store(store, event, since=now - 60)  # one loss since the clear
    with pytest.raises(AirflowFailException, match="without their agent ever writing"):
        op._fail_if_instances_never_reach_the_store(store, event, since=now - 3300)  # two since
