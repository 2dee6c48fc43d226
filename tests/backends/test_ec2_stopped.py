"""A stopped EC2 instance (someone stopped it; EC2 still bills its EBS volumes) serves nothing, so the backend
reports it terminated and nothing reuses it; yet ``terminate``, ``airflow-spot reap`` and a launch whose token
finds it all terminate it. Against moto's server on 127.0.0.1."""
from __future__ import annotations

import json

import boto3
import pytest
from test_ec2_backend import endpoint, hook, recorder, spec  # noqa: F401 - the module's moto fixtures

from airflow_spot.backends.base import InstanceState, launch_token
from airflow_spot.backends.reap import leftovers
from airflow_spot.cli import main

pytest.importorskip("moto")

OPTIONS = json.dumps({"regions": ["us-east-1"], "image_id": "ami-12345678"})


@pytest.fixture
def ec2(endpoint):  # noqa: F811 - a plain client for what a person does by hand (stop an instance)
    return boto3.client("ec2", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def ec2_state(ec2, instance_id: str) -> str:
    return ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]["State"]["Name"]


def test_a_stopped_instance_is_not_live_but_terminate_ends_it(hook, ec2):
    backend = hook.get_backend()
    info = backend.launch(spec())
    ec2.stop_instances(InstanceIds=[info.instance_id])
    assert ec2_state(ec2, info.instance_id) == "stopped"
    # the scheduler's view: not running, not warm, not reusable
    assert InstanceState(backend.describe([info.instance_id])[info.instance_id].state).is_terminal()
    assert leftovers(backend.list_instances(), 0.0, 2e9) == []
    backend.terminate([info.instance_id])
    assert ec2_state(ec2, info.instance_id) in ("shutting-down", "terminated")


def test_reap_terminates_stopped_instances(hook, ec2, capsys):
    backend = hook.get_backend()
    stopped = backend.launch(spec(token=launch_token("stopped")))
    gone = backend.launch(spec(token=launch_token("gone")))
    ec2.stop_instances(InstanceIds=[stopped.instance_id])
    backend.terminate([gone.instance_id])
    argv = ["reap", "--backend", "ec2", "--backend-options", OPTIONS, "--runs", "any"]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{stopped.instance_id}\tstopped" in out and gone.instance_id not in out
    assert "dry run: 1 instance(s) would be terminated" in out
    assert ec2_state(ec2, stopped.instance_id) == "stopped"
    assert main(argv) == 0
    assert "terminated 1 instance(s)" in capsys.readouterr().out
    assert ec2_state(ec2, stopped.instance_id) in ("shutting-down", "terminated")
    assert main(argv) == 0
    assert "no live instances match" in capsys.readouterr().out


def test_reap_leaves_a_young_stopped_instance_when_asked_for_old_ones(hook, ec2, capsys):
    stopped = hook.get_backend().launch(spec())
    ec2.stop_instances(InstanceIds=[stopped.instance_id])
    assert main(["reap", "--backend", "ec2", "--backend-options", OPTIONS, "--runs", "any",
                 "--older-than", "1h"]) == 0
    assert "no live instances match" in capsys.readouterr().out
    assert ec2_state(ec2, stopped.instance_id) == "stopped"


def test_a_launch_whose_token_finds_a_stopped_instance_terminates_it_and_launches_anew(hook, ec2):
    backend = hook.get_backend()
    token = launch_token("dag", "run", "task", "try1", "g5.xlarge@us-east-1a")
    first = backend.launch(spec(token=token))
    ec2.stop_instances(InstanceIds=[first.instance_id])
    fresh = backend.launch(spec(token=token))
    assert fresh.instance_id != first.instance_id
    assert fresh.state in (InstanceState.PENDING, InstanceState.RUNNING)
    assert ec2_state(ec2, first.instance_id) in ("shutting-down", "terminated")
    assert backend.launch(spec(token=token)).instance_id == fresh.instance_id
