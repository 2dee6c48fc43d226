"""``CachedReads``: a listed object is read once while it is unchanged, and read again as soon as it is
written again, on file:// and on S3 (moto); what a reader sees is always what the store holds."""
from __future__ import annotations

import json
import os
import time

import pytest

from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.storage.job_view import JobView
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import LocalStore, ObjectStore, S3Store
from airflow_spot.storage.protocol import Heartbeat, JobLayout
from airflow_spot.storage.read_cache import CachedReads, ReadCache
from airflow_spot.testing.moto_s3 import FAKE_CREDENTIALS, create_bucket, moto_server


OFFER = {"instance_type": "g4dn.xlarge", "region": "us-east-1", "zone": "us-east-1a", "market": "spot",
         "price_per_hour": 0.2, "on_demand_price_per_hour": 0.526, "gpu_name": "T4", "gpu_count": 1,
         "gpu_memory_gib": 16.0, "relative_throughput": 0.4, "preemption_rate_per_hour": 0.1}


class CountingGets:
    """Counts the objects ``CachedReads`` reads from ``store`` (it reads through ``get_many_versioned``)."""

    def __init__(self, store: ObjectStore) -> None:
        self.gets: list[str] = []
        real = store.get_many_versioned

        def get_many_versioned(keys):
            self.gets.extend(keys)
            return real(keys)

        store.get_many_versioned = get_many_versioned


@pytest.fixture(autouse=True)
def settled_files(monkeypatch):
    """Files count as settled at once (the racy-file rule has its own test)."""
    monkeypatch.setattr(LocalStore, "RACY_SECONDS", 0.0)


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        yield LocalStore(tmp_path / "job")
        return
    with moto_server() as endpoint:
        for k, v in FAKE_CREDENTIALS.items():
            os.environ.setdefault(k, v)
        create_bucket(endpoint, "read-cache")
        yield S3Store("read-cache", f"dag/{request.node.name}", endpoint_url=endpoint)  # a server may be shared


def test_an_unchanged_object_is_read_once_and_a_rewritten_one_again(store):
    for i in range(5):
        store.put_bytes(f"control/ledger/a{i}.json", json.dumps({"i": i}).encode())
    counting = CountingGets(store)
    cache = ReadCache()

    def load() -> dict[str, bytes]:  # what one page load does: list, then read what it listed
        reader = CachedReads(store, cache)
        return reader.get_many(reader.list("control/ledger/"))

    first = load()
    assert len(counting.gets) == 5
    assert load() == first and len(counting.gets) == 5  # nothing changed: no GET at all
    time.sleep(0.01)  # a file's version carries its time; S3's its ETag (the content)
    store.put_bytes("control/ledger/a2.json", b'{"i": "two"}')
    store.put_bytes("control/ledger/a5.json", b'{"i": 5}')
    store.delete(["control/ledger/a0.json"])
    third = load()
    assert sorted(counting.gets[5:]) == ["control/ledger/a2.json", "control/ledger/a5.json"], counting.gets
    assert third == {**{k: v for k, v in first.items() if not k.endswith("a0.json")},
                     "control/ledger/a2.json": b'{"i": "two"}', "control/ledger/a5.json": b'{"i": 5}'}


def test_an_object_not_listed_is_always_read(store):
    store.put_bytes("control/job.json", b'{"v": 1}')
    counting = CountingGets(store)
    cache = ReadCache()
    for _ in range(3):
        assert CachedReads(store, cache).get_bytes("control/job.json") == b'{"v": 1}'
    assert len(counting.gets) == 3 and len(cache) == 0


def test_a_child_store_shares_the_cache_and_writes_go_through(store):
    cache = ReadCache()
    reader = CachedReads(store, cache)
    reader.child("checkpoints").put_bytes("000000000010-w/MANIFEST.json", b"m")
    assert store.get_bytes("checkpoints/000000000010-w/MANIFEST.json") == b"m"
    for _ in range(2):
        child = CachedReads(store, cache).child("checkpoints")
        assert child.get_many(child.list()) == {"000000000010-w/MANIFEST.json": b"m"}
    assert cache.hits == 1 and cache.misses == 1


def test_the_cache_drops_the_least_recently_used_past_its_size():
    unit = ReadCache._cost(("s", "k00", "v"), b"x" * 10)  # its bytes and what an entry costs besides
    cache = ReadCache(max_bytes=16 * unit)
    for i in range(5):
        cache.put(("s", f"k{i:02d}", "v"), b"x" * 10)
    assert cache.get(("s", "k00", "v")) == b"x" * 10  # k00 now the most recent
    for i in range(5, 20):
        cache.put(("s", f"k{i:02d}", "v"), b"x" * 10)
    assert len(cache) == 16 and cache.get(("s", "k00", "v")) is not None and cache.get(("s", "k01", "v")) is None
    cache.put(("s", "big", "v"), b"x" * (unit + 1))  # over a sixteenth of the budget: not kept
    assert cache.get(("s", "big", "v")) is None


def test_a_running_jobs_view_through_the_cache_is_the_view_of_the_store(store):
    """A job's snapshot read through the cache, reloaded while its running attempt beats, equals the one
    read from the store itself, and a reload reads only what was written since."""
    layout = JobLayout(store)
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": 1.8e9, "total_steps": 1000}).encode())
    for i in range(6):
        aid = f"train.segment_{i:03d}.try1"
        AttemptLaunch(aid, i, 100 * i, 100 * i + 100, f"i-{i}", OFFER, 1.8e9 + i, 1.8e9 + i, False, 1,
                      aid.rsplit(".", 1)[0], resume_step=100 * i).write(store)
        if i < 5:
            LedgerStore(store).write(LedgerRow(aid, f"i-{i}", "g4dn.xlarge", "us-east-1a", "spot", 0.2, 0.526,
                                               1.8e9 + i, 1.8e9 + i + 1, 100, "completed", segment_index=i))
        layout.write_heartbeat(Heartbeat(attempt_id=f"train.segment_{i:03d}.try1", step=100 * i, time=1.8e9 + i,
                                         step_time_ewma=0.5))
    cache = ReadCache()
    counting = CountingGets(store)
    now = 1.8e9 + 100
    first = JobView(CachedReads(store, cache)).snapshot(now)
    gets_per_load = len(counting.gets)
    assert first == JobView(store).snapshot(now)
    layout.write_heartbeat(Heartbeat(attempt_id="train.segment_005.try1", step=550, time=1.8e9 + 50,
                                     step_time_ewma=0.5))
    counting.gets.clear()
    cached = JobView(CachedReads(store, cache)).snapshot(now)
    reload_gets = list(counting.gets)
    assert cached == JobView(store).snapshot(now) and cached["current_step"] == 550
    # the new heartbeat, and the two fixed keys that are read without a listing (job record, summary)
    assert sorted(reload_gets) == sorted([JobLayout.heartbeat_key("train.segment_005.try1"), JobLayout.JOB_KEY,
                                          JobLayout.SUMMARY_KEY])
    assert gets_per_load >= 6 + 6 + 5  # the first load read every launch, heartbeat and ledger row


def test_an_object_written_again_between_its_listing_and_its_read_is_kept_under_what_was_read(store):
    """A load lists version A, the object is written again (B) before the load reads it: the bytes read
    are B's and kept under B's version, so a later load that lists A again (the object written back)
    reads A, and one that lists B is served B."""
    store.put_bytes("control/x.json", b"A")
    cache = ReadCache()
    reader = CachedReads(store, cache)
    reader.list("control/")
    time.sleep(0.01)
    store.put_bytes("control/x.json", b"B")
    assert reader.get_bytes("control/x.json") == b"B"
    time.sleep(0.01)
    store.put_bytes("control/x.json", b"A")
    again = CachedReads(store, cache)
    assert again.get_many(again.list("control/")) == {"control/x.json": b"A"}


def test_a_file_younger_than_the_racy_window_has_no_version(tmp_path, monkeypatch):
    """On file:// a rewrite within one tick of a coarse clock could keep time, size and (a reused) inode:
    a file modified within ``RACY_SECONDS`` of its listing is read every time."""
    monkeypatch.setattr(LocalStore, "RACY_SECONDS", 2.0)
    store = LocalStore(tmp_path)
    store.put_bytes("a.json", b"1")
    assert store.list_versions() == {"a.json": None}
    old = time.time() - 10
    os.utime(tmp_path / "a.json", (old, old))
    assert store.list_versions()["a.json"] is not None
    store.put_bytes("a.tmp-free.json", b"2")
    (tmp_path / ".tmp-a.json-123").write_bytes(b"partial")  # a killed writer's temp file: not an object
    assert sorted(store.list_versions()) == ["a.json", "a.tmp-free.json"]
    counting = CountingGets(store)
    cache = ReadCache()
    for _ in range(2):
        reader = CachedReads(store, cache)
        reader.get_many(reader.list())
    assert counting.gets.count("a.tmp-free.json") == 2 and counting.gets.count("a.json") == 1


def test_the_pages_read_through_the_process_cache(tmp_path):
    from airflow_spot.ui import jobs as ui_jobs

    store = LocalStore(tmp_path)
    LedgerStore(store).write(LedgerRow("a1", "i-1", "g4dn.xlarge", "us-east-1a", "spot", 0.2, 0.526, 1.8e9,
                                       1.8e9 + 10, 1, "completed"))
    old = time.time() - 10
    os.utime(tmp_path / "control" / "ledger" / "a1.json", (old, old))
    job = ui_jobs.JobRef("dag", "run", store.uri, None, "running")
    hits = ui_jobs.PAGE_READS.hits
    for _ in range(2):
        assert len(ui_jobs.open_view(job).ledger_rows()) == 1
    assert ui_jobs.PAGE_READS.hits == hits + 1
