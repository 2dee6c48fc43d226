"""Security and data-safety review (2026-11-27): a deployment in a company AWS account shared by several teams.

Each test asserts the safe behaviour and fails on the code as reviewed. AWS is moto's server on 127.0.0.1
(``airflow_spot.testing.moto_ec2``), as the rest of the suite uses it; nothing leaves the machine.

Scenario of the EC2 tests: two Airflow deployments (team A and team B, or staging and production of one
team) run the same DAG file in one AWS account. Scheduled DAG runs get the same ``run_id`` in both
(``scheduled__<logical date>``), and the task group ids are the DAG file's, so the instances of both carry
the same ``airflow-spot:dag`` / ``airflow-spot:run`` / ``airflow-spot:job`` tags; only their
``airflow-spot:job-uri`` tag (each deployment's own bucket) tells them apart. Team B's instance is made with
plain ``RunInstances`` carrying exactly the tags airflow-spot puts on an instance, so whatever a fix adds to
tell deployments apart (a job-uri filter, a deployment tag) is what the test relies on.
"""
from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
from airflow_fixtures import airflow_db, run_dag  # noqa: F401

from airflow_spot.testing import moto_ec2

REGION = "us-east-1"
BACKEND_OPTIONS = {"regions": [REGION], "image_id": "ami-12345678"}
DAG_ID = "train_resnet"
# what the scheduler names a scheduled run, identically in every deployment that runs this DAG file
RUN_ID = "scheduled__2026-11-27T00:00:00+00:00"
JOB = "train"


@pytest.fixture(scope="module")
def endpoint():
    with moto_ec2.moto_ec2() as url:
        yield url


def _ec2(endpoint: str):
    import boto3

    return boto3.client("ec2", endpoint_url=endpoint, region_name=REGION, aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def _other_deployments_instance(endpoint: str, job_uri: str, run_id: str = RUN_ID) -> str:
    """An instance launched by another deployment's airflow-spot for its own job (same DAG file): the tags
    airflow-spot puts on its instances, its own store in ``airflow-spot:job-uri``."""
    tags = {"airflow-spot:managed": "true", "airflow-spot:job-uri": job_uri, "airflow-spot:dag": DAG_ID,
            "airflow-spot:run": run_id, "airflow-spot:job": JOB, "airflow-spot:task": f"{JOB}.segment_003"}
    reply = _ec2(endpoint).run_instances(
        ImageId="ami-12345678", InstanceType="g5.xlarge", MinCount=1, MaxCount=1,
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}])
    return reply["Instances"][0]["InstanceId"]


def _state(endpoint: str, instance_id: str) -> str:
    (reservation,) = _ec2(endpoint).describe_instances(InstanceIds=[instance_id])["Reservations"]
    return reservation["Instances"][0]["State"]["Name"]


# --------------------------------------------------------------------------------------------------------------
# 1. the finish task ends (and bills) every instance with the job's dag/run/job tags, whatever store it serves


def test_finish_task_leaves_another_deployments_instance_of_the_same_dag_run_alone(endpoint, tmp_path,
                                                                                    monkeypatch):
    """Mechanism: ``SpotJobSummaryOperator.execute`` lists ``backend.list_instances(tags=job_tags(dag_id,
    run_id, job_name))`` and terminates every live one; ``job_tags`` holds only the DAG id, the run id and
    the task group id. Nothing compares an instance's own ``airflow-spot:job-uri`` tag with this job's store,
    so team A's finish task terminates team B's instance (same DAG file, same scheduled run id) in the
    middle of B's training, and ``bill_unrecorded`` bills B's instance as idle time in A's ledger.
    Expected: only instances of this job's own store are ended and billed."""
    from airflow_spot.backends.base import LaunchSpec, launch_token
    from airflow_spot.hooks.spot import SpotHook
    from airflow_spot.operators.segment import job_tags
    from airflow_spot.operators.training import SpotJobSummaryOperator
    from airflow_spot.policy.offers import Market, Offer
    from airflow_spot.storage.ledger_store import LedgerStore
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    moto_ec2.reset(endpoint)
    uri = f"file://{tmp_path}/teamA/{DAG_ID}/{RUN_ID}"
    store = open_store(uri)
    JobLayout(store).checkpoint_store().save(10, lambda f: f.write(b"state"))  # the job completed
    hook = SpotHook(backend="ec2", backend_options=BACKEND_OPTIONS)
    offer = Offer("g5.xlarge", REGION, "us-east-1a", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
    ours = hook.get_backend().launch(LaunchSpec(offer=offer, job_uri=store.uri, idempotency_token=launch_token("a"),
                                                tags={**job_tags(DAG_ID, RUN_ID, JOB, store.uri),
                                                      "airflow-spot:task": f"{JOB}.segment_000"}))
    theirs = _other_deployments_instance(endpoint, f"s3://team-b-checkpoints/{DAG_ID}/{RUN_ID}")

    monkeypatch.setattr(SpotJobSummaryOperator, "dag_id", property(lambda self: DAG_ID))
    op = SpotJobSummaryOperator(task_id="finish", checkpoint_uri=uri, job_name=JOB, total_steps=10, segments=1,
                                backend="ec2", backend_options=BACKEND_OPTIONS,
                                market_options={"regions": [REGION], "spot_prices": "catalog"})
    op._compact_availability = lambda hook, store: None
    pushed: dict = {}
    now = time.time()
    summary = op.execute({"run_id": RUN_ID, "ti": SimpleNamespace(xcom_push=lambda key, value: pushed.update({key: value})),
                          "dag_run": SimpleNamespace(start_date=datetime.fromtimestamp(now - 3600, timezone.utc))})

    assert _state(endpoint, ours.instance_id) in ("shutting-down", "terminated")  # its own instance still ends
    assert _state(endpoint, theirs) == "running", (
        f"team A's finish task terminated {theirs}, which serves s3://team-b-checkpoints/... (another deployment's "
        f"job with the same DAG id and run id); it ended {summary['terminated_at_end']}")
    billed = {r.instance_id for r in LedgerStore(store).rows()}
    assert theirs not in billed, f"another deployment's instance {theirs} was billed in this job's ledger"


def test_a_segment_never_takes_another_deployments_instance_as_its_warm_instance(endpoint, tmp_path, monkeypatch):
    """Mechanism: ``SpotSegmentOperator._warm_instances`` lists ``list_instances(tags=job_tags(dag, run, job))``
    as well: team B's running instance (same DAG file, same scheduled run id) is offered to team A's
    segment as its warm instance. A then writes its request under B's instance id in A's store, which B's
    agent (reading B's store) never sees; the attempt ends ``lost`` after the startup timeout, spends a
    preemption, and A's trigger then terminates B's instance as the lost attempt's. Expected: an instance
    serving another store is never warm for this job."""
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.object_store import open_store

    moto_ec2.reset(endpoint)
    uri = f"file://{tmp_path}/teamA/{DAG_ID}/{RUN_ID}"
    store = open_store(uri)
    theirs = _other_deployments_instance(endpoint, f"s3://team-b-checkpoints/{DAG_ID}/{RUN_ID}")
    monkeypatch.setattr(SpotSegmentOperator, "dag_id", property(lambda self: DAG_ID))
    op = SpotSegmentOperator(task_id=f"{JOB}.segment_001", command=["python3", "train.py"], checkpoint_uri=uri,
                             start_step=10, end_step=20, total_steps=40, job_name=JOB, backend="ec2",
                             backend_options=BACKEND_OPTIONS)
    warm = [i.instance_id for i in op._warm_instances({"run_id": RUN_ID}, store, [])]
    assert theirs not in warm, f"another deployment's instance {theirs} (store s3://team-b-checkpoints/...) is " \
                               f"offered as this job's warm instance: {warm}"


def test_a_segment_terminates_only_its_own_instances_not_ids_a_store_record_names(endpoint, tmp_path):
    """Mechanism: ``SpotSegmentOperator._reattach`` -> ``_unrecorded_attempt`` reads the earlier try's launch
    record (``control/attempts/<attempt>/launch.json``) and request from the job's store, and
    ``_end_killed_attempt`` then ``describe``s and ``terminate``s ``launch.instance_id`` when a kill record is
    there; nothing checks that the instance carries this job's tags. Everything it reads is in the store,
    which the training instances' role (and the training code, which may be third-party) can write, while
    the Airflow identity may terminate any ``airflow-spot:managed`` instance in the account. Three small
    objects written into team A's store make team A's next segment try terminate team B's instance.
    Expected: an instance id read from the store is ended only when the instance's own tags say it is this
    job's (its ``airflow-spot:job-uri`` is this store, its dag/run/job tags this job's)."""
    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.policy.offers import Market, Offer
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout, SegmentRequest

    moto_ec2.reset(endpoint)
    theirs = _other_deployments_instance(endpoint, "s3://team-b-checkpoints/another_dag/some_run",
                                         run_id="some_run")
    uri = f"file://{tmp_path}/teamA/job"
    store = open_store(uri)
    now = time.time()
    offer = Offer("g5.xlarge", REGION, "us-east-1a", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
    # what a writer of team A's store (its training code, its instances' role) puts there
    AttemptLaunch(attempt_id="seg.try1", segment_index=0, start_step=0, end_step=10, instance_id=theirs,
                  offer=offer.to_dict(), requested_at=now - 60, billed_from=now - 60, reused_instance=False,
                  try_number=1, task_id="seg", resume_step=0).write(store)
    JobLayout(store).write_request(theirs, SegmentRequest("seg.try1", uri, 0, 0, 10, ["true"], created_at=now - 60))
    JobLayout(store).write_kill("seg.try1", now - 30)

    op = SpotSegmentOperator(task_id="seg", command=["python3", "train.py"], checkpoint_uri=uri, start_step=0,
                             end_step=10, total_steps=20, backend="ec2", backend_options=BACKEND_OPTIONS)
    ti = SimpleNamespace(try_number=2, id="ti-2", max_tries=op.retries)
    run = SimpleNamespace(start_date=datetime.fromtimestamp(now - 900, timezone.utc))
    op._reattach({"ti": ti, "run_id": "r", "task_state_store": SimpleNamespace(get={}.get), "dag_run": run}, store)
    assert _state(endpoint, theirs) == "running", (
        f"team A's segment terminated {theirs} (another team's instance) because a record in A's store named it")


# --------------------------------------------------------------------------------------------------------------
# 2. `airflow-spot reap` (default --runs finished on ec2) ends every managed instance whose run it does not know


def test_reap_leaves_instances_of_another_deployment_alone(endpoint, capsys):
    """Mechanism: ``backends/reap.py`` lists every instance tagged ``airflow-spot:managed=true`` in the
    regions, and ``of_finished_runs`` reaps an instance whose ``(dag, run)`` is "finished *or does not
    exist*" in this Airflow's metadata DB (``dag_run_states`` answers None for an unknown run). A run of
    another deployment in the same account never exists in this deployment's DB, so a plain
    ``airflow-spot reap --backend ec2`` run by team A terminates every running training of team B (and
    ``JobBilling`` then writes bills into team B's store). The IAM policy shipped does not stop it either:
    TerminateInstances is allowed on any instance tagged ``airflow-spot:managed``.
    Expected: reap ends only instances this deployment launched."""
    import argparse

    from airflow_spot.backends import reap as base
    from airflow_spot.hooks.spot import SpotHook

    moto_ec2.reset(endpoint)
    theirs = _other_deployments_instance(endpoint, f"s3://team-b-checkpoints/{DAG_ID}/{RUN_ID}",
                                         run_id="manual__2026-11-27T10:00:00+00:00")
    parser = argparse.ArgumentParser()
    base.add_arguments(parser)
    args = parser.parse_args(["--backend", "ec2", "--backend-options", json.dumps(BACKEND_OPTIONS)])
    backend = SpotHook(backend="ec2", backend_options=BACKEND_OPTIONS).get_backend()

    def this_deployments_db(keys):  # airflow_lookups.dag_run_states: the run is not in this deployment's DB
        return {key: None for key in keys}

    assert base.run(args, backend=backend, run_states=this_deployments_db) == 0
    out = capsys.readouterr().out
    assert _state(endpoint, theirs) == "running", (
        f"`airflow-spot reap` terminated {theirs}, a running instance of another deployment's job:\n{out}")


def test_reap_ends_the_instances_its_own_deployment_tagged(endpoint, capsys, monkeypatch):
    """The mend of the test above: the backend tags each launch with AIRFLOW_SPOT_DEPLOYMENT; reap ends that
    deployment's instances only, another's with --deployment, and instances without the tag (another
    deployment's, or launched before the tag) with --any-deployment."""
    import argparse

    from airflow_spot.backends import reap as base
    from airflow_spot.backends.base import LaunchSpec, launch_token
    from airflow_spot.hooks.spot import SpotHook
    from airflow_spot.policy.offers import Market, Offer

    moto_ec2.reset(endpoint)
    offer = Offer("g5.xlarge", REGION, "us-east-1a", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
    monkeypatch.setenv("AIRFLOW_SPOT_DEPLOYMENT", "ml-prod")
    prod = SpotHook(backend="ec2", backend_options=BACKEND_OPTIONS).get_backend().launch(
        LaunchSpec(offer=offer, job_uri="s3://prod/job", idempotency_token=launch_token("prod"),
                   tags={"airflow-spot:dag": DAG_ID, "airflow-spot:run": "gone"}))
    untagged = _other_deployments_instance(endpoint, "s3://old/job", run_id="gone")
    monkeypatch.delenv("AIRFLOW_SPOT_DEPLOYMENT")

    def reap(*flags: str) -> str:
        parser = argparse.ArgumentParser()
        base.add_arguments(parser)
        args = parser.parse_args(["--backend", "ec2", "--backend-options", json.dumps(BACKEND_OPTIONS), *flags])
        backend = SpotHook(backend="ec2", backend_options=BACKEND_OPTIONS).get_backend()
        assert base.run(args, backend=backend, run_states=lambda keys: {k: None for k in keys}) == 0
        return capsys.readouterr().out

    out = reap()  # this deployment is "default": neither instance is its
    assert "left alone: 2 instance(s)" in out
    assert _state(endpoint, prod.instance_id) == "running" and _state(endpoint, untagged) == "running"
    out = reap("--deployment", "ml-prod")
    assert _state(endpoint, prod.instance_id) in ("shutting-down", "terminated") and "terminated 1" in out
    assert _state(endpoint, untagged) == "running"
    reap("--any-deployment")
    assert _state(endpoint, untagged) in ("shutting-down", "terminated")


def test_reap_ends_an_instance_launched_before_deployment_tags_when_this_database_knows_its_run_over(endpoint,
                                                                                                    capsys):
    """An instance from before the deployment tag is this deployment's when its run is finished here; when
    its run is merely missing here (another deployment's), it is left alone."""
    import argparse

    from airflow_spot.backends import reap as base
    from airflow_spot.hooks.spot import SpotHook

    moto_ec2.reset(endpoint)
    old_ours = _other_deployments_instance(endpoint, "s3://ours/job", run_id="finished_here")
    theirs = _other_deployments_instance(endpoint, "s3://theirs/job", run_id="not_here")
    parser = argparse.ArgumentParser()
    base.add_arguments(parser)
    args = parser.parse_args(["--backend", "ec2", "--backend-options", json.dumps(BACKEND_OPTIONS)])
    backend = SpotHook(backend="ec2", backend_options=BACKEND_OPTIONS).get_backend()
    states = {(DAG_ID, "finished_here"): "success"}
    assert base.run(args, backend=backend, run_states=lambda keys: {k: states.get(k) for k in keys}) == 0
    assert _state(endpoint, old_ours) in ("shutting-down", "terminated")
    assert _state(endpoint, theirs) == "running", capsys.readouterr().out


# --------------------------------------------------------------------------------------------------------------
# 4. a checkpoint payload is unpickled with weights_only=False: the manifest check authenticates nothing


class _Payload:
    """What a hostile checkpoint holds: unpickling it calls ``os.mkdir(marker)``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_warm_start_from_a_foreign_store_does_not_run_code_from_its_payload(tmp_path):
    """Mechanism: the session loaded every payload (now ``training/payload.py``) with
    ``torch.load(path, weights_only=False)``, i.e. a full unpickle. The manifest check before it (``CheckpointStore.fetch_verified``) compares the payload
    with a sha256 the manifest names, and the manifest's own checksum is a plain sha256 of its JSON: both
    are computed by whoever writes the store, so anyone who can write a checkpoint directory (or, with
    ``warm_start_uri``, *another* job's or team's store, or a downloaded checkpoint) writes a payload and a
    manifest that verify. Restoring it runs arbitrary code on the training instance, with its instance
    profile. Expected: loading a checkpoint never executes code (``weights_only=True`` with the numpy/RNG
    types allow-listed, or state kept as tensors)."""
    torch = pytest.importorskip("torch")
    from airflow_spot.storage.checkpoint import CheckpointStore
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout
    from airflow_spot.training.session import SpotSession

    marker = tmp_path / "code-ran-on-restore"
    foreign = open_store(f"file://{tmp_path}/pretrained")
    # a well-formed warm-start checkpoint (real weights) with one extra entry, saved through the project's own
    # save path: the manifest is sealed and verifies, and the warm start succeeds
    weights = torch.nn.Linear(2, 2).state_dict()
    CheckpointStore(foreign.child(JobLayout.CHECKPOINTS), writer="someone").save(
        100, lambda f: torch.save({"objects": {"model": weights}, "rng": None, "x": _Payload(str(marker))}, f))

    model = torch.nn.Linear(2, 2)
    try:
        with SpotSession(f"file://{tmp_path}/job", end_step=5, warm_start_uri=f"file://{tmp_path}/pretrained",
                         heartbeat_seconds=60.0) as spot:
            spot.track(model=model)
    except Exception:  # noqa: BLE001 - refusing the checkpoint is the safe outcome; running its code is not
        pass
    assert not marker.exists(), "restoring a checkpoint whose manifest verifies ran code from its payload"


# --------------------------------------------------------------------------------------------------------------
# 3. the Spot Training API checks that a caller is logged in, never that they may read the DAG


UI_DAG = "security_review_ui_job"


@pytest.fixture(scope="module")
def ui_client(airflow_db, tmp_path_factory):  # noqa: F811
    from airflow.sdk import DAG, task
    from fastapi.testclient import TestClient

    from airflow_spot.policy.ledger import LedgerRow
    from airflow_spot.storage.ledger_store import LedgerStore
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    root = tmp_path_factory.mktemp("secret-team-job")
    uri = f"file://{root}"
    store = open_store(uri)
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": 1.8e9, "total_steps": 100, "backend": "local"}).encode())
    LedgerStore(store).write(LedgerRow(
        attempt_id="train.segment_000.try1", instance_id="i-0secret", instance_type="p5.48xlarge", zone="us-east-1a",
        market="spot", price_per_hour=55.0, on_demand_price_per_hour=98.32, started_at=1.8e9, ended_at=1.8e9 + 3600,
        steps_done=50, outcome="completed", segment_index=0, steps_lost=0, step_seconds=5.0))

    with DAG(UI_DAG, schedule=None, start_date=datetime(2024, 1, 1)) as dag:
        @task(task_id="train.segment_000")
        def segment(**context):  # what SpotAttemptLink.persist pushes when an attempt starts
            from airflow_spot.links.attempt import SpotAttemptLink

            SpotAttemptLink.persist(context, uri, "train.segment_000.try1", None)

        segment()
    dag_run = run_dag(dag)
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success"

    from airflow.api_fastapi.app import create_app, get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    c = TestClient(create_app("core"))
    # logged in, but granted nothing: Airflow refuses this user every DAG
    c.outsider = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="outsider", role=None))
    c.run_id = dag_run.run_id
    return c


def test_spot_api_refuses_a_user_airflow_refuses_the_dag(ui_client):
    """Mechanism: ``ui/app.py::create_app`` protects the whole app with ``requires_authenticated()`` only,
    and ``find_jobs`` reads every DAG's XComs with the API server's session. Airflow's own API asks the auth
    manager whether the user may read the DAG (``requires_access_dag``, ``ReadableDagsFilterDep``); the
    plugin never does, so any logged-in user, whatever their role or team, reads every team's jobs: DAG and
    run ids, the store URI, instance ids and types, zones, prices and costs, error tails.
    Expected: the same answer Airflow gives for the DAG (403 for the job, the job absent from the list)."""
    auth = {"Authorization": f"Bearer {ui_client.outsider}"}
    airflow_says = ui_client.get(f"/api/v2/dags/{UI_DAG}", headers=auth).status_code
    assert airflow_says == 403, f"precondition: Airflow itself refuses this user the DAG (got {airflow_says})"

    detail = ui_client.get(f"/spot/api/jobs/{UI_DAG}/{ui_client.run_id}", headers=auth)
    page = ui_client.get(f"/spot/jobs/{UI_DAG}/{ui_client.run_id}", headers=auth)
    listed = ui_client.get("/spot/api/jobs", headers=auth)
    leaked = [j for j in (listed.json() if listed.status_code == 200 else []) if j.get("dag_id") == UI_DAG]
    assert detail.status_code in (403, 404), f"job JSON served to a user without access: {detail.text[:300]}"
    assert page.status_code in (403, 404) and "i-0secret" not in page.text, "job page served without access"
    assert not leaked, f"the job list shows a DAG the user may not read: {leaked}"


# --------------------------------------------------------------------------------------------------------------
# 6. the local backend trusts any state directory it is given, world-writable or someone else's


def test_local_reap_does_not_signal_processes_named_by_a_world_writable_state_dir(tmp_path, capsys):
    """Mechanism: ``LocalState.__init__`` only ``mkdir(parents=True, exist_ok=True)``s the state directory;
    it never checks who owns it or who may write it. Its ``instances/*/record.json`` name the pid, start
    time and process group that ``terminate`` (and ``airflow-spot reap --backend local``, ``--runs any`` by
    default) signals with ``os.killpg``. With a shared path (the reap help's own example is
    ``{"state_dir": "/tmp/spot-state"}``) another local user creates the directory first, world-writable,
    and plants a record naming any process of the Airflow user (pid and start time are public in /proc):
    reap then SIGTERMs/SIGKILLs it. Expected: a state directory that others may write (or that another
    user owns) is refused, as ssh refuses such a key directory; records are not trusted from it."""
    import contextlib
    import signal
    import subprocess
    import sys

    from airflow_spot.backends.base import InstanceInfo, InstanceState
    from airflow_spot.backends.local_state import InstanceRecord, LocalState, ProcessRef
    from airflow_spot.cli import main
    from airflow_spot.policy.offers import Market, Offer

    state_dir = tmp_path / "spot-state"
    # a process of the Airflow user that has nothing to do with airflow-spot (the scheduler, say)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        time.sleep(0.2)
        planted = LocalState(state_dir)  # what the other user writes by hand ...
        offer = Offer("g5.xlarge", "local", "use1-az1", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)
        planted.instance_dir("local-planted").mkdir()
        planted.write(InstanceRecord(info=InstanceInfo("local-planted", InstanceState.RUNNING, offer, "file:///x",
                                                       launched_at=time.time() - 3600),
                                     agent=ProcessRef.of(victim.pid), pgid=victim.pid, token="planted"))
        for sub in ("", "instances", "tokens", "jobs"):  # ... in a directory any user may write (another's mkdir)
            os.chmod(state_dir / sub, 0o777)

        with contextlib.suppress(SystemExit):
            main(["reap", "--backend", "local", "--backend-options", json.dumps({"state_dir": str(state_dir)})])
        assert "may be written by any user" in capsys.readouterr().err
        time.sleep(0.5)
        assert victim.poll() is None, (
            f"`airflow-spot reap --backend local` signalled pid {victim.pid} (exit {victim.returncode}), a process "
            "named only by a record planted in a world-writable state directory")
    finally:
        if victim.poll() is None:
            victim.send_signal(signal.SIGKILL)
        victim.wait()
