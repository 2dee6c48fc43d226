"""Production review of the ``ec2`` backend, following the README against moto's server on 127.0.0.1.

Each test here fails because of one defect found while putting the backend into production the way the
README describes (misconfigurations that get no clear or no early error, or that leak instances), and
passes once it is fixed. Refusals moto never gives are answered on the client side through botocore's
``before-call`` event (``moto_ec2.refuse``), as the other ec2 tests do.
"""
from __future__ import annotations

import io
import contextlib
from datetime import datetime
from types import SimpleNamespace

import pytest

from airflow_spot.backends.base import InstanceState, LaunchError, LaunchSpec, launch_token
from airflow_spot.policy.offers import GpuRequest, Market, Offer
from airflow_spot.testing import moto_ec2

pytest.importorskip("moto")

IMAGE = "ami-12345678"


@pytest.fixture(scope="module")
def endpoint():
    with moto_ec2.moto_ec2() as url:
        yield url


@pytest.fixture
def moto(endpoint):
    moto_ec2.reset(endpoint)  # moto's state is per process: nothing of other tests
    return endpoint


def offer(zone: str = "us-east-1a", region: str = "us-east-1", market: Market = Market.SPOT) -> Offer:
    return Offer(instance_type="g5.xlarge", region=region, zone=zone, market=market, price_per_hour=0.5,
                 on_demand_price_per_hour=1.006, gpu_name="A10G", gpu_count=1, gpu_memory_gib=24.0,
                 relative_throughput=0.9, preemption_rate_per_hour=0.28)


def spec(o: Offer | None = None, token: str = "t", job_uri: str = "s3://bucket/dag/run") -> LaunchSpec:
    return LaunchSpec(offer=o or offer(), job_uri=job_uri, idempotency_token=launch_token(token),
                      tags={"airflow-spot:dag": "d", "airflow-spot:run": "r", "airflow-spot:job": "train"})


def ec2_client(endpoint: str, region: str = "us-east-1"):
    import boto3

    return boto3.client("ec2", endpoint_url=endpoint, region_name=region, aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def segment_operator(tmp_path, **overrides):
    """One segment of a job on the ec2 backend (a ``file://`` store, so only EC2 is in play)."""
    from airflow.sdk import DAG

    from airflow_spot.operators.segment import SpotSegmentOperator

    kwargs = dict(
        task_id="segment_000", command=["python3", "train.py"], checkpoint_uri=f"file://{tmp_path}/job",
        start_step=0, end_step=10, total_steps=10, gpus=GpuRequest(count=1, names=("L40S",)),
        backend="ec2", backend_options={"regions": ["us-east-1"], "image_id": IMAGE},
        market_options={"regions": ["us-east-1"], "spot_prices": "catalog"},
    )
    kwargs.update(overrides)
    with DAG(f"ec2_review_{abs(hash(str(sorted(overrides))))}", schedule=None, start_date=datetime(2024, 1, 1)):
        return SpotSegmentOperator(**kwargs)


def first_segment(op) -> BaseException | None:
    """Run the segment's start (plan and launch) as a worker's first try does; the exception it ends with."""
    context = {"ti": SimpleNamespace(try_number=1, id=None), "run_id": "manual__1"}
    try:
        op._run_segment(context)
    except BaseException as exc:  # noqa: BLE001 - the test judges what came out
        return exc
    return None


def spot_training(**kwargs):
    from airflow.sdk import DAG

    from airflow_spot.operators import SpotTraining

    with DAG(f"ec2_parse_{abs(hash(str(sorted(kwargs.items(), key=str))))}", schedule=None,
             start_date=datetime(2024, 1, 1)):
        return SpotTraining(task_id="train", command=["python3", "/opt/project/train.py"], total_steps=100,
                            steps_per_segment=50, gpus=GpuRequest(count=1, min_memory_gib=16),
                            checkpoint_uri="s3://my-bucket/{{ dag.dag_id }}/{{ run_id }}", backend="ec2", **kwargs)


# ---------------------------------------------------------------------------------------------- 1
@pytest.mark.parametrize("backend_options, says", [
    ({"regions": ["us-east-1"], "image_id": "ubuntu-22.04"}, "image_id"),
    ({"regions": ["us-east-7"], "image_id": IMAGE}, "us-east-7"),
    ({"regions": ["us-east-1"], "image_id": IMAGE, "block_device_gib": 4}, "block_device_gib"),
    ({"regions": ["us-east-1"], "image_id": IMAGE, "launch_template": {"Version": "1"}}, "launch_template"),
], ids=["image_id", "region", "block_device_gib", "launch_template"])
def test_ec2_backend_option_values_are_checked_at_parse_time(backend_options, says):
    """Mechanism: ``operators/validation.py:validate_option_names`` asks ``backend_cls.options_problem`` for
    the values of ``backend_options``, and ``backends/ec2.py:Ec2Backend`` does not override it (the base
    returns None), so the value checks of ``Ec2Backend.__init__`` (AMI id shape, known regions, disk >= 8 GiB,
    launch template keys) run only when a worker builds the backend at the first segment. There they raise
    a plain ``ValueError`` that the segment's retry policy leaves to Airflow's default, so the segment is
    retried ``max_preemptions + retries`` times (17 with the README's example) before the DAG run fails.

    Expected (README, "Declaring a job": SpotTraining validates at parse time "a value of backend_options the
    backend refuses"): ``SpotTraining(backend="ec2", ...)`` raises ``SpotTrainingConfigError`` naming the
    option, as it does for the local backend's values."""
    from airflow_spot.operators.validation import SpotTrainingConfigError

    with pytest.raises(SpotTrainingConfigError, match=says):
        spot_training(backend_options=backend_options, market_options={"regions": ["us-east-1"]})


# ---------------------------------------------------------------------------------------------- 2
@pytest.mark.parametrize("backend_regions, market_options", [
    (["us-east-1"], {"regions": ["us-east-1", "us-west-2"]}),
    (["eu-west-1"], None),  # market_options left out: the market offers us-east-1 (its default) only
], ids=["market-has-an-extra-region", "market-regions-left-out"])
def test_backend_and_market_regions_that_disagree_fail_at_parse_time(moto, backend_regions, market_options):
    """Mechanism: nothing compares ``backend_options["regions"]`` with ``market_options["regions"]``
    (``operators/validation.py:validate_option_names``; both default to ``("us-east-1",)``). The README
    asks the user to list the same regions, but a mismatch surfaces only in
    ``backends/ec2.py:Ec2Backend.launch_parameters`` when an offer of a region the backend lacks ranks first:
    at any segment, hours into the job, once prices move or the backend's own region refuses for capacity
    (an ``AirflowFailException`` then). With ``market_options`` left out, every offer is in us-east-1 and the
    first segment fails advising "add it to backend_options['regions']", the opposite of the fix.

    Expected: ``SpotTraining`` refuses the mismatch at parse time, naming both region lists (or, failing
    that, the job's market never offers a region its backend cannot launch into)."""
    from airflow_spot.hooks.spot import SpotHook
    from airflow_spot.operators.validation import SpotTrainingConfigError

    backend_options = {"regions": backend_regions, "image_id": IMAGE}
    try:
        spot_training(backend_options=backend_options, market_options=market_options)
    except SpotTrainingConfigError as exc:
        assert "regions" in str(exc), str(exc)
        return
    hook = SpotHook(backend="ec2", backend_options=backend_options, market_options=market_options)
    offered = {o.region for o in hook.get_market().offers(GpuRequest(count=1, min_memory_gib=16))}
    launchable = set(hook.get_backend().regions)
    assert offered <= launchable, (
        f"parsed, and the market offers {sorted(offered)} while the backend launches only into {sorted(launchable)}: "
        "the first offer ranked in another region fails its segment")


# ---------------------------------------------------------------------------------------------- 3
@pytest.mark.parametrize("case, says", [
    ("no_connection", "not defined"),
    ("DescribeInstances", "iam_policy.json"),
    ("DescribeInstanceTypes", "iam_policy.json"),
])
def test_configuration_errors_at_a_segment_start_fail_without_retries(moto, tmp_path, case, says):
    """Mechanism: ``operators/segment.py:SpotSegmentOperator._run_segment`` turns configuration errors into
    ``AirflowFailException`` only for the store, the plan and ``RunInstances`` (``_launch_first``). The calls
    before the launch let theirs through: a missing AWS connection is a ``LaunchError`` from
    ``_warm_instances`` -> ``Ec2Backend.list_instances``; a connection without ``ec2:DescribeInstances`` is
    a raw botocore ``ClientError`` there, with no hint; without ``ec2:DescribeInstanceTypes`` the market's
    ``MarketError``. The segment's retry policy (``operators/retry.py``) leaves them to Airflow's default,
    and ``SpotTraining`` gives each segment ``retries = max_preemptions + retries``: the same error is
    retried 17 times (README example) at ``retry_delay`` before the run fails.

    Expected: the first try fails without retry (``AirflowFailException``, or a retry policy answering
    FAIL), with a message that says what to fix (create the connection; attach iam_policy.json)."""
    from airflow.sdk import RetryAction
    from airflow.sdk.exceptions import AirflowFailException

    budgets = dict(max_preemptions=15, code_retries=2, retries=17)  # what SpotTraining gives the README's job
    if case == "no_connection":
        op = segment_operator(tmp_path, aws_conn_id="no_such_conn", **budgets)
    else:
        op = segment_operator(tmp_path, **budgets)
    if case != "no_connection":
        moto_ec2.refuse(op.hook.get_backend().client("us-east-1"), case, "UnauthorizedOperation",
                        message="You are not authorized to perform this operation.")
    exc = first_segment(op)
    assert exc is not None, "the segment started without the permission or connection it needs"
    fails_now = isinstance(exc, AirflowFailException) or (
        op.retry_policy.evaluate(exc, 1, op.retries + 1).action is RetryAction.FAIL)
    assert fails_now, f"retried {op.retries} more times: {type(exc).__name__}: {exc}"
    assert says in str(exc), str(exc)


# ---------------------------------------------------------------------------------------------- 4
def test_one_unreachable_region_does_not_keep_instances_of_the_others_running(moto):
    """Mechanism: ``backends/ec2.py:Ec2Backend.terminate`` first describes the ids in every region of the
    backend (``_describe_raw``) and only then terminates; the first region whose ``DescribeInstances`` fails
    (a region the connection cannot reach: not opted in, an SCP, an endpoint outage, throttling past
    botocore's retries) raises out of it, so nothing is terminated in the regions that answered. Every
    caller that ends instances goes through it (the trigger after a preemption, ``on_kill``, the finish
    task, ``reap``), so a us-east-1 instance keeps running and billing while us-west-2 is unreachable; the
    ``ClientError`` does not even say which region failed.

    Expected: instances in the regions that answer are terminated; the region that failed is reported
    (by name) afterwards."""
    from airflow_spot.hooks.spot import SpotHook

    backend = SpotHook(backend="ec2", backend_options={"regions": ["us-east-1", "us-west-2"],
                                                       "image_id": IMAGE}).get_backend()
    info = backend.launch(spec())
    moto_ec2.refuse(backend.client("us-west-2"), "DescribeInstances", "AuthFailure",
                    message="AWS was not able to validate the provided access credentials")
    raised = None
    try:
        backend.terminate([info.instance_id])
    except Exception as exc:  # noqa: BLE001 - a report of the other region is fine
        raised = exc
    state = moto_ec2.moto_instance(info.instance_id)._state.name
    assert state in ("shutting-down", "terminated"), (
        f"{info.instance_id} in us-east-1 is still {state}: us-west-2's describe failed ({raised})")
    if raised is not None:
        assert "us-west-2" in str(raised), f"the error does not say which region failed: {raised}"


# ---------------------------------------------------------------------------------------------- 5
@pytest.mark.parametrize("shape, zone", [("list", "us-east-1b"), ("dict", "us-east-1c")])
def test_an_instance_is_launched_in_the_offers_zone_inside_the_configured_subnets(moto, shape, zone):
    """Mechanism: ``backends/ec2.py:Ec2Backend._subnet``. With ``subnet_ids`` a list (README: "`{zone:
    subnet}`, or a list") it always returns the first subnet, whatever the offer's zone, and no Placement is
    sent: the market ranked and priced ``g5.xlarge@us-east-1b``, the log says "launched ... in us-east-1b",
    but the instance runs in the first subnet's zone (us-east-1a). A capacity refusal there is learnt for the
    wrong pool, and every later offer of the ranking lands in the same subnet again. With ``subnet_ids`` a
    dict that has no subnet for the offer's zone, it falls back to ``Placement`` alone: the instance starts
    in the account's default VPC, outside the configured network (with the configured security groups of
    another VPC real EC2 refuses it, which fails the task; without them it runs in the default VPC's
    default group).

    Expected: the instance is in the offer's zone and in one of the configured subnets, or the offer is
    refused with a ``LaunchError`` (that pool skipped) and nothing is launched."""
    from airflow_spot.hooks.spot import SpotHook

    ec2 = ec2_client(moto)
    vpc = ec2.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
    subnets = {z: ec2.create_subnet(VpcId=vpc, CidrBlock=cidr, AvailabilityZone=z)["Subnet"]["SubnetId"]
               for z, cidr in (("us-east-1a", "10.9.1.0/24"), ("us-east-1b", "10.9.2.0/24"))}
    group = ec2.create_security_group(GroupName="spot-training", Description="no inbound", VpcId=vpc)["GroupId"]
    configured = list(subnets.values()) if shape == "list" else dict(subnets)
    backend = SpotHook(backend="ec2", backend_options={
        "regions": ["us-east-1"], "image_id": IMAGE, "subnet_ids": configured, "security_group_ids": [group],
    }).get_backend()
    try:
        info = backend.launch(spec(offer(zone=zone)))
    except LaunchError:
        live = [i for i in backend.list_instances() if not InstanceState(i.state).is_terminal()]
        assert live == [], f"refused, yet launched {live}"
        return
    raw = ec2.describe_instances(InstanceIds=[info.instance_id])["Reservations"][0]["Instances"][0]
    assert raw["Placement"]["AvailabilityZone"] == zone, (
        f"the {zone} offer runs in {raw['Placement']['AvailabilityZone']} (subnet {raw.get('SubnetId')})")
    assert raw.get("SubnetId") in subnets.values(), (
        f"launched into {raw.get('SubnetId')} of {raw.get('VpcId')}, outside the configured subnets {configured}")


# ---------------------------------------------------------------------------------------------- 6
def test_reap_without_backend_options_searches_the_connections_region(moto):
    """Mechanism: ``commands/reap.py:run`` builds the backend from ``--backend-options`` only, and
    ``backends/ec2.py:Ec2Backend`` defaults ``regions`` to ``("us-east-1",)`` whatever the AWS connection's
    ``region_name`` says. The README's command, ``airflow-spot reap --backend ec2 [--dry-run]``, run by a
    deployment whose connection (and DAGs) are in us-west-2, lists us-east-1 only and prints "no live
    instances match" while the leftovers keep billing in us-west-2 (``offers --backend ec2`` without
    ``--regions`` likewise ranks us-east-1).

    Expected: without ``regions`` the backend searches the connection's region (or reap at least says
    which regions it searched, so "nothing" is not read as "nothing anywhere")."""
    from airflow_spot.cli import main
    from airflow_spot.hooks.spot import SpotHook

    with moto_ec2.aws_connection(moto, region="us-west-2"):
        backend = SpotHook(backend="ec2", backend_options={"regions": ["us-west-2"], "image_id": IMAGE}).get_backend()
        left = backend.launch(spec(offer(zone="us-west-2a", region="us-west-2"), token="leftover"))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["reap", "--backend", "ec2", "--runs", "any", "--dry-run"])
    assert rc == 0, out.getvalue() + err.getvalue()
    assert left.instance_id in out.getvalue() or "us-east-1" in out.getvalue(), (
        f"reap found nothing and did not say it searched us-east-1 only; leftover {left.instance_id} runs in "
        f"us-west-2. It printed: {out.getvalue()!r}")


# ---------------------------------------------------------------------------------------------- 7
@pytest.mark.parametrize("code, message, markets", [
    ("MaxSpotInstanceCountExceeded", "Max spot instance count exceeded", (Market.SPOT,)),
    ("VcpuLimitExceeded", "You have requested more vCPU capacity than your current vCPU limit of 0 allows for "
                          "the instance bucket that the specified instance type belongs to.", (Market.ON_DEMAND,)),
])
def test_quota_refusals_are_told_apart_from_capacity(moto, tmp_path, code, message, markets):
    """Mechanism: ``backends/ec2_errors.py`` puts the account's quota errors (``MaxSpotInstanceCountExceeded``,
    ``VcpuLimitExceeded``, ``InstanceLimitExceeded``) in ``CAPACITY_CODES`` and ``launch_error`` words them
    like a full pool ("<code> for <pool>"). ``operators/segment.py:_launch_first`` then records each as the
    pool's capacity refusal in the job's and the deployment's availability log (every pool of the region
    marked "refused" for every job of the deployment, though no pool is full), and ``_get_instance`` raises
    ``NoCapacityNow``: the segment waits up to ``max_capacity_wait_seconds`` (24 h) and finally fails saying
    "no capacity ... allow more instance types or regions". A new account's spot quota for G instances is 0,
    so the README's first job waits a day and never learns that a quota increase is the fix.

    Expected: the error the user sees says it is the account's quota and how to raise it (Service Quotas /
    a limit increase), and the refusal is not learnt as the pools' capacity."""
    from airflow_spot.storage.availability import job_availability_log
    from airflow_spot.storage.object_store import open_store

    op = segment_operator(tmp_path, gpus=GpuRequest(count=1, names=("L40S",), markets=markets))
    moto_ec2.refuse(op.hook.get_backend().client("us-east-1"), "RunInstances", code, message=message)
    exc = first_segment(op)
    assert exc is not None
    assert "quota" in str(exc).lower(), f"{type(exc).__name__} does not say it is a quota: {str(exc)[:400]}"
    refused = [e.pool for e in job_availability_log(open_store(f"file://{tmp_path}/job")).read() if e.kind == "refused"]
    assert refused == [], f"{code} learnt as the capacity refusal of {len(refused)} pools, e.g. {refused[:3]}"


# ---------------------------------------------------------------------------------------------- 8
def test_a_job_uri_longer_than_a_tag_value_is_not_cut(moto):
    """Mechanism: ``backends/ec2.py:Ec2Backend.launch_parameters`` stores the job's root in the tag
    ``airflow-spot:job-uri`` cut to EC2's 256 characters (``str(v)[:_TAG_VALUE_MAX]``), and ``_info`` reads
    it back as ``InstanceInfo.job_uri``. The README's ``checkpoint_uri="s3://my-bucket/{{ dag.dag_id }}/{{
    run_id }}"`` passes 256 characters with a long DAG id (Airflow allows 250 for each id).
    ``commands/reap.py:JobBilling`` opens ``info.job_uri`` to bill a reaped instance: it reads and writes a
    different, truncated prefix (kill records and an "unrecorded instance" ledger row in a stray job root)
    and the real job is never billed.

    Expected: ``describe`` gives back the job URI the instance was launched for, or the launch (better: the
    DAG's parse) refuses a URI that cannot be kept, saying so."""
    from airflow_spot.hooks.spot import SpotHook

    backend = SpotHook(backend="ec2", backend_options={"regions": ["us-east-1"], "image_id": IMAGE}).get_backend()
    job_uri = "s3://my-bucket/" + "team_forecasting_" + "d" * 200 + "/scheduled__2026-11-26T00:00:00+00:00"
    assert len(job_uri) > 256
    try:
        info = backend.launch(spec(job_uri=job_uri))
    except (LaunchError, ValueError) as exc:
        assert "256" in str(exc), f"refused without saying why: {exc}"
        return
    seen = backend.describe([info.instance_id])[info.instance_id]
    assert seen.job_uri == job_uri, f"the instance's job URI reads back as {len(seen.job_uri)} characters: {seen.job_uri}"
