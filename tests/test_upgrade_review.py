"""Upgrade review (an Airflow admin upgrading airflow-spot in a running deployment, 7e3fdcd -> main).

While the upgrade happens, jobs are mid-run: instances the previous release launched are running, its
triggers are deferred, its records are in the stores. Each failing test here is a concrete thing the upgrade
breaks; artifacts of the previous release are built in the test with that release's exact tags / JSON shapes
(copied from 7e3fdcd and named so in a comment), so the tests do not need the old code at test time.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from airflow_spot.backends.base import InstanceState, LaunchSpec, get_backend, launch_token
from airflow_spot.policy.offers import Market, Offer

DAG_ID = "train_resnet"
RUN_ID = "manual__2026-11-27T00:00:00+00:00"
JOB = "train"
LOCAL_OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.40, 1.006, "A10G", 1, 24.0)


def _old_job_tags(dag_id: str, run_id: str, job_name: str) -> dict[str, str]:
    """``airflow_spot.operators.segment.job_tags`` of 7e3fdcd, verbatim: no ``airflow-spot:job-uri``."""
    return {"airflow-spot:dag": dag_id, "airflow-spot:run": run_id, "airflow-spot:job": job_name}


@pytest.fixture
def local_backend(tmp_path):
    """A local backend on a private state dir; whatever it launched is terminated after the test."""
    options = {"state_dir": str(tmp_path / "state"), "terminate_grace_seconds": 3.0}
    backend = get_backend("local", **options)
    yield backend, options
    live = [i.instance_id for i in backend.list_instances() if not InstanceState(i.state).is_terminal()]
    if live:
        backend.terminate(live)


def _launch_as_old_release(backend, job_uri: str, task_id: str, idle: float = 300.0):
    """What ``SpotSegmentOperator._launch_first`` of 7e3fdcd launched: ``tags={**job_tags(dag, run, job),
    TAG_TASK: task_id}`` with the old three-tag ``job_tags``; the local backend keeps ``spec.tags`` as they are."""
    return backend.launch(LaunchSpec(
        offer=LOCAL_OFFER, job_uri=job_uri, idempotency_token=launch_token(DAG_ID, RUN_ID, task_id, "try1"),
        tags={**_old_job_tags(DAG_ID, RUN_ID, JOB), "airflow-spot:task": task_id}, idle_timeout_seconds=idle))


# --------------------------------------------------------------------------------------------------------------
# 1. local backend: instances the old release launched carry no airflow-spot:job-uri tag


def test_finish_task_ends_a_local_instance_the_previous_release_launched(local_backend, tmp_path, monkeypatch):
    """Mechanism: ``job_tags`` now adds ``airflow-spot:job-uri``, and the finish task lists
    ``backend.list_instances(tags=job_tags(...))``. The ec2 backend always stamped that key itself (its
    ``TAG_JOB``), but the local backend keeps only ``spec.tags``: an instance launched by 7e3fdcd has just
    dag/run/job/task, so the local ``list_instances`` filter (every wanted tag must equal) drops it. The
    upgraded finish task neither terminates it (its agent trains on / idles after the run is over) nor bills
    its idle time. Expected: an instance of this job launched before the upgrade is still ended."""
    from airflow_spot.operators.training import SpotJobSummaryOperator
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    backend, options = local_backend
    uri = f"file://{tmp_path}/store/{DAG_ID}/{RUN_ID}"
    store = open_store(uri)
    JobLayout(store).checkpoint_store().save(10, lambda f: f.write(b"state"))  # the job completed
    old = _launch_as_old_release(backend, store.uri, f"{JOB}.segment_000")
    assert not InstanceState(backend.describe([old.instance_id])[old.instance_id].state).is_terminal()

    monkeypatch.setattr(SpotJobSummaryOperator, "dag_id", property(lambda self: DAG_ID))
    op = SpotJobSummaryOperator(task_id=f"{JOB}.finish", checkpoint_uri=uri, job_name=JOB, total_steps=10,
                                segments=1, backend="local", backend_options=options)
    op._compact_availability = lambda hook, store: None
    pushed: dict = {}
    now = time.time()
    summary = op.execute({"run_id": RUN_ID, "ti": SimpleNamespace(xcom_push=lambda key, value: pushed.update({key: value})),
                          "dag_run": SimpleNamespace(start_date=datetime.fromtimestamp(now - 3600, timezone.utc))})
    state = backend.describe([old.instance_id])[old.instance_id].state
    assert old.instance_id in summary["terminated_at_end"] and InstanceState(state).is_terminal(), (
        f"the upgraded finish task left instance {old.instance_id} (launched by the previous release for this very "
        f"job, store {store.uri}) running: it is {state}; it ended {summary['terminated_at_end']}")


def test_a_segment_reuses_the_warm_local_instance_the_previous_release_launched(local_backend, tmp_path,
                                                                                 monkeypatch):
    """Mechanism: the same filter in ``SpotSegmentOperator._warm_instances``: the warm local instance that
    segment_000 (run by the old worker) left for segment_001 is invisible to the upgraded worker, which
    launches a second instance (restart paid again) while the old one idles until its idle timeout.
    Expected: the job's own warm instance from before the upgrade is offered as warm."""
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.object_store import open_store

    backend, options = local_backend
    uri = f"file://{tmp_path}/store/{DAG_ID}/{RUN_ID}"
    store = open_store(uri)
    old = _launch_as_old_release(backend, store.uri, f"{JOB}.segment_000")
    monkeypatch.setattr(SpotSegmentOperator, "dag_id", property(lambda self: DAG_ID))
    op = SpotSegmentOperator(task_id=f"{JOB}.segment_001", command=["python3", "train.py"], checkpoint_uri=uri,
                             start_step=10, end_step=20, total_steps=40, job_name=JOB, backend="local",
                             backend_options=options)
    warm = [i.instance_id for i in op._warm_instances({"run_id": RUN_ID}, store, [])]
    assert old.instance_id in warm, (
        f"the job's warm instance {old.instance_id}, launched by the previous release, is not found: {warm}")


# --------------------------------------------------------------------------------------------------------------
# 2. the finish task opens the store before it ends the job's instances


def test_finish_task_ends_the_jobs_instances_even_when_the_store_cannot_be_opened(local_backend, monkeypatch):
    """Mechanism: ``SpotJobSummaryOperator.execute`` now computes the instance filter as ``job_tags(...,
    hook.get_store(self.checkpoint_uri).uri)`` on its first lines, before listing and terminating; the
    previous release listed by dag/run/job alone and opened the store inside the ``try`` after it ("billing
    is best effort: the summary and the instances' end come first"; "it failed above: the task fails on it,
    after the end"). A store that cannot be opened now fails the task before any instance is ended. The
    upgrade itself brings that about: ``SpotHook._s3_hook`` now refuses a missing ``aws_conn_id`` for
    ``s3://`` stores (the previous release let S3Hook fall back to the machine's credentials), so a
    local-backend deployment with an ``s3://`` store and no ``aws_default`` connection finds, after the
    upgrade, every finish task failing and its instances left running. Expected: the instances are ended
    first, then the task fails on the store."""
    from airflow_spot.operators.segment import TAG_TASK, job_tags
    from airflow_spot.operators.training import SpotJobSummaryOperator

    backend, options = local_backend
    uri = "s3://team-checkpoints/train_resnet/run"
    # a job launched by today's code: its instance carries the new job-uri tag (the store's uri as is)
    inst = backend.launch(LaunchSpec(
        offer=LOCAL_OFFER, job_uri=uri, idempotency_token=launch_token("upgrade-review", "s3"),
        tags={**job_tags(DAG_ID, RUN_ID, JOB, uri), TAG_TASK: f"{JOB}.segment_000"}, idle_timeout_seconds=300.0))

    monkeypatch.setattr(SpotJobSummaryOperator, "dag_id", property(lambda self: DAG_ID))
    op = SpotJobSummaryOperator(task_id=f"{JOB}.finish", checkpoint_uri=uri, job_name=JOB, total_steps=10,
                                segments=1, backend="local", backend_options=options,
                                aws_conn_id="upgrade_review_no_such_connection")
    op._compact_availability = lambda hook, store: None
    now = time.time()
    with pytest.raises(Exception):  # the store cannot be opened: the task fails, as it should
        op.execute({"run_id": RUN_ID, "ti": SimpleNamespace(xcom_push=lambda key, value: None),
                    "dag_run": SimpleNamespace(start_date=datetime.fromtimestamp(now - 3600, timezone.utc))})
    state = backend.describe([inst.instance_id])[inst.instance_id].state
    assert InstanceState(state).is_terminal(), (
        f"the finish task failed on the store before ending the job's instance {inst.instance_id} (still {state})")


# --------------------------------------------------------------------------------------------------------------
# 3. ec2: what the previous release launched is still found (passes: recorded as checked)

REGION = "us-east-1"
EC2_OPTIONS = {"regions": [REGION], "image_id": "ami-12345678"}


from test_security_review import _ec2, endpoint  # noqa: E402, F401 - moto's EC2 server and a client of it


def _ec2_state(endpoint: str, instance_id: str) -> str:
    (reservation,) = _ec2(endpoint).describe_instances(InstanceIds=[instance_id])["Reservations"]
    return reservation["Instances"][0]["State"]["Name"]


def _ec2_launch_as_old_release(endpoint: str, job_uri: str, task_id: str) -> str:
    """``Ec2Backend.launch`` of 7e3fdcd: ``{**spec.tags, TAG_MANAGED, TAG_JOB (airflow-spot:job-uri): job_uri,
    TAG_OFFER, TAG_TOKEN}`` with the old three-tag ``job_tags`` + task, and no ``airflow-spot:deployment``:
    today's launch of the same spec, with the deployment tag taken off again."""
    from airflow_spot.backends.base import TAG_DEPLOYMENT
    from airflow_spot.hooks.spot import SpotHook

    offer = Offer("g5.xlarge", REGION, "us-east-1a", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
    info = SpotHook(backend="ec2", backend_options=EC2_OPTIONS).get_backend().launch(LaunchSpec(
        offer=offer, job_uri=job_uri, idempotency_token=launch_token(DAG_ID, RUN_ID, task_id, "try1", job_uri),
        tags={**_old_job_tags(DAG_ID, RUN_ID, JOB), "airflow-spot:task": task_id}))
    _ec2(endpoint).delete_tags(Resources=[info.instance_id], Tags=[{"Key": TAG_DEPLOYMENT}])
    return info.instance_id


def test_ec2_instances_of_the_previous_release_are_reattached_to_and_ended_by_the_upgraded_code(endpoint, tmp_path,
                                                                                                 monkeypatch):
    """The ec2 backend always stamped ``airflow-spot:job-uri`` (its ``TAG_JOB``) with ``spec.job_uri``, which the
    previous release set to ``store.uri`` too: the upgraded ``_reattach`` (``_serves``), warm search and finish
    task find the old instances. Checked and fine."""
    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.operators.training import SpotJobSummaryOperator
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout, SegmentRequest
    from airflow_spot.testing import moto_ec2

    moto_ec2.reset(endpoint)
    uri = f"file://{tmp_path}/store/{DAG_ID}/{RUN_ID}"
    store = open_store(uri)
    task = f"{JOB}.segment_000"
    old = _ec2_launch_as_old_release(endpoint, store.uri, task)
    now = time.time()
    offer = Offer("g5.xlarge", REGION, "us-east-1a", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
    launch = AttemptLaunch(attempt_id=f"{task}.try1", segment_index=0, start_step=0, end_step=10, instance_id=old,
                           offer=offer.to_dict(), requested_at=now - 60, billed_from=now - 60, reused_instance=False,
                           try_number=1, task_id=task, resume_step=0, run_id=RUN_ID)
    launch.write(store)
    JobLayout(store).write_request(old, SegmentRequest(launch.attempt_id, uri, 0, 0, 10, ["true"], created_at=now - 60))

    monkeypatch.setattr(SpotSegmentOperator, "dag_id", property(lambda self: DAG_ID))
    op = SpotSegmentOperator(task_id=task, command=["python3", "train.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=10, job_name=JOB, backend="ec2", backend_options=EC2_OPTIONS)
    recorded = {"attempt_id": launch.attempt_id, "instance_id": old, "try_number": 1}
    ti = SimpleNamespace(try_number=2, id="ti-2", max_tries=op.retries)
    context = {"ti": ti, "run_id": RUN_ID, "task_state_store": SimpleNamespace(get={op.ATTEMPT_STATE_KEY: recorded}.get),
               "dag_run": SimpleNamespace(start_date=datetime.fromtimestamp(now - 900, timezone.utc))}
    again = op._reattach(context, store)
    assert again is not None and again.instance_id == old, "the upgraded retry does not wait for the old attempt"

    JobLayout(store).checkpoint_store().save(10, lambda f: f.write(b"state"))
    monkeypatch.setattr(SpotJobSummaryOperator, "dag_id", property(lambda self: DAG_ID))
    fin = SpotJobSummaryOperator(task_id=f"{JOB}.finish", checkpoint_uri=uri, job_name=JOB, total_steps=10,
                                 segments=1, backend="ec2", backend_options=EC2_OPTIONS,
                                 market_options={"regions": [REGION], "spot_prices": "catalog"})
    fin._compact_availability = lambda hook, store: None
    summary = fin.execute({"run_id": RUN_ID, "ti": SimpleNamespace(xcom_push=lambda key, value: None),
                           "dag_run": SimpleNamespace(start_date=datetime.fromtimestamp(now - 3600, timezone.utc))})
    assert old in summary["terminated_at_end"]
    assert _ec2_state(endpoint, old) in ("shutting-down", "terminated")
