"""The ec2 backend against moto's server on 127.0.0.1, through the Airflow ``aws_default`` connection."""
from __future__ import annotations

import dataclasses

import asyncio

import pytest

from airflow_spot.backends.base import (
    InstanceState,
    LaunchError,
    LaunchSpec,
    TerminationReason,
    get_backend,
    launch_token,
)
from airflow_spot.backends.bootstrap import agent_argv_from_user_data
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.testing import moto_ec2

pytest.importorskip("moto")


@pytest.fixture(scope="module")
def recorder():
    """Every EC2 call of this module's hooks; all of them must be allowed by the repo's IAM policy."""
    from pathlib import Path

    import airflow_spot.backends

    calls = moto_ec2.CallRecorder()
    yield calls
    policy = moto_ec2.policy_actions(str(Path(airflow_spot.backends.__file__).parent / "iam_policy.json"))
    missing = moto_ec2.iam_actions(calls.operations) - policy
    assert not missing, f"the EC2 tests called actions iam_policy.json does not allow: {missing}"


@pytest.fixture(scope="module")
def endpoint():
    with moto_ec2.moto_ec2() as url:
        yield url


@pytest.fixture
def hook(endpoint, recorder):
    from airflow_spot.hooks.spot import SpotHook

    moto_ec2.reset(endpoint)
    make_profile(endpoint)
    hook = SpotHook(backend="ec2", backend_options={"regions": ["us-east-1", "us-west-2"], "image_id": "ami-12345678",
                                                     "instance_profile": "spot-training"})
    hook.__dict__["clients"] = recorder.wrap(hook.clients)
    return hook


def offer(instance_type="g5.xlarge", zone="us-east-1a", market=Market.SPOT, price=0.5, region="us-east-1") -> Offer:
    return Offer(instance_type=instance_type, region=region, zone=zone, market=market, price_per_hour=price,
                 on_demand_price_per_hour=1.006, gpu_name="A10G", gpu_count=1, gpu_memory_gib=24.0,
                 relative_throughput=0.9, preemption_rate_per_hour=0.28)


def spec(o: Offer | None = None, token: str | None = None, **tags) -> LaunchSpec:
    return LaunchSpec(offer=o or offer(), job_uri="s3://bucket/dag/run", idempotency_token=token or launch_token("t"),
                      tags={"airflow-spot:dag": "d", "airflow-spot:run": "r", **tags},
                      env={"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"})


def make_profile(endpoint: str) -> None:
    """moto checks that an instance profile exists before it launches with one."""
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1")
    iam.create_instance_profile(InstanceProfileName="spot-training")


def test_spot_launch_carries_market_zone_tags_and_a_bootstrap_without_credentials(hook, endpoint):
    backend = hook.get_backend()
    info = backend.launch(spec())
    assert info.state in (InstanceState.PENDING, InstanceState.RUNNING)
    described = backend.describe([info.instance_id, "i-00000000000000000"])
    assert list(described) == [info.instance_id]  # an unknown id is absent, not an error
    seen = described[info.instance_id]
    assert seen.offer.is_spot and seen.offer.zone == "us-east-1a" and seen.offer.instance_type == "g5.xlarge"
    assert seen.offer.price_per_hour == 0.5 and seen.offer.gpu_name == "A10G"
    assert seen.job_uri == "s3://bucket/dag/run" and seen.tags["airflow-spot:run"] == "r"
    raw = moto_ec2.moto_instance(info.instance_id)
    script = moto_ec2.user_data(info.instance_id)
    argv, env = agent_argv_from_user_data(script)
    assert argv[1:3] == ["-m", "airflow_spot.training.agent"] and "--instance-id" not in argv
    assert argv[argv.index("--imds-url") + 1] == "http://169.254.169.254"
    assert env == {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"}
    assert "SECRET" not in script and "testing" not in script
    assert_runs_at_every_boot(script)
    assert raw.instance_initiated_shutdown_behavior == "terminate"
    assert raw.metadata_options.http_tokens == "required"  # IMDSv2 only


def test_same_token_returns_the_same_instance(hook):
    backend = hook.get_backend()
    first = backend.launch(spec(token=launch_token("dag", "run", "task", "try1", "g5.xlarge@us-east-1a")))
    again = hook.get_backend().launch(spec(token=launch_token("dag", "run", "task", "try1", "g5.xlarge@us-east-1a")))
    other = backend.launch(spec(token=launch_token("dag", "run", "task", "try2", "g5.xlarge@us-east-1a")))
    assert again.instance_id == first.instance_id != other.instance_id
    assert len(backend.list_instances({"airflow-spot:run": "r"})) == 2


def test_token_fits_ec2_client_token_for_long_ids():
    token = launch_token("d" * 250, "manual__" + "r" * 250, "t" * 250, "try1", "p4d.24xlarge@us-east-1a")
    assert len(token) == 64 and token == launch_token("d" * 250, "manual__" + "r" * 250, "t" * 250, "try1",
                                                      "p4d.24xlarge@us-east-1a")


def test_on_demand_offer_launches_without_spot_options(hook):
    info = hook.get_backend().launch(spec(offer(market=Market.ON_DEMAND, zone="us-east-1", price=1.006)))
    seen = hook.get_backend().describe([info.instance_id])[info.instance_id]
    assert seen.offer.market is Market.ON_DEMAND
    capped = dataclasses.replace(spec(offer(market=Market.ON_DEMAND, zone="us-east-1")), max_price_per_hour=0.5)
    assert "InstanceMarketOptions" not in hook.get_backend().launch_parameters(capped)


def test_a_spot_price_cap_is_the_instances_max_price(hook):
    backend = hook.get_backend()
    assert "MaxPrice" not in backend.launch_parameters(spec())["InstanceMarketOptions"]["SpotOptions"]
    capped = backend.launch_parameters(dataclasses.replace(spec(), max_price_per_hour=0.4))
    assert capped["InstanceMarketOptions"]["SpotOptions"]["MaxPrice"] == "0.400000"


def test_spot_reclaim_is_preempted_and_our_terminate_is_user(hook):
    backend = hook.get_backend()
    reclaimed = backend.launch(spec(token=launch_token("a")))
    stopped = backend.launch(spec(token=launch_token("b")))
    moto_ec2.reclaim_spot_instance(reclaimed.instance_id)
    backend.terminate([stopped.instance_id])
    backend.terminate([stopped.instance_id, "i-00000000000000000"])  # idempotent, unknown ids skipped
    seen = backend.describe([reclaimed.instance_id, stopped.instance_id])
    assert (seen[reclaimed.instance_id].state, seen[reclaimed.instance_id].reason) == (
        InstanceState.TERMINATED, TerminationReason.PREEMPTED)
    assert (seen[stopped.instance_id].state, seen[stopped.instance_id].reason) == (
        InstanceState.TERMINATED, TerminationReason.USER)


def test_terminate_reaches_an_instance_describe_does_not_show_yet(hook):
    info = hook.get_backend().launch(spec())
    lagging = get_backend("ec2", clients=hook.clients, regions=["us-west-2", "us-east-1"])
    for region in lagging.regions:
        moto_ec2.lag_describe(lagging.client(region))
    assert lagging.describe([info.instance_id]) == {}
    lagging.terminate([info.instance_id])  # an on_kill right after the launch
    from airflow_spot.hooks.spot import SpotHook  # fresh clients: the lag is on the hook's cached ones

    seen = SpotHook(backend="ec2", backend_options={"regions": ["us-east-1"]}).get_backend().describe(
        [info.instance_id])[info.instance_id]
    assert (seen.state, seen.reason) == (InstanceState.TERMINATED, TerminationReason.USER)


def test_async_describe_uses_the_providers_async_client(hook):
    backend = hook.get_backend()
    live = backend.launch(spec(token=launch_token("live")))
    gone = backend.launch(spec(token=launch_token("gone")))
    moto_ec2.reclaim_spot_instance(gone.instance_id)
    seen = asyncio.run(backend.adescribe([live.instance_id, gone.instance_id, "i-00000000000000000"]))
    assert set(seen) == {live.instance_id, gone.instance_id}
    assert seen[live.instance_id].state is InstanceState.RUNNING
    assert seen[gone.instance_id].reason is TerminationReason.PREEMPTED


def test_backend_rebuilt_from_its_serialised_options_sees_the_same_instances(hook):
    from airflow_spot.hooks.spot import SpotHook

    backend = hook.get_backend()
    info = backend.launch(spec())
    again = SpotHook(backend="ec2", backend_options=backend.serialize()).get_backend()
    assert again.describe([info.instance_id])[info.instance_id].state is InstanceState.RUNNING
    assert again.describe_scope() == backend.describe_scope()


@pytest.mark.parametrize("code", ["InsufficientInstanceCapacity", "InsufficientCapacity"])
def test_capacity_refusals_say_try_the_next_offer(hook, code):
    backend = hook.get_backend()
    moto_ec2.refuse(backend.client("us-east-1"), "RunInstances", code)
    with pytest.raises(LaunchError) as err:
        backend.launch(spec())
    assert err.value.capacity and err.value.tried == ["g5.xlarge@us-east-1a"] and code in str(err.value)


@pytest.mark.parametrize("code", ["MaxSpotInstanceCountExceeded", "VcpuLimitExceeded", "InstanceLimitExceeded"])
def test_quota_refusals_say_try_the_next_offer_and_raise_the_quota(hook, code):
    backend = hook.get_backend()
    moto_ec2.refuse(backend.client("us-east-1"), "RunInstances", code)
    with pytest.raises(LaunchError) as err:
        backend.launch(spec())
    assert not err.value.capacity and err.value.unusable and code in str(err.value)
    assert "Service Quotas" in str(err.value)


def test_capacity_refused_in_one_pool_falls_to_the_next_ranked_offer(hook):
    """The operator's loop over ranked offers (operators/segment.py) relies on capacity=True to go on."""
    backend = hook.get_backend()
    moto_ec2.refuse(backend.client("us-east-1"), "RunInstances", "InsufficientInstanceCapacity",
                    when=lambda body: body.get("Placement.AvailabilityZone") == "us-east-1a")
    ranked = [offer(zone="us-east-1a", price=0.3), offer(zone="us-east-1b", price=0.4)]
    launched, refused = None, []
    for o in ranked:
        try:
            launched = backend.launch(spec(o, token=launch_token("x", o.pool)))
            break
        except LaunchError as exc:
            assert exc.capacity
            refused.append(o.pool)
    assert refused == ["g5.xlarge@us-east-1a"]
    assert backend.describe([launched.instance_id])[launched.instance_id].offer.zone == "us-east-1b"


@pytest.mark.parametrize("code, hint", [
    ("InvalidAMIID.NotFound", "AMIs are regional"),
    ("UnauthorizedOperation", "iam_policy.json"),
    ("AccessDenied", "iam_policy.json"),
])
def test_configuration_refusals_are_not_retried_on_other_offers(hook, code, hint):
    backend = hook.get_backend()
    moto_ec2.refuse(backend.client("us-east-1"), "RunInstances", code)
    with pytest.raises(LaunchError) as err:
        backend.launch(spec())
    assert not err.value.capacity and code in str(err.value) and hint in str(err.value)


def test_bad_options_fail_with_what_to_fix(hook):
    with pytest.raises(ValueError, match="unknown AWS region.*us-east-1"):
        get_backend("ec2", regions=["us-east-7"])
    with pytest.raises(ValueError, match="image_id must be an AMI id"):
        get_backend("ec2", image_id="ubuntu-22.04")
    with pytest.raises(LaunchError, match="no machine image"):
        get_backend("ec2", clients=hook.clients).launch(spec())
    with pytest.raises(LaunchError, match="not one of the backend's regions"):
        hook.get_backend().launch(spec(offer(region="eu-west-1", zone="eu-west-1a")))
    with pytest.raises(LaunchError, match="must not carry credentials"):
        bad = spec()
        bad.env["AWS_SECRET_ACCESS_KEY"] = "x"
        hook.get_backend().launch(bad)


def test_missing_connection_is_named(endpoint):
    from airflow_spot.hooks.spot import SpotHook

    backend = SpotHook(backend="ec2", backend_options={"image_id": "ami-12345678"}, aws_conn_id="no_such_conn")
    with pytest.raises(LaunchError, match="'no_such_conn' is not defined"):
        backend.get_backend().launch(spec())


def test_operators_do_not_branch_on_the_backend_name():
    from airflow_spot.backends.base import backend_class

    assert backend_class("ec2").notice_source == "imds" and backend_class("local").notice_source == "file"
    # an instance's image is not this machine: nothing to check here for ec2, a missing program for local
    assert backend_class("ec2").command_problem(["/opt/venv/bin/python", "train.py"]) is None
    assert "not found on PATH" in backend_class("local").command_problem(["/no/such/program"])


def assert_runs_at_every_boot(user_data: str) -> None:
    """cloud-init runs a user-data script at the first boot only; a rebooted instance would run no agent. The
    user data is a MIME multipart whose cloud-config part makes cloud-init run its scripts at every boot."""
    import email

    import yaml

    parts = {p.get_content_type(): p.get_payload(decode=True).decode()
             for p in email.message_from_string(user_data).walk() if not p.is_multipart()}
    assert set(parts) == {"text/cloud-config", "text/x-shellscript"}, list(parts)
    config = yaml.safe_load(parts["text/cloud-config"])
    assert parts["text/cloud-config"].startswith("#cloud-config\n")
    assert ["scripts-user", "always"] in config["cloud_final_modules"]
    assert parts["text/x-shellscript"].startswith("#!/bin/bash\n")
    assert parts["text/x-shellscript"].rstrip().endswith("shutdown -h now")


def test_user_data_with_text_outside_ascii_keeps_the_script_readable():
    from airflow_spot.backends.base import LaunchSpec
    from airflow_spot.backends.bootstrap import shell_script_of, user_data_script

    s = LaunchSpec(offer=offer(), job_uri="s3://bucket/dag/run", idempotency_token="t", env={"RUN_NOTE": "größer"})
    user_data = user_data_script(s)
    assert_runs_at_every_boot(user_data)
    argv, env = agent_argv_from_user_data(user_data)
    assert env == {"RUN_NOTE": "größer"} and "airflow_spot.training.agent" in argv
    bare = user_data_script(s, every_boot=False)
    assert bare.startswith("#!/bin/bash\n") and shell_script_of(user_data) == bare
