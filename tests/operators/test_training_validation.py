"""Bad arguments of SpotTraining fail when the DAG is parsed, with a message that says what to fix."""
from __future__ import annotations

import sys
from datetime import datetime, timedelta

import pytest

from airflow.sdk import DAG

from airflow_spot.operators.training import SpotTraining
from airflow_spot.operators.validation import SpotTrainingConfigError, segment_bounds
from airflow_spot.policy.offers import GpuRequest

GOOD = dict(
    task_id="train",
    command=[sys.executable, "-c", "pass"],
    total_steps=100,
    steps_per_segment=30,
    checkpoint_uri="file:///tmp/ckpt/{{ dag.dag_id }}/{{ run_id }}",
)


def build(**overrides):
    with DAG("validation", schedule=None, start_date=datetime(2024, 1, 1)) as dag:
        SpotTraining(**{**GOOD, **overrides})
    return dag


def test_good_job_builds_chained_segments_and_final_task():
    dag = build()
    ids = sorted(dag.task_dict)
    assert ids == ["train.finish", "train.segment_000", "train.segment_001", "train.segment_002", "train.segment_003"]
    seg = [dag.task_dict[f"train.segment_{i:03d}"] for i in range(4)]
    assert [(s.start_step, s.end_step) for s in seg] == [(0, 30), (30, 60), (60, 90), (90, 100)]
    for a, b in zip(seg, seg[1:], strict=False):
        assert b.task_id in a.downstream_task_ids
    finish = dag.task_dict["train.finish"]
    assert finish.trigger_rule == "all_done"
    assert finish.upstream_task_ids == {"train.segment_003"}
    # Airflow's retries cover both budgets; the operator enforces each one separately.
    assert seg[0].retries == 10 + 1 and seg[0].max_preemptions == 10 and seg[0].code_retries == 1
    assert {"command", "checkpoint_uri", "env"} <= set(seg[0].template_fields)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(total_steps=0), "total_steps must be a positive"),
        (dict(total_steps=-5), "total_steps must be a positive"),
        (dict(steps_per_segment=0), "steps_per_segment must be a positive"),
        (dict(total_steps=10, steps_per_segment=20), "steps_per_segment=20 is larger than total_steps=10"),
        (dict(total_steps=10.5), "total_steps must be an integer"),
        (dict(backend="gce"), "unknown backend 'gce'; valid backends: .*local"),
        (dict(command=[]), "command must be a non-empty list"),
        (dict(command=""), "command must be a non-empty list"),
        (dict(command=["no-such-program-xyz", "train.py"]), "'no-such-program-xyz' was not found on PATH"),
        (dict(checkpoint_uri="gs://bucket/x"), "unsupported scheme 'gs'"),
        (dict(checkpoint_uri="relative/dir"), "has no scheme"),
        (dict(checkpoint_uri="file://host/dir"), "must be absolute"),
        (dict(checkpoint_uri=""), "checkpoint_uri must be a non-empty string"),
        (dict(deadline=3600), "deadline must be a datetime.timedelta"),
        (dict(deadline=timedelta(0)), "deadline must be positive"),
        (dict(max_preemptions=-1), "max_preemptions must be an integer >= 0"),
        (dict(retries=None), "retries must be an integer >= 0"),
        (dict(gpus="A100"), "gpus must be a GpuRequest"),
    ],
)
def test_bad_arguments_fail_at_parse_time(overrides, message):
    with pytest.raises(SpotTrainingConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build(**overrides)


def test_gpu_request_errors_come_from_the_contract():
    with pytest.raises(ValueError, match="count must be a positive integer"):
        build(gpus=GpuRequest(count=0))


def test_string_command_is_split_and_templates_are_left_to_render_time():
    dag = build(command=f"{sys.executable} train.py --lr 0.1", checkpoint_uri="{{ var.value.ckpt_root }}/x")
    assert dag.task_dict["train.segment_000"].command == [sys.executable, "train.py", "--lr", "0.1"]


def test_segment_bounds_cover_the_job_exactly():
    assert segment_bounds(10, 10) == [(0, 10)]
    assert segment_bounds(7, 3) == [(0, 3), (3, 6), (6, 7)]


def test_segments_defer_by_default(monkeypatch):
    monkeypatch.delenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", raising=False)
    # Airflow's own default for [operators] default_deferrable is False; segments still defer
    assert build().task_dict["train.segment_000"].deferrable is True


def test_a_generated_airflow_cfg_does_not_turn_deferral_off(monkeypatch):
    # Airflow writes ``default_deferrable = false`` into every airflow.cfg it generates: not a choice
    from airflow.sdk.configuration import conf

    monkeypatch.delenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", raising=False)
    had = conf.has_option("operators", "default_deferrable")
    old = conf.get("operators", "default_deferrable", fallback=None)
    conf.set("operators", "default_deferrable", "False")  # what the generated file holds
    try:
        assert conf.getboolean("operators", "default_deferrable") is False
        assert build().task_dict["train.segment_000"].deferrable is True
    finally:
        if had and old is not None:
            conf.set("operators", "default_deferrable", old)
        else:
            conf.remove_option("operators", "default_deferrable")


def test_an_explicit_deployment_setting_wins(monkeypatch):
    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "False")
    assert build().task_dict["train.segment_000"].deferrable is False
    assert build(segment_options={"deferrable": True}).task_dict["train.segment_000"].deferrable is True


@pytest.mark.parametrize(
    "overrides, message",
    [
        # nobody sells it: caught at parse time against the catalog, with the largest shape named
        (dict(gpus=GpuRequest(count=64, min_memory_gib=500)), "no instance type offers 64 GPU(s) with >= 500 GiB"),
        (dict(gpus={"count": 1, "min_memory_gib": 500}), "the largest is 8 x"),
        (dict(gpus={"count": 3}), "instance types come with [1, 2, 4, 8] GPUs"),
        (dict(task_id=""), "task_id must be a non-empty string"),
        (dict(env={"LR": None}), "env values must be strings"),
        (dict(env=["A=1"]), "env must be a dict of variable names"),
        (dict(cwd=42), "cwd must be a non-empty string"),
        (dict(aws_conn_id=""), "aws_conn_id must be a non-empty string"),
        (dict(retry_delay=30), "retry_delay (wait before retrying a failed training command) must be a datetime"),
        (dict(retry_delay=timedelta(seconds=-1)), "retry_delay"),
        (dict(backend_options=["state_dir"]), "backend_options must be a dict"),
        (dict(market_options={"regions": {"us-east-1"}}), "market_options must hold plain JSON values"),
        (dict(segment_options={"pol_interval": 1.0}), "unknown segment_options ['pol_interval']; valid: "),
        # a misspelt key of the backend or the market fails here, not as a TypeError on a worker later
        (dict(gpus={"cnt": 1}), "gpus: unknown keys ['cnt']; valid: count, min_memory_gib,"),
        (dict(backend_options={"boot_secs": 1}), "backend_options: unknown keys ['boot_secs'] for LocalBackend "
                                                 "(backend 'local'); valid: boot_seconds,"),
        (dict(market_options={"region": ["us-east-1"]}), "market_options: unknown keys ['region'] for CatalogMarket"),
        (dict(backend="ec2", market_options={"price_ttl": 60}), "unknown keys ['price_ttl'] for Ec2Market"),
        (dict(market_options={"kind": "gcp"}), "market_options: unknown market 'gcp' for backend 'local'"),
        (dict(segment_options={"retries": 3}), "segment_options ['retries'] are arguments of SpotTraining itself"),
        (dict(retry_policy="preempted:0"), "retry_policy must be an airflow.sdk RetryPolicy"),
        (dict(segment_options={"heartbeat_timeout": 4}), "would call an attempt lost after a few missed heartbeats"),
        (dict(segment_options={"poll_interval": 10, "heartbeat_timeout": 20}), "use at least 30 s"),
        (dict(segment_options={"startup_timeout": 0}), "segment_options['startup_timeout'] must be a finite number of"),
        (dict(segment_options={"checkpoint_min_interval": 60, "checkpoint_max_interval": 30}),
         "checkpoint_min_interval=60 is above checkpoint_max_interval=30"),
        (dict(segment_options={"keep_checkpoints": 0}), "keep_checkpoints'] must be an integer >= 1"),
        (dict(segment_options={"reuse_tolerance": 0.25}), "is now the policy's decision, the same the simulator"),
        # an on/off option given as a string would read as true
        (dict(segment_options={"probe_spot": "false"}), "segment_options['probe_spot'] must be True or False"),
        (dict(segment_options={"deferrable": "no"}), "segment_options['deferrable'] must be True or False"),
        # a region or zone no offer can be in would leave only on-demand offers, silently
        (dict(gpus={"regions": ["mars-1"]}), "regions ['mars-1'] are not in the local backend's catalog; its regions: "),
        (dict(backend="ec2", gpus={"regions": ["mars-1"]}), "unknown AWS region(s) ['mars-1']"),
        (dict(backend="ec2", gpus={"zones": ["a1"]}), "zones ['a1'] are not zone names of an AWS region"),
        (dict(gpus={"zones": ["us-east-1a"]}), "zones ['us-east-1a'] are not zones of the local backend's catalog, "
                                               "which names zones by id; its zones there: ['use1-az1',"),
        (dict(backend="ec2", gpus={"zones": ["use1-az1"]}), "zones ['use1-az1'] are not zone names of an AWS region; the ec2"),
        # Graviton GPUs need an arm64 image: said at parse time, not as "no offer" in every segment
        (dict(gpus={"names": ["T4g"]}), "only Graviton (arm64) instance types offer 1 GPU(s) named ['T4g']"),
        # an argument SpotTraining does not take is named as SpotTraining's
        (dict(totl_steps=5), "SpotTraining got unknown arguments ['totl_steps']; its own are"),
        (dict(poll_interval=5.0), "['poll_interval'] are segment operator arguments: pass them in segment_options"),
        (dict(gpus={"markets": ["spto"]}), "GpuRequest.markets ['spto'] are not markets; valid: 'spot', 'on-demand'"),
    ],
)
def test_more_bad_arguments_fail_at_parse_time(overrides, message):
    import re

    with pytest.raises(SpotTrainingConfigError, match=re.escape(message)):
        build(**overrides)


def test_every_option_the_backend_or_market_takes_is_accepted():
    build(backend_options={"boot_seconds": 1, "preemption": {"mode": "schedule", "after_seconds": [3]}},
          market_options={"regions": ["us-east-1"], "catalog_path": None, "default_mtbf_hours": 5})
    build(backend="ec2", backend_options={"regions": ["us-east-1"], "image_id": "ami-1"},
          market_options={"regions": ["us-east-1"], "price_ttl_seconds": 60, "spot_prices": "catalog"})
    build(market_options={"kind": "ec2", "regions": ["us-east-1"]})  # the live market beside the local backend


def test_the_biggest_real_request_is_accepted_and_segments_get_the_retry_policy():
    from airflow.sdk import ExceptionRetryPolicy, RetryAction, RetryRule

    from airflow_spot.operators.retry import SegmentRetryPolicy, UserFirstRetryPolicy

    dag = build(gpus={"count": 8, "min_memory_gib": 80})
    assert isinstance(dag.task_dict["train.segment_000"].retry_policy, SegmentRetryPolicy)
    mine = ExceptionRetryPolicy(rules=[RetryRule(exception=MemoryError, action=RetryAction.FAIL)])
    dag = build(retry_policy=mine)
    policy = dag.task_dict["train.segment_001"].retry_policy
    assert isinstance(policy, UserFirstRetryPolicy) and policy.user is mine


def test_zones_named_the_way_the_market_names_them_are_accepted():
    build(gpus={"zones": ["use1-az1", "usw2-az2"]})  # the local catalog: zone ids
    build(backend="ec2", backend_options={"image_id": "ami-12345678"}, gpus={"zones": ["us-east-1a"]})
    build(segment_options={"probe_spot": False, "deferrable": True})
    build(gpus={"names": ["T4g"]}, market_options={"architectures": ["arm64"]})
    build(backend="ec2", backend_options={"image_id": "ami-12345678"},
          gpus={"zones": ["us-west-2-lax-1a", "us-east-1-wl1-bos-wlz-1"]})


@pytest.mark.parametrize(
    "gpus, message",
    [
        # a bare string was split into its letters ("named ['A', '1', '0', 'G']")
        ({"count": 1, "names": "A10G"}, "gpus: GpuRequest.names must be a list of non-empty strings, e.g. ['A10G'], "
                                        "not the bare string 'A10G'"),
        ({"exclude_names": "K80"}, "GpuRequest.exclude_names must be a list of non-empty strings, e.g. ['K80']"),
        ({"regions": "us-east-1"}, "GpuRequest.regions must be a list of non-empty strings, e.g. ['us-east-1']"),
        ({"zones": "use1-az1"}, "GpuRequest.zones must be a list of non-empty strings, e.g. ['use1-az1']"),
        # a number given as a string was a bare "'<' not supported between instances of 'str' and 'int'"
        ({"count": 1, "min_memory_gib": "16"}, "gpus: GpuRequest.min_memory_gib must be a number >= 0 (GiB of memory "
                                               "per GPU), e.g. min_memory_gib=16, got the string '16'"),
        ({"max_price_per_hour": "2"}, "GpuRequest.max_price_per_hour must be a number > 0"),
        ({"count": True}, "GpuRequest.count must be a positive integer (GPUs per instance), e.g. count=1, got True"),
    ],
)
def test_gpu_request_fields_of_the_wrong_type_say_what_to_write(gpus, message):
    import re

    with pytest.raises(SpotTrainingConfigError, match=re.escape(message)) as caught:
        build(gpus=gpus)
    assert "not supported between" not in str(caught.value) and "['A', '1'" not in str(caught.value)


@pytest.mark.parametrize(
    "gpus, message",
    [
        ({"names": ("A100x",)}, "gpus: unknown GPU name 'A100x' (did you mean 'A100' or "),
        ({"names": ["A10G", "L4x"]}, "unknown GPU name 'L4x' (did you mean 'L4'?) in names; valid GPU names "
                                     "(matched whatever their case): K80, T4, "),
        ({"names": ["A10G"], "exclude_names": ["K8O"]},
         "unknown GPU name 'K8O' (did you mean 'K80'?) in exclude_names"),
        # the names offered at the count asked for are listed
        ({"names": ["A1OG"]}, "those offered 1 per instance with >= 0 GiB each: ['A10G', 'L4', 'L40S', 'T4',"),
        # known GPUs, but not at this count: say how they come, not "lower gpus count or min_memory_gib"
        ({"names": ["H100"]}, "named ['H100']; those GPUs come as 8 x H100 (80 GiB each), and the GPUs offered 1 per "
                              "instance with >= 0 GiB each are ['A10G', "),
        ({"count": 8, "min_memory_gib": 80, "names": ["A100"]}, "those GPUs come as 8 x A100 (40 GiB each), and the "
                                                                "GPUs offered 8 per instance with >= 80 GiB each are "
                                                                "['A100-80GB', 'H100', 'H200']: choose names among"),
    ],
)
def test_a_gpu_name_no_offer_has_is_named_with_the_closest_known_ones(gpus, message):
    import re

    with pytest.raises(SpotTrainingConfigError, match=re.escape(message)) as caught:
        build(gpus=gpus)
    assert "lower gpus count or min_memory_gib" not in str(caught.value)


def test_gpu_names_match_whatever_their_case_as_on_the_command_line():
    dag = build(gpus={"names": ["a10g", "l4"], "exclude_names": ["k80"]})
    request = dag.task_dict["train.segment_000"].gpus
    assert request.names == ("A10G", "L4") and request.exclude_names == ("K80",)
    assert build(gpus=GpuRequest(names=("a100-80gb",), count=8)).task_dict["train.segment_000"].gpus.names == (
        "A100-80GB",)
    with pytest.raises(SpotTrainingConfigError, match=r"GPU names \['A10G'\] are both allowed"):
        build(gpus={"names": ["a10g"], "exclude_names": ["A10G"]})


def test_too_many_segments_fail_at_once_with_the_steps_per_segment_to_use():
    import re
    import time

    from airflow_spot.operators.validation import MAX_SEGMENTS, validate_steps

    started = time.monotonic()
    with pytest.raises(SpotTrainingConfigError, match=re.escape(
            f"total_steps=100000 in segments of steps_per_segment=1 is 100000 segments, more than the {MAX_SEGMENTS} "
            "a job may have")) as caught:
        build(total_steps=100_000, steps_per_segment=1)  # took over 10 minutes to parse
    assert time.monotonic() - started < 10
    assert f"use steps_per_segment >= {100_000 // MAX_SEGMENTS}" in str(caught.value)
    assert "minutes to hours of training" in str(caught.value) and "not the checkpoint interval" in str(caught.value)
    validate_steps(MAX_SEGMENTS * 10, 10)  # the most there may be
    validate_steps(MAX_SEGMENTS * 10 - 1, 10)
    with pytest.raises(SpotTrainingConfigError, match=f"is {MAX_SEGMENTS + 1} segments"):
        validate_steps(MAX_SEGMENTS * 10 + 1, 10)


def test_many_segments_parse_with_a_warning_that_says_what_to_change(caplog):
    from airflow_spot.operators.validation import WARN_SEGMENTS, validate_steps

    with caplog.at_level("WARNING", logger="airflow_spot.operators.validation"):
        validate_steps(WARN_SEGMENTS * 10, 10)
        assert not caplog.records
        validate_steps(WARN_SEGMENTS * 10 + 1, 10)
    assert f"is {WARN_SEGMENTS + 1} segments" in caplog.text and "steps_per_segment >= 11" in caplog.text
