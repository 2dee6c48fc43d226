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


def test_a_reader_takes_events_from_names_reading_one_body_per_pool(tmp_path):
    # a job reads the log at every decision: one GET per event made a month of a deployment's events cost
    # minutes a decision; the name carries the event, a body only the pool's exact name
    store = CountingStore(tmp_path)
    log = AvailabilityLog(store)
    other = "g5.xlarge@us-east-1a"
    for i in range(50):
        log.append(PoolEvent(POOL, "probe-up" if i % 2 else "refused", 1000.0 + i * 60 + 0.25, f"dag.run-{i % 3}"))
        log.append(PoolEvent(other, "launched", 1000.0 + i * 60, "x"))
    log.append(PoolEvent(POOL, "preempted", 9000.5))  # this job's own: the job stays empty
    store.gets = 0
    everything = log.read()
    assert store.gets == 2 and len(everything) == 101  # one body per pool
    store.gets = 0
    mine = log.read(pools=[POOL])
    assert store.gets == 0 and mine == [e for e in everything if e.pool == POOL]
    assert mine[-1] == PoolEvent(POOL, "preempted", 9000.5, "")
    assert mine[1] == PoolEvent(POOL, "probe-up", 1060.25, "dag.run-1")


def test_times_read_from_names_are_exact(tmp_path):
    log = AvailabilityLog(open_store(str(tmp_path)))
    at = 1_754_000_000.1234567
    log.append(PoolEvent(POOL, "launched", at, "j"))
    assert [e.at for e in log.read()] == [at] == [e.at for e in log.read(pools=[POOL], until=at, since=at)]


def test_a_reader_from_a_time_lists_only_from_there(tmp_path):
    store = CountingStore(tmp_path)
    log = AvailabilityLog(store)
    for i in range(200):
        log.append(PoolEvent(POOL, "launched", 1_800_000_000.0 + i * 3600, "a"))
    store.gets = store.listed = 0
    recent = log.read(pools=[POOL], since=1_800_000_000.0 + 190 * 3600, until=1_800_000_000.0 + 195 * 3600)
    assert [e.at for e in recent] == [1_800_000_000.0 + i * 3600 for i in range(190, 196)]
    assert store.gets == 0 and store.listed == 10  # the keys from 190 h on, not all 200
    assert log.read(pools=[POOL], since=float("inf")) == [] and len(log.read(pools=[POOL], since=float("-inf"))) == 200


def test_entries_of_the_first_layout_are_still_read(tmp_path):
    # logs written before the names carried the event: read from their bodies, with or without pools
    store = open_store(str(tmp_path))
    store.put_bytes("p3.2xlarge_us-west-2b/0001800000000.000-a-0123456789ab.json",
                    b'{"schema": 1, "pool": "p3.2xlarge@us-west-2b", "kind": "refused", "at": 1800000000.0, "job": "a"}')
    # the name rounds to the ms: its body's time, 0.4 ms before a reader's ``since``, decides
    store.put_bytes("p3.2xlarge_us-west-2b/0001800000001.000-a-0123456789ac.json",
                    b'{"schema": 1, "pool": "p3.2xlarge@us-west-2b", "kind": "refused", "at": 1800000000.9996, "job": "a"}')
    log = AvailabilityLog(store)
    log.append(PoolEvent(POOL, "launched", 1_800_000_060.0, "b"))
    expected = [PoolEvent(POOL, "refused", 1_800_000_000.0, "a"), PoolEvent(POOL, "refused", 1_800_000_000.9996, "a"),
                PoolEvent(POOL, "launched", 1_800_000_060.0, "b")]
    assert log.read() == expected
    assert log.read(pools=[POOL]) == expected
    assert log.read(pools=[POOL], since=1_800_000_000.0) == expected
    assert log.read(pools=[POOL], since=1_800_000_001.0) == expected[2:]
    assert log.prune(before=1_800_000_001.0, dry_run=True) == 1 and len(log.read()) == 3  # by the names' times


def test_pools_that_share_a_folder_are_told_apart_by_their_tags(tmp_path):
    # "a@b" and "a#b" both become the folder "a_b": the tag in the name, a hash of the exact pool, says
    # whose an entry is; a first-layout entry there is read from its body
    store = CountingStore(tmp_path)
    log = AvailabilityLog(store)
    log.append(PoolEvent("a@b", "launched", 10.0, "j"))
    log.append(PoolEvent("a#b", "refused", 20.0, "j"))
    store.put_bytes("a_b/0000000000030.000-j-0123456789ab.json",
                    b'{"schema": 1, "pool": "a@b", "kind": "preempted", "at": 30.0, "job": "j"}')
    store.gets = 0
    assert [e.pool for e in log.read(pools=["a@b", "a#b"])] == ["a@b", "a#b", "a@b"]
    assert store.gets == 1  # the first-layout entry's body only
    assert [e.kind for e in log.read(pools=["a#b", "zzz@q"])] == ["refused"]
    assert [(e.pool, e.kind) for e in log.read()] == [("a@b", "launched"), ("a#b", "refused"), ("a@b", "preempted")]


def test_the_reader_on_s3(tmp_path):
    # the same reads through S3's listing (StartAfter, byte order) as through a folder
    from airflow_spot.testing.moto_s3 import create_bucket, moto_server

    with moto_server() as endpoint:
        create_bucket(endpoint, "avail-log")
        s3 = AvailabilityLog(open_store("s3://avail-log/dep/_availability", endpoint_url=endpoint))
        local = AvailabilityLog(open_store(str(tmp_path)))
        events = [PoolEvent(p, k, 1_800_000_000.0 + i * 97.3, j) for i, (p, k, j) in enumerate(
            [(POOL, "launched", "a"), ("g5.xlarge@us-east-1a", "refused", "b"), (POOL, "preempted", ""),
             ("a@b", "probe-up", "c.d-e"), (POOL, "probe-down", "a"), ("a#b", "running", "b")])]
        for log in (s3, local):
            log.extend(events)
        for kw in ({}, {"pools": [POOL]}, {"pools": [POOL, "a@b"], "since": 1_800_000_100.0},
                   {"since": 1_800_000_200.0, "until": 1_800_000_400.0}):
            assert s3.read(**kw) == local.read(**kw), kw
        assert s3.read() == events
