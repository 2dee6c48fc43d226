"""The deployment's availability log: one object per event, safe for concurrent writers."""
from __future__ import annotations

import threading

import pytest

from airflow_spot.policy.observations import PoolEvent
from airflow_spot.storage.availability import AvailabilityLog, deployment_availability_uri
from airflow_spot.storage.object_store import LocalStore, open_store

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


class CountingStore(LocalStore):
    """A file store that counts what the reader asks of it."""

    def __init__(self, root):
        super().__init__(root)
        self.gets, self.listed = 0, 0

    def get_bytes(self, key):
        self.gets += 1
        return super().get_bytes(key)

    def list(self, prefix="", **kw):
        out = super().list(prefix, **kw)
        self.listed += len(out)
        return out


def test_a_reader_of_given_pools_takes_events_from_names_alone(tmp_path):
    # a job reads the log at every decision: one GET per event made a month of a deployment's events cost
    # minutes a decision; the name carries the whole event
    store = CountingStore(tmp_path)
    log = AvailabilityLog(store)
    other = "g5.xlarge@us-east-1a"
    for i in range(50):
        log.append(PoolEvent(POOL, "probe-up" if i % 2 else "refused", 1000.0 + i * 60 + 0.25, f"dag.run-{i % 3}"))
        log.append(PoolEvent(other, "launched", 1000.0 + i * 60, "x"))
    log.append(PoolEvent(POOL, "preempted", 9000.5))  # this job's own: the job stays empty
    store.gets = store.listed = 0
    events = log.read(pools=[POOL])
    assert store.gets == 0 and len(events) == 51 and {e.pool for e in events} == {POOL}
    assert events == [e for e in log.read() if e.pool == POOL]  # what the bodies say
    assert events[-1] == PoolEvent(POOL, "preempted", 9000.5, "")
    assert events[1] == PoolEvent(POOL, "probe-up", 1060.25, "dag.run-1")


def test_a_reader_from_a_time_lists_only_from_there(tmp_path):
    store = CountingStore(tmp_path)
    log = AvailabilityLog(store)
    for i in range(200):
        log.append(PoolEvent(POOL, "launched", 1_800_000_000.0 + i * 3600, "a"))
    store.gets = store.listed = 0
    recent = log.read(pools=[POOL], since=1_800_000_000.0 + 190 * 3600, until=1_800_000_000.0 + 195 * 3600)
    assert [e.at for e in recent] == [1_800_000_000.0 + i * 3600 for i in range(190, 196)]
    assert store.gets == 0 and store.listed == 10  # the keys from 190 h on, not all 200


def test_entries_of_the_first_layout_are_still_read(tmp_path):
    # logs written before the names carried the kind: read from their bodies, with or without pools
    store = open_store(str(tmp_path))
    store.put_bytes("p3.2xlarge_us-west-2b/0001800000000.000-a-0123456789ab.json",
                    b'{"schema": 1, "pool": "p3.2xlarge@us-west-2b", "kind": "refused", "at": 1800000000.0, "job": "a"}')
    log = AvailabilityLog(store)
    log.append(PoolEvent(POOL, "launched", 1_800_000_060.0, "b"))
    expected = [PoolEvent(POOL, "refused", 1_800_000_000.0, "a"), PoolEvent(POOL, "launched", 1_800_000_060.0, "b")]
    assert log.read() == expected
    assert log.read(pools=[POOL]) == expected
    assert log.read(pools=[POOL], since=1_800_000_000.0) == expected
    assert log.read(pools=[POOL], since=1_800_000_000.5) == expected[1:]


def test_pools_that_share_a_folder_are_told_apart_by_their_bodies(tmp_path):
    # "a@b" and "a#b" both become the folder "a_b": the name cannot say whose an entry is
    log = AvailabilityLog(open_store(str(tmp_path)))
    log.append(PoolEvent("a@b", "launched", 10.0, "j"))
    log.append(PoolEvent("a#b", "refused", 20.0, "j"))
    assert [e.pool for e in log.read(pools=["a@b", "a#b"])] == ["a@b", "a#b"]
    assert [e.kind for e in log.read(pools=["a#b", "zzz@q"])] == ["refused"]
