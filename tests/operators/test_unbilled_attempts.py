"""Instance time billed by nobody, or billed wrongly, when an attempt is killed or its task dies (a review of
the kill and leftover billing paths, 2026-11-27). Each test failed on the code as reviewed; its docstring
says the mechanism, where it was in the code and what should happen, which is what the code now does
(``reap`` bills the attempts of ended instances of finished runs; whoever ends an instance waits for the
agent's status before billing, ``accounting.wait_for_statuses``).

Real pieces: the segment operator and its local backend (instances are process groups running the agent,
the preemption injector reclaims them), the ``reap`` command, and for the EC2 case the ec2 backend against
moto's server with the data plane playing the instance (AWS itself cannot exist here). Faked only: the DAG
run's state in Airflow's metadata database (``airflow_lookups.dag_run_states``) and the task instance a
worker would hand the operator.
"""
from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_spot.backends.base import InstanceState, TerminationReason, get_backend
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout

pytestmark = pytest.mark.timeout(180)

PROTOCOL_SCRIPT = str(Path(__file__).resolve().parent / "protocol_script.py")


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_reap_bills_an_attempt_whose_task_died_and_whose_instance_went_before_the_reap(tmp_path, monkeypatch, capsys):
    """Mechanism: a segment launches its attempt (launch record, request, no ledger row yet) and its
    worker dies while it waits (OOM, node lost: no ``on_kill``; or a non-deferrable segment's ``on_kill``,
    which records the kill and terminates the instance but bills nothing, ``segment.py`` ``on_kill``). The
    user then marks the DAG run failed: Airflow fails the running task and skips ``finish``, so
    ``accounting.unaccounted_launches``/``bill_abandoned`` never run. The spot instance is then reclaimed
    (here by the local backend's real preemption injector; its agent writes ``preempted``).
    ``airflow-spot reap`` is the only biller left, and the README says it covers exactly this ("a DAG run
    deleted or marked failed before its finish task ran"), but ``backends/reap.py`` ``run`` only looks at
    ``leftovers`` (live instances) and ``commands/reap.py`` ``JobBilling.before_terminate`` only bills
    ``unaccounted_launches`` on instances it terminates now: an attempt whose instance is already gone is
    billed by nobody, ever (the whole attempt's instance time is missing from the job's cost).

    Should: reap (for runs it found over) also bill the unaccounted attempts of that run's instances that
    are already terminated (the local backend lists them until purged, EC2 describes them for about an
    hour), as the finish task would have: ``account_abandoned`` with no kill, here ``preempted`` at the
    agent's own end. (Billing in ``SpotSegmentOperator.on_kill``, as ``SegmentTrigger.on_kill`` does,
    closes the in-worker kill variant but not the worker death.)"""
    from airflow.sdk import DAG
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_spot.cli import main
    from airflow_spot.commands import airflow_lookups
    from airflow_spot.operators.segment import SpotSegmentOperator

    uri = f"file://{tmp_path}/job"
    options = {"state_dir": str(tmp_path / "instances"), "notice_window_seconds": 1.0,
               "terminate_grace_seconds": 3.0, "preemption": {"mode": "schedule", "after_seconds": [3.0]}}
    with DAG("d", schedule=None, start_date=datetime(2024, 1, 1)):
        op = SpotSegmentOperator(
            task_id="segment_000", command=[sys.executable, PROTOCOL_SCRIPT, "--step-seconds", "0.1"],
            checkpoint_uri=uri, start_step=0, end_step=1000, total_steps=1000, job_name="train",
            backend="local", backend_options=options, deferrable=True)
    now = time.time()
    ti = SimpleNamespace(try_number=1, id=None, max_tries=op.retries, dag_id="d", run_id="r",
                         xcom_push=lambda key, value: None)
    context = {"ti": ti, "run_id": "r", "dag_run": SimpleNamespace(start_date=datetime.fromtimestamp(now - 5, timezone.utc))}
    backend = get_backend("local", **options)
    try:
        # the worker launches the attempt and hands it off; from here on no code of the try runs again
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context)
        attempt_id, instance_id = deferred.value.trigger.attempt_id, deferred.value.trigger.instance_id
        store = open_store(uri)
        layout = JobLayout(store)
        # the spot market reclaims the instance (notice, emergency save, kill) before anyone reaps
        _wait(lambda: InstanceState(backend.describe([instance_id])[instance_id].state).is_terminal(), 60,
              "the instance's reclaim")
        assert TerminationReason(backend.describe([instance_id])[instance_id].reason) is TerminationReason.PREEMPTED
        status = layout.read_status(attempt_id)
        assert status is not None and status.outcome == "preempted"
        assert LedgerStore(store).read(attempt_id) is None  # nobody accounted for it so far

        # the DAG run was marked failed (its finish task skipped): reap, as on ec2 (--runs finished)
        monkeypatch.setattr(airflow_lookups, "dag_run_states", lambda keys: {k: "failed" for k in keys})
        capsys.readouterr()
        assert main(["reap", "--backend-options", json.dumps(options), "--runs", "finished"]) == 0
        out = capsys.readouterr().out
        row = LedgerStore(store).read(attempt_id)
        assert row is not None, (
            f"attempt {attempt_id} ran on {instance_id} from {status.started_at:.0f} to {status.ended_at:.0f} "
            f"({status.ended_at - status.started_at:.1f} s) and nobody billed it: its task died, its run was "
            f"marked failed (no finish task), and reap only bills attempts on instances still live. reap said: "
            f"{out.strip()!r}")
        assert row.outcome == "preempted" and row.ended_at == pytest.approx(status.ended_at)
    finally:
        backend.terminate([i.instance_id for i in backend.list_instances({})
                           if not InstanceState(i.state).is_terminal()])


#: a training command with the protocol's emergency save: periodic checkpoints every 40 steps, and on
#: SIGTERM (the instance's shutdown) a save that takes ``SAVE_SECONDS`` to write before it commits
SAVE_SECONDS = 2.0
TRAIN_SCRIPT = textwrap.dedent(f'''
    import os, signal, sys, time
    from airflow_spot.storage.checkpoint import CheckpointStore
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import PREEMPTED_EXIT_CODE, Heartbeat, JobLayout
    from airflow_spot.training import env as E

    store = open_store(os.environ[E.JOB_URI])
    attempt = os.environ[E.ATTEMPT_ID]
    end = int(os.environ[E.END_STEP])
    layout = JobLayout(store)
    ckpt = CheckpointStore(store.child("checkpoints"), writer=attempt)
    step = max(ckpt.latest_step() or 0, int(os.environ[E.START_STEP]))
    committed = None
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(time.time()))
    first = time.time()

    def beat():
        layout.write_heartbeat(Heartbeat(attempt, step, time.time(), 0.05, last_committed_step=committed,
                                         first_step_at=first))

    def commit():
        global committed
        ckpt.save(step, lambda f: f.write(str(step).encode()))
        committed = step
        beat()

    while step < end:
        if stop:
            time.sleep({SAVE_SECONDS})  # the emergency save's write
            commit()
            sys.exit(PREEMPTED_EXIT_CODE)
        time.sleep(0.05)
        step += 1
        beat()
        if step % 40 == 0:
            commit()
''')


def test_the_triggers_on_kill_bills_the_steps_its_emergency_checkpoint_kept(tmp_path, monkeypatch):
    """Mechanism: a user marks a deferred segment failed (or success, or clears it); the triggerer calls
    ``SegmentTrigger.on_kill`` (``triggers/segment.py``), which records the kill, terminates the instance
    and at once bills the attempt with ``accounting.account_abandoned``. On EC2 ``TerminateInstances``
    returns immediately: the instance is only shutting down, its agent forwards the SIGTERM and the
    training process writes its emergency checkpoint, then the agent writes ``preempted`` with
    ``last_committed_step`` at that checkpoint. ``account_abandoned`` ran before either: no status, so its
    kept steps come from the last heartbeat's ``last_committed_step`` (the previous periodic save), and the
    steps the emergency save kept are billed as lost. The row is final: ``account_abandoned`` returns
    early when a row exists, and ``unaccounted_launches`` skips the attempt, so the finish task and reap
    never correct it. (The local backend's ``terminate`` waits for the process group, so its status is
    there in time; ``airflow_spot.backends.ec2`` ``terminate`` does not wait. The finish task's and reap's
    ``record_kills`` -> ``terminate`` -> ``bill_abandoned`` on ec2 share the same race.)

    Should: the row's ``steps_done`` is what the checkpoint store finally holds from this attempt (the
    agent's status), ``steps_lost`` 0 here: bill after the agent's status lands or the instance is
    terminated (bounded, within the triggerer's ``on_kill_timeout``), or let a later biller (the finish
    task) rewrite an ``abandoned`` row whose attempt's status now shows more committed steps
    (``operators/accounting.py`` ``account_abandoned``)."""
    pytest.importorskip("moto")
    from airflow_spot.backends.base import LaunchSpec, launch_token
    from airflow_spot.hooks.spot import SpotHook
    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.policy.offers import Market, Offer
    from airflow_spot.storage.protocol import SegmentRequest
    from airflow_spot.testing import moto_ec2
    from airflow_spot.testing.ec2_dataplane import Ec2DataPlane
    from airflow_spot.triggers import segment as trigger_module
    from airflow_spot.triggers.segment import SegmentTrigger

    monkeypatch.setattr(trigger_module, "_HOOKS", {})  # no hook of an earlier test's moto server
    region = "us-east-1"
    offer = Offer("g5.xlarge", region, "us-east-1b", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    uri = f"file://{tmp_path}/job"
    options = {"regions": [region], "image_id": "ami-12345678", "python": sys.executable}
    with moto_ec2.moto_ec2(), Ec2DataPlane(tmp_path / "plane", region=region, grace_seconds=15.0) as plane:
        backend = SpotHook(backend="ec2", backend_options=options).get_backend()
        info = backend.launch(LaunchSpec(offer, uri, idempotency_token=launch_token(tmp_path), idle_timeout_seconds=60))
        store = open_store(uri)
        layout = JobLayout(store)
        now = time.time()
        AttemptLaunch("seg.try1", 0, 0, 100000, info.instance_id, offer.to_dict(), now, now, False, 1, "seg",
                      resume_step=0).write(store)
        layout.write_request(info.instance_id, SegmentRequest("seg.try1", uri, 0, 0, 100000,
                                                              [sys.executable, str(script)], created_at=now))

        def trained_past_a_save() -> bool:
            hb = layout.read_heartbeat("seg.try1")
            return hb is not None and hb.last_committed_step is not None and hb.step >= hb.last_committed_step + 15

        _wait(trained_past_a_save, 120, "training past a periodic checkpoint")
        trigger = SegmentTrigger(job_uri=uri, attempt_id="seg.try1", instance_id=info.instance_id,
                                 requested_at=now, backend="ec2", backend_options=options, aws_conn_id="aws_default")
        asyncio.run(trigger.on_kill())  # the user killed the deferred task
        _wait(lambda: layout.read_status("seg.try1") is not None, 60, "the agent's status after the emergency save")
        assert plane.errors == []
    status = layout.read_status("seg.try1")
    kept = layout.checkpoint_store().latest()
    assert status.outcome == "preempted" and status.kill_seen is True
    assert kept.step == status.last_committed_step  # the emergency save committed, by this attempt
    row = LedgerStore(store).read("seg.try1")
    assert row is not None and row.outcome == "abandoned"
    assert row.steps_done == kept.step, (
        f"the kill's ledger row keeps {row.steps_done} steps and counts {row.steps_lost} lost, but the attempt's "
        f"emergency checkpoint committed step {kept.step} (agent status {status.outcome}, kill_seen="
        f"{status.kill_seen}): on_kill billed from the heartbeat before the save landed, and the row is never "
        "rewritten")
    assert row.steps_lost == 0
