"""Review: defects that appear only when many jobs share one deployment (one Airflow, one bucket, one
availability log, one local-backend state directory). Each test fails on the defect it names and passes
once that is fixed; interleavings are forced by construction, never by timing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from airflow_spot.backends.base import InstanceInfo, InstanceState, LaunchSpec
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.policy.observations import PoolEvent, ledger_events, pool_views
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.availability import COMPACT_AFTER_HOURS, AvailabilityLog
from airflow_spot.storage.object_store import open_store

OFFER = Offer("g5.xlarge", "us-east-1", "us-east-1a", Market.SPOT, 0.40, 1.006, "A10G", 1, 24.0)
HOUR = 3600.0


# --------------------------------------------------------------------------------------------------------
# 1. two SpotTraining groups of one DAG with the same task_id (in different TaskGroups) share instance tags


class TagFilteringBackend:
    """A backend holding other jobs' instances: lists by tags as the real ones do, records terminations."""

    def __init__(self, instances):
        self.instances = list(instances)
        self.terminated: list[str] = []

    def list_instances(self, tags=None):
        wanted = dict(tags or {})
        return [i for i in self.instances if all(i.tags.get(k) == v for k, v in wanted.items())]

    def stopped_instances(self, tags=None):
        return []

    def describe(self, ids):
        return {i.instance_id: i for i in self.instances if i.instance_id in ids}

    def terminate(self, ids):
        self.terminated += list(ids)


def test_a_finish_task_does_not_terminate_the_instances_of_a_same_named_job_in_another_task_group(
        tmp_path, monkeypatch):
    """Mechanism: ``operators/training.py:SpotTraining`` passes the bare ``task_id`` as ``job_name`` to every
    segment and to the finish task, and ``operators/segment.py:job_tags`` tags instances with
    (dag, run, job_name) only. A DAG that trains two models, each ``SpotTraining(task_id="train")`` inside its
    own TaskGroup ("model_a", "model_b"; Airflow accepts it: the full ids are ``model_a.train.*`` and
    ``model_b.train.*``, and the two checkpoint roots differ, so ``_check_own_job_root`` passes), gives both
    jobs the same tags. ``SpotJobSummaryOperator.execute`` (model_a's finish) lists its "own" instances by
    those tags and terminates model_b's running training instance; the same collision makes
    ``SpotSegmentOperator._warm_instances`` offer model_b's instance to model_a's next segment as a warm one.

    Its finish task also bills model_b's instance into model_a's ledger (``accounting.bill_unrecorded``: an
    instance of "the job" that no row names is billed as idle from its launch).

    Expected: a job's instances are told apart from another job's of the same DAG run (e.g. the job name is
    the group's full id, ``model_a.train``), so model_a's finish task terminates nothing of model_b."""
    from airflow.sdk import DAG, TaskGroup

    from airflow_spot.hooks.spot import SpotHook
    from airflow_spot.operators import SpotTraining
    from airflow_spot.operators.segment import TAG_TASK, SpotSegmentOperator
    from airflow_spot.operators.training import SpotJobSummaryOperator
    from airflow_spot.storage.protocol import JobLayout

    with DAG("two_models", schedule=None) as dag:
        for model in ("model_a", "model_b"):
            with TaskGroup(model):
                SpotTraining(task_id="train", command=[sys.executable, "-c", "pass"], total_steps=10,
                             steps_per_segment=10, checkpoint_uri=f"file://{tmp_path}/{model}/run1")
    finish_a = dag.get_task("model_a.train.finish")
    segment_b = dag.get_task("model_b.train.segment_000")
    assert isinstance(finish_a, SpotJobSummaryOperator) and isinstance(segment_b, SpotSegmentOperator)

    context_run = {"run_id": "run1"}
    # model_b's segment is training on this instance right now, tagged as its launch tags it
    b_instance = InstanceInfo("i-model-b", InstanceState.RUNNING, OFFER, f"file://{tmp_path}/model_b/run1",
                              tags={**segment_b._tags(context_run), TAG_TASK: segment_b.task_id},
                              launched_at=time.time() - 600)
    backend = TagFilteringBackend([b_instance])
    monkeypatch.setattr(SpotHook, "get_backend", lambda self: backend)
    finish_a._compact_availability = lambda hook, store: None
    store_a = open_store(f"file://{tmp_path}/model_a/run1")
    JobLayout(store_a).checkpoint_store().save(10, lambda f: f.write(b"state"))
    pushed = {}
    context = {"run_id": "run1", "ti": SimpleNamespace(xcom_push=lambda key, value: pushed.update({key: value})),
               "dag_run": None}
    summary = finish_a.execute(context)

    assert "i-model-b" not in backend.terminated, (
        f"model_a's finish task terminated model_b's running instance (both jobs are tagged "
        f"{segment_b._tags(context_run)})")
    assert "i-model-b" not in summary["terminated_at_end"]
    assert summary["cost"] == 0, "model_b's instance was billed as idle time in model_a's store"


# --------------------------------------------------------------------------------------------------------
# 2. another job's compaction changes what a running job concludes, when its ledger has a lost attempt


def test_another_jobs_compaction_does_not_change_what_a_job_with_a_lost_attempt_concludes(tmp_path):
    """Mechanism: ``storage/availability.py:AvailabilityLog.compact`` (run by every job's finish task on the
    shared log) drops the up-events inside a run of ups, promising that a decision reading the log
    concludes the same "as long as the down-events it merges are in the log too (the operators write each
    refusal and preemption there)". But a job merges its ledger through
    ``policy/observations.py:ledger_events``, which turns a *lost* attempt into a ``preempted`` down-event,
    and ``operators/segment.py:execute_complete`` writes only PREEMPTED outcomes to the deployment log
    (a lost one "says nothing of the pool's capacity"), as do the attempts billed later by
    ``accounting.bill_abandoned``. So job A, still running, lost an attempt in pool P at T+1.1 h; job B's
    probes saw P up every 30 min from T to T+5 h. Before compaction A sees P up since T+1.5 h (B's first
    sighting after A's loss); after any other job's finish task compacted the log, P is up only since T+5 h:
    A's observed up-time of P shrinks by 3.5 h, which the deadline rule and ranking read.

    Expected: the pool views of a job that merges its own ledger are the same before and after another
    job's compaction (log the down-event of a lost attempt too, or have compaction keep what ledgers need).
    Fixed the first way round: a lost attempt is no down-event in the job's own view either (it says nothing
    of the pool's capacity), so both views see P up since B's first sighting."""
    pool = OFFER.pool
    now = time.time()
    t0 = now - 24 * HOUR
    log = AvailabilityLog(open_store(str(tmp_path / "availability")))
    # job B (another DAG) probes P every 30 minutes for 5 hours: up every time
    log.extend(PoolEvent(pool, "probe-up", t0 + k * 1800.0, "other_dag.train") for k in range(11))
    # job A launched in P (its launch is logged), and the attempt was lost an hour later (not logged)
    log.append(PoolEvent(pool, "launched", t0 + 0.25 * HOUR, "dag_a.train"))
    lost = LedgerRow(attempt_id="segment_000.try1", instance_id="i-a1", instance_type="g5.xlarge",
                     zone="us-east-1a", market="spot", price_per_hour=0.4, on_demand_price_per_hour=1.006,
                     started_at=t0 + 0.25 * HOUR, ended_at=t0 + 1.1 * HOUR, steps_done=0, outcome="lost")
    own = ledger_events([lost])

    before = pool_views(own + log.read(until=now), now)[pool]
    dropped = log.compact(before=now - COMPACT_AFTER_HOURS * HOUR)  # another job's finish task
    after = pool_views(own + log.read(until=now), now)[pool]

    assert dropped > 0
    assert before.up_since == pytest.approx(t0)  # the lost attempt is no loss of the pool
    assert after.up_since == before.up_since, (
        f"after another job's compaction, job A sees {pool} up since {(after.up_since - t0) / HOUR:.2f} h "
        f"instead of {(before.up_since - t0) / HOUR:.2f} h after T")


# --------------------------------------------------------------------------------------------------------
# 3. the local backend kills whatever session now holds a dead instance's recycled pid


@pytest.fixture
def bystander():
    """A process leading a session of its own, as another instance's agent (or any daemon) does."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_refreshing_a_dead_instance_does_not_kill_the_session_that_reuses_its_pid(tmp_path, bystander):
    """Mechanism: ``backends/local.py:LocalBackend._mark_dead`` (reached from ``list_instances``,
    ``describe`` and ``purge`` through ``_refresh``) sees that the recorded agent is gone (``ProcessRef``
    compares the pid's start time, precisely because pids are recycled) and then calls
    ``local_state.kill_group(record.pgid, SIGKILL)`` on the bare number, which signals every process whose
    session id is that number. A record is refreshed only by a listing whose tags match it, so the record of
    an instance whose agent died (OOM, a host restart of the worker) can stay "running" for days until
    ``airflow-spot reap`` lists everything; by then, on a machine running many instances, the pid has been
    recycled and leads another session: another job's agent, or an unrelated daemon. The refresh SIGKILLs it.
    (``terminate`` does the same for a terminal record whose old pgid "still" has members.)

    Expected: a session whose leader is not the recorded agent (pid == pgid alive with another start time)
    is never signalled; only the dead agent's own orphans are."""
    from airflow_spot.backends.local import LocalBackend
    from airflow_spot.backends.local_state import InstanceRecord, ProcessRef

    backend = LocalBackend(state_dir=str(tmp_path / "state"), terminate_grace_seconds=1.0)
    pid = bystander.pid
    started = psutil.Process(pid).create_time()
    # an instance launched long ago whose agent had this pid, then died without anyone refreshing its record
    info = InstanceInfo("local-0123456789ab", InstanceState.RUNNING, OFFER, f"file://{tmp_path}/old-job",
                        tags={"airflow-spot:dag": "old_dag", "airflow-spot:run": "r"}, launched_at=started - 86400)
    backend.state.instance_dir(info.instance_id).mkdir(parents=True)
    backend.state.write(InstanceRecord(info=info, agent=ProcessRef(pid, started - 86400), pgid=pid, token="old"))

    listed = {i.instance_id: i for i in backend.list_instances()}  # what airflow-spot reap does first

    assert InstanceState(listed[info.instance_id].state).is_terminal()  # the dead instance is found dead
    time.sleep(0.2)
    assert bystander.poll() is None, (
        f"refreshing the dead instance's record SIGKILLed process {pid}, which only reuses its old pid "
        f"(exit {bystander.returncode})")


# --------------------------------------------------------------------------------------------------------
# 4. a DAG run deleted and created again (same run_id) repeats its launch tokens: the local backend answers
#    them with the old run's terminated instance


def test_a_spent_launch_token_gets_a_live_instance_from_the_local_backend(tmp_path):
    """Mechanism: ``operators/segment.py:_launch_first`` builds the idempotency token from (dag, run_id,
    task_id, try_number, pool, market). Try numbers restart when a DAG run is deleted and created again with
    the same run id (a scheduled run's id repeats: ``scheduled__<date>``), which ``attempt_id`` already
    handles for the attempt's objects, but not for the token: the recreated run's try 1 asks with the old
    run's try-1 token. The EC2 backend answers a token whose instance ended with a fresh instance
    (``ec2.py:derived_token`` generations); ``backends/local.py:LocalBackend.launch`` returns the known
    record whatever its state, so the new segment is handed the old run's *terminated* instance, writes its
    request there, and its trigger reports it lost (a preemption spent, a retry) for every segment.

    Expected: the local backend, like the EC2 one, answers a token whose instance has ended with a live
    instance (a repeated call while it lives still gets the same one). (Putting ``ti.id`` into the operator's
    token would fix the recreated run for both backends as well, but this test checks the backend.)"""
    from airflow_spot.backends.local import LocalBackend

    backend = LocalBackend(state_dir=str(tmp_path / "state"), terminate_grace_seconds=3.0)
    spec = LaunchSpec(offer=OFFER, job_uri=f"file://{tmp_path}/job", idempotency_token="dag|scheduled__x|seg0|try1",
                      tags={"airflow-spot:dag": "dag", "airflow-spot:run": "scheduled__x"}, idle_timeout_seconds=30.0)
    launched = []
    try:
        old = backend.launch(spec)  # the deleted run's try 1
        launched.append(old.instance_id)
        backend.terminate([old.instance_id])  # its finish task (or reap) ended it
        again = backend.launch(spec)  # the recreated run's try 1: the same token
        launched.append(again.instance_id)
        assert not InstanceState(again.state).is_terminal(), (
            f"the launch was answered with {again.instance_id}, which is {InstanceState(again.state).value}")
    finally:
        live = [i for i, info in backend.describe(launched).items() if not InstanceState(info.state).is_terminal()]
        if live:
            backend.terminate(live)
