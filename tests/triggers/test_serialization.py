"""Every trigger of the provider survives serialise -> JSON -> import by class path -> serialise."""
from __future__ import annotations

import importlib
import json

import pytest

from airflow_spot.triggers.segment import SegmentTrigger

TRIGGERS = [
    SegmentTrigger(
        job_uri="s3://bucket/dag/run",
        attempt_id="train.segment_001.try3",
        instance_id="local-0001",
        requested_at=1_700_000_000.5,
        backend="local",
        backend_options={"state_dir": "/tmp/x", "preemption": {"mode": "schedule", "at_seconds": [1.0, 2.0]}},
        aws_conn_id=None,
        market_options={"catalog_path": "/tmp/prices.csv"},
        poll_interval=0.5,
        startup_timeout=60,
        heartbeat_timeout=30,
        max_attempt_seconds=3600,
    ),
    SegmentTrigger(job_uri="file:///tmp/job", attempt_id="a", instance_id="i", requested_at=0.0),
]


@pytest.mark.parametrize("trigger", TRIGGERS, ids=lambda t: type(t).__name__)
def test_round_trip(trigger):
    classpath, kwargs = trigger.serialize()
    kwargs = json.loads(json.dumps(kwargs))  # plain JSON only, as the triggerer's table stores it
    module, _, name = classpath.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert rebuilt.serialize() == (classpath, kwargs)
    assert rebuilt.serialize() == trigger.serialize()


def test_a_trigger_serialised_before_market_options_keeps_them_unknown():
    classpath, kwargs = TRIGGERS[1].serialize()
    kwargs.pop("market_options")  # as an older version wrote it
    module, _, name = classpath.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert rebuilt.market_options is None and TRIGGERS[0].market_options == {"catalog_path": "/tmp/prices.csv"}


def test_serialised_through_airflows_encoder():
    from airflow.serialization.serialized_objects import BaseSerialization

    classpath, kwargs = TRIGGERS[0].serialize()
    encoded = BaseSerialization.serialize(kwargs)
    assert BaseSerialization.deserialize(json.loads(json.dumps(encoded))) == kwargs


def test_a_trigger_from_a_newer_version_waits_without_the_arguments_it_does_not_know():
    """A rolling upgrade reaches a worker before the triggerer: the older triggerer must not fail the try
    over an option it does not have (stall_timeout did exactly that once)."""
    classpath, kwargs = TRIGGERS[1].serialize()
    kwargs["an_option_from_the_future"] = 1
    module, _, name = classpath.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert "an_option_from_the_future" not in rebuilt.serialize()[1]


def test_the_default_stall_timeout_is_not_serialised_so_the_previous_triggerer_still_takes_it():
    """The version before stall_timeout has no such argument and no **kwargs: a worker upgraded first must
    not send it by default (a triggerer then failed every try); a trigger without it applies the default."""
    from airflow_spot.triggers.segment import DEFAULT_STALL_TIMEOUT

    _, kwargs = TRIGGERS[1].serialize()
    assert "stall_timeout" not in kwargs and SegmentTrigger(**kwargs).stall_timeout == DEFAULT_STALL_TIMEOUT
    _, kwargs = SegmentTrigger(job_uri="f", attempt_id="a", instance_id="i", requested_at=0.0,
                               stall_timeout=None).serialize()
    assert kwargs["stall_timeout"] is None and SegmentTrigger(**kwargs).stall_timeout is None
