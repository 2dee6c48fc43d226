"""The segment operator waiting in the worker (non-deferrable), failing early on a store it cannot
write, skipping a segment that is already done, and releasing its instance when killed."""
from __future__ import annotations

import pytest

from airflow_fixtures import (  # noqa: F401
    airflow_threads_released,
    FAST_SEGMENT_OPTIONS,
    airflow_db,
    backend_options,
    build_dag,
    instance_count,
    leftover_processes,
    protocol_command,
    run_dag,
    xcom_value,
    summary,
    ti_states,
)

pytestmark = pytest.mark.timeout(180)


def test_non_deferrable_mode_survives_a_preemption(airflow_db, tmp_path):  # noqa: F811
    dag = build_dag(
        "mode_worker",
        tmp_path,
        command=protocol_command("--step-seconds", "0.03"),
        total_steps=100,
        steps_per_segment=100,
        backend_options=backend_options(tmp_path, [1.0, None]),
        max_preemptions=2,
        segment_options={**FAST_SEGMENT_OPTIONS, "deferrable": False},
    )
    dr = run_dag(dag)
    assert ti_states(dr)["train.segment_000"] == ("success", 2)
    s = summary(tmp_path, dr.run_id)
    assert s["preemptions"] == 1 and s["completed"]
    assert not leftover_processes(tmp_path)
    # each attempt's outcome and the job's totals are in XCom
    attempt = xcom_value(dr, "train.segment_000", "attempt")
    assert attempt["outcome"] == "completed" and attempt["attempt_id"] == "train.segment_000.try2"
    assert {"instance_id", "zone", "market", "price_per_hour", "steps_done", "job_cost_so_far"} <= set(attempt)
    final = xcom_value(dr, "train.finish", "summary")
    assert final["preemptions"] == 1 and final["cost"] > 0 and "savings" in final


def test_unwritable_checkpoint_uri_fails_before_launching(airflow_db, tmp_path):  # noqa: F811
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    dag = build_dag(
        "mode_unwritable",
        tmp_path,
        command=protocol_command(),
        total_steps=10,
        steps_per_segment=10,
        checkpoint_uri=f"file://{blocker}/{{{{ run_id }}}}",
        backend_options=backend_options(tmp_path),
        max_preemptions=3,
    )
    dr = run_dag(dag)
    states = ti_states(dr)
    assert states["train.segment_000"] == ("failed", 1), states  # no retry: a config error, not bad luck
    assert instance_count(tmp_path) == 0
    summary_of_failure = xcom_value(dr, "train.finish", "summary")  # the final task still reports
    assert summary_of_failure["completed"] is False and summary_of_failure["attempts"] == 0


def test_a_done_segment_is_skipped_on_rerun(airflow_db, tmp_path):  # noqa: F811
    kwargs = dict(
        command=protocol_command("--step-seconds", "0.01"),
        total_steps=40,
        steps_per_segment=20,
        checkpoint_uri=f"file://{tmp_path}/jobs/fixed",  # the same job root for both runs
        backend_options=backend_options(tmp_path),
    )
    first = run_dag(build_dag("mode_skip", tmp_path, **kwargs))
    assert str(getattr(first.state, "value", first.state)) == "success"
    launched = instance_count(tmp_path)
    second = run_dag(build_dag("mode_skip", tmp_path, **kwargs))
    assert str(getattr(second.state, "value", second.state)) == "success"
    assert instance_count(tmp_path) == launched  # nothing was launched for finished segments
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.ledger_store import LedgerStore

    assert len(LedgerStore(open_store(f"file://{tmp_path}/jobs/fixed")).rows()) == 2  # from the first run only


def test_on_kill_terminates_the_awaited_instance(tmp_path):
    from airflow_spot.backends.base import InstanceState, LaunchSpec, get_backend
    from airflow_spot.backends.local_state import group_alive
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.policy.offers import Market, Offer

    options = backend_options(tmp_path)
    backend = get_backend("local", **options)
    offer = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
    info = backend.launch(LaunchSpec(offer, f"file://{tmp_path}/job", "kill-test", idle_timeout_seconds=60))
    op = SpotSegmentOperator(
        task_id="seg", command=protocol_command(), checkpoint_uri=f"file://{tmp_path}/job",
        start_step=0, end_step=10, total_steps=10, backend="local", backend_options=options,
    )
    op._instance_id = info.instance_id  # what execute() records before it waits in the worker
    op.on_kill()
    assert InstanceState(backend.describe([info.instance_id])[info.instance_id].state) is InstanceState.TERMINATED
    assert not group_alive(backend.record(info.instance_id).pgid)


def test_a_kill_in_the_worker_is_recorded_so_the_finish_task_bills_it_abandoned_not_preempted(tmp_path):
    """A segment killed while it waits in a worker (non-deferrable) ends its instance in on_kill; the
    training process then saves and exits as on a preemption, and its agent writes ``preempted``. No
    execute_complete follows: the finish task bills it later, and took that status for the attempt's own
    end, a preemption the job never had (spent from no budget, but on the page and in the summary). The
    kill's time is now recorded in the store before the termination."""
    import sys
    import time

    from airflow_spot.backends.base import LaunchSpec, get_backend
    from airflow_spot.operators import accounting
    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.policy.offers import Market, Offer
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout, SegmentRequest

    options = backend_options(tmp_path)
    backend = get_backend("local", **options)
    uri = f"file://{tmp_path}/job"
    store, layout = open_store(uri), JobLayout(open_store(uri))
    offer = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
    info = backend.launch(LaunchSpec(offer, uri, "kill-record-test", idle_timeout_seconds=60))
    try:
        now = time.time()
        launch = AttemptLaunch("seg.try1", 0, 0, 1000, info.instance_id, offer.to_dict(), now, now, False, 1, "seg")
        launch.write(store)
        layout.write_request(info.instance_id, SegmentRequest(
            "seg.try1", uri, 0, 0, 1000, protocol_command("--step-seconds", "0.2"), created_at=now))
        deadline = time.time() + 60
        while layout.read_heartbeat("seg.try1") is None and time.time() < deadline:
            time.sleep(0.2)
        assert layout.read_heartbeat("seg.try1") is not None, "the attempt never started"
        op = SpotSegmentOperator(task_id="seg", command=protocol_command(), checkpoint_uri=uri, start_step=0,
                                 end_step=1000, total_steps=1000, backend="local", backend_options=options)
        op._instance_id, op._killable = info.instance_id, (uri, "seg.try1")  # what _wait records
        op.on_kill()
        killed_at = layout.read_kill("seg.try1")
        assert killed_at is not None and killed_at <= time.time()
        while layout.read_status("seg.try1") is None and time.time() < deadline:
            time.sleep(0.2)
        status = layout.read_status("seg.try1")
        assert status is not None and status.outcome == "preempted" and status.ended_at >= killed_at  # the kill's
        assert status.kill_seen is True  # and its agent says so: the record was there before the termination
        row = accounting.account_abandoned(store, launch, now=time.time())  # as the finish task bills it
        assert row["outcome"] == "abandoned" and row["ended_at"] == killed_at
    finally:
        backend.terminate([info.instance_id])


def test_a_store_whose_checkpoints_all_fail_to_verify_fails_without_retry_or_launch(airflow_db, tmp_path):  # noqa: F811
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    root = tmp_path / "jobs" / "broken"
    ckpts = JobLayout(open_store(f"file://{root}")).checkpoint_store()
    ckpts.save(5, lambda f: f.write(b"weights"))
    (manifest,) = root.glob("checkpoints/*/MANIFEST.json")
    manifest.write_text(manifest.read_text().replace('"step": 5', '"step": 6'))  # no longer matches its checksum
    dag = build_dag(
        "mode_broken_store", tmp_path, command=protocol_command(), total_steps=10, steps_per_segment=10,
        checkpoint_uri=f"file://{root}", backend_options=backend_options(tmp_path), max_preemptions=3,
    )
    dr = run_dag(dag)
    assert ti_states(dr)["train.segment_000"] == ("failed", 1)  # a retry would find the same store
    assert instance_count(tmp_path) == 0  # nothing launched to start again from step 0
    assert manifest.exists()  # and nothing deleted


def test_a_later_segment_refuses_to_start_again_from_step_zero_when_the_store_lost_its_checkpoints(tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_spot.operators.segment import SpotSegmentOperator

    root = tmp_path / "job"  # the earlier segments' checkpoints were here; the root is gone
    op = SpotSegmentOperator(
        task_id="seg", command=protocol_command(), checkpoint_uri=f"file://{root}", segment_index=2,
        start_step=20, end_step=30, total_steps=30, backend="local", backend_options=backend_options(tmp_path),
    )
    with pytest.raises(AirflowFailException, match="holds no checkpoint at all"):
        op.execute(context={})
    assert instance_count(tmp_path) == 0


def test_a_kill_after_the_request_but_before_the_wait_is_recorded_too(tmp_path, monkeypatch):
    """Review of the kill record: on_kill ends the instance from the moment execute has it, but the kill
    was recorded only once the wait began. A kill in between (the task state record's and the link's calls
    to the execution API) ended an instance that had its request: its agent's ``preempted`` was then billed
    as a preemption by the finish task. Recorded from the launch record's write on."""
    import time
    from types import SimpleNamespace

    from airflow_spot.backends.base import InstanceInfo, InstanceState
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.policy.offers import Market, Offer
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    offer = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.ON_DEMAND, 1.0, 1.0, "A10G", 1, 24.0)
    terminated = []

    class KilledBeforeTheWait(SpotSegmentOperator):
        def _warm_instances(self, context, store=None, rows=None):
            return []

        def _get_instance(self, context, store, plan, alive, **kwargs):
            return InstanceInfo("i-new", InstanceState.RUNNING, offer, store.uri, launched_at=time.time()), False

        def _remember_attempt(self, context, launch):
            self.on_kill()  # SIGTERM arrives here
            raise RuntimeError("killed")

    monkeypatch.setattr(SpotSegmentOperator, "dag_id", property(lambda self: "d"))
    uri = f"file://{tmp_path}/job"
    op = KilledBeforeTheWait(task_id="seg", command=protocol_command(), checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=10, backend="local", backend_options=backend_options(tmp_path),
                             probe_spot=False)
    monkeypatch.setattr(type(op.hook), "get_backend",
                        lambda self: SimpleNamespace(terminate=lambda ids: terminated.extend(ids)))
    context = {"ti": SimpleNamespace(try_number=1, id=None, max_tries=0), "run_id": "r", "task_state_store": None}
    with pytest.raises(RuntimeError, match="killed"):
        op._run_segment(context)
    assert terminated == ["i-new"]
    killed_at = JobLayout(open_store(uri)).read_kill("seg.try1")
    assert killed_at is not None and killed_at <= time.time()
