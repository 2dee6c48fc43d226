"""The deployment's availability log: one object per event, safe for concurrent writers."""
from __future__ import annotations

import threading

import pytest

from airflow_spot.policy.observations import PoolEvent
from airflow_spot.storage.availability import AvailabilityLog, deployment_availability_uri
from airflow_spot.storage.object_store import open_store

POOL = "p3.2xlarge@us-west-2b"


def test_events_round_trip_in_time_order_and_filter_by_time(tmp_path):
    log = AvailabilityLog(open_store(str(tmp_path)))
    log.append(PoolEvent(POOL, "preempted", 300.0, "b"))
    log.append(PoolEvent(POOL, "launched", 100.0, "a"))
    log.append(PoolEvent("g5.xlarge@us-east-1a", "refused", 200.0, "a"))
    assert [(e.kind, e.at) for e in log.read()] == [("launched", 100.0), ("refused", 200.0), ("preempted", 300.0)]
    assert [e.at for e in log.read(since=150.0, until=250.0)] == [200.0]
    assert log.prune(before=250.0) == 2 and [e.at for e in log.read()] == [300.0]


def test_concurrent_writers_lose_nothing(tmp_path):
    # eight jobs appending at once: one object per event, so no write can overwrite another
    log = AvailabilityLog(open_store(str(tmp_path)))

    def writer(job):
        for i in range(25):
            log.append(PoolEvent(POOL, "refused", 1000.0 + i, job))  # same pool, same times for every job

    threads = [threading.Thread(target=writer, args=(f"job{j}",)) for j in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    events = log.read()
    assert len(events) == 200 and {e.job for e in events} == {f"job{j}" for j in range(8)}


def test_unreadable_entries_are_skipped(tmp_path):
    store = open_store(str(tmp_path))
    log = AvailabilityLog(store)
    log.append(PoolEvent(POOL, "launched", 5.0))
    store.put_bytes("x/0000000000010.000-j-partial.json", b"{not json")
    store.put_bytes("x/0000000000011.000-j-future.json", b'{"schema": 99, "pool": "a@b", "kind": "launched", "at": 11}')
    assert [e.at for e in log.read()] == [5.0]


def test_where_the_deployment_log_lives():
    env = {}
    assert deployment_availability_uri("s3://bucket/dag/run", environ=env) == "s3://bucket/dag/_availability"
    assert deployment_availability_uri("s3://bucket", environ=env) == "s3://bucket/_availability"
    assert deployment_availability_uri("file:///data/jobs/run1", environ=env) == "file:///data/jobs/_availability"
    env = {"AIRFLOW_SPOT_AVAILABILITY_URI": "s3://shared/avail"}
    assert deployment_availability_uri("s3://bucket/dag/run", environ=env) == "s3://shared/avail"
    assert deployment_availability_uri("s3://bucket/dag/run", "file:///explicit", environ=env) == "file:///explicit"


def test_a_bad_event_is_refused_before_it_is_written(tmp_path):
    with pytest.raises(ValueError, match="valid kinds"):
        AvailabilityLog(open_store(str(tmp_path))).append(PoolEvent(POOL, "maybe", 1.0))
