from __future__ import annotations

import pytest

from airflow_spot.storage.object_store import (
    LocalStore,
    ObjectNotFound,
    S3Store,
    StoreConfigError,
    open_store,
)
from airflow_spot.testing.moto_s3 import create_bucket, moto_server


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_server() as endpoint:
        create_bucket(endpoint, "ckpt")
        yield endpoint


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path}/job")
    endpoint = request.getfixturevalue("s3_endpoint")
    return open_store(f"s3://ckpt/{tmp_path.name}/job", endpoint_url=endpoint)


def test_put_get_list_delete(store):
    store.put_bytes("a/one.json", b"1")
    store.put_bytes("a/b/two.json", b"2")
    store.put_bytes("c.json", b"3")
    assert store.get_bytes("a/one.json") == b"1"
    assert store.list() == ["a/b/two.json", "a/one.json", "c.json"]
    assert store.list("a/") == ["a/b/two.json", "a/one.json"]
    assert store.child("a").list() == ["b/two.json", "one.json"]
    store.delete(["a/one.json", "missing.json"])
    assert store.list("a/") == ["a/b/two.json"]
    with pytest.raises(ObjectNotFound):
        store.get_bytes("a/one.json")
    assert not store.exists("a/one.json") and store.exists("c.json")


def test_list_starts_after_a_key(store):
    # a time-ordered log is read from a time on: S3 lists only the keys after StartAfter
    for name in ("p/0001.json", "p/0002.json", "p/0003.json", "q/0002.json"):
        store.put_bytes(name, b"x")
    assert store.list("p/", start_after="p/0002") == ["p/0002.json", "p/0003.json"]
    assert store.list("p/", start_after="p/0002.json") == ["p/0003.json"]
    assert store.list("p/", start_after="p/9") == []
    assert store.list(start_after="p/0003.json") == ["q/0002.json"]
    assert store.child("p").list(start_after="0001.json") == ["0002.json", "0003.json"]


def test_get_many_returns_what_exists(store):
    # S3 reads them several at once; a key deleted since it was listed is left out, as a missing one
    keys = [f"ledger/{i:03d}.json" for i in range(20)]
    for i, k in enumerate(keys):
        store.put_bytes(k, str(i).encode())
    got = store.get_many(keys + ["ledger/gone.json"])
    assert got == {k: str(i).encode() for i, k in enumerate(keys)}
    assert store.get_many([]) == {} and store.get_many(["ledger/gone.json"]) == {}


def test_writing_publishes_only_on_success(store):
    with store.writing("data/blob") as path:
        with open(path, "wb") as f:
            f.write(b"x" * 1000)
    with store.reading("data/blob") as path:
        assert open(path, "rb").read() == b"x" * 1000
    with pytest.raises(RuntimeError):
        with store.writing("data/broken") as path:
            with open(path, "wb") as f:
                f.write(b"partial")
            raise RuntimeError("writer died")
    assert store.list("data/") == ["data/blob"]
    with pytest.raises(ObjectNotFound):
        with store.reading("data/broken"):
            pass


def test_s3_multipart_upload_round_trip(s3_endpoint, tmp_path):
    store = S3Store("ckpt", "multi", endpoint_url=s3_endpoint, multipart_chunk=5 * 1024 * 1024)
    payload = bytes(range(256)) * (12 * 1024 * 1024 // 256)  # 12 MiB: three parts
    with store.writing("big.bin") as path:
        open(path, "wb").write(payload)
    with store.reading("big.bin") as path:
        assert open(path, "rb").read() == payload


def test_bad_uris_are_explained(tmp_path):
    with pytest.raises(StoreConfigError, match="unsupported checkpoint URI scheme 'gs'"):
        open_store("gs://bucket/x")
    with pytest.raises(StoreConfigError, match="needs a bucket"):
        open_store("s3:///nobucket")
    with pytest.raises(StoreConfigError, match="absolute"):
        open_store("file://relative/path")
    assert isinstance(open_store(str(tmp_path)), LocalStore)


def test_check_writable_names_the_uri(tmp_path, s3_endpoint):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # unwritable below it even for root
    with pytest.raises(StoreConfigError, match="a-file/sub.*not writable"):
        open_store(f"file://{blocker}/sub").check_writable()
    missing = open_store("s3://no-such-bucket/x", endpoint_url=s3_endpoint)
    with pytest.raises(StoreConfigError, match="s3://no-such-bucket/x.*not writable"):
        missing.check_writable()
    open_store(f"file://{tmp_path}/ok").check_writable()


def test_local_store_rejects_parent_escape(tmp_path):
    with pytest.raises(ValueError, match=r"\.\."):
        open_store(str(tmp_path)).put_bytes("../evil", b"")


@pytest.mark.parametrize("size", [1000, 11 * 1024 * 1024])
def test_open_write_streams_and_aborts_cleanly(store, size):
    if isinstance(store, S3Store):
        store = S3Store(store.bucket, store.prefix, endpoint_url=store.endpoint_url,
                        multipart_chunk=5 * 1024 * 1024)
    data = bytes(range(256)) * (size // 256)
    with store.open_write("s/ok.bin") as f:
        for off in range(0, len(data), 1 << 20):
            f.write(data[off : off + (1 << 20)])
    with store.reading("s/ok.bin") as path:
        assert open(path, "rb").read() == data
    with pytest.raises(RuntimeError, match="serialiser died"):
        with store.open_write("s/aborted.bin") as f:
            f.write(data[: len(data) // 2])
            raise RuntimeError("serialiser died")
    assert store.list("s/") == ["s/ok.bin"], "a half-written object was published"


def test_reading_feeds_the_hasher(store):
    import hashlib

    store.put_bytes("h.bin", b"abc" * 1000)
    h = hashlib.sha256()
    with store.reading("h.bin", hasher=h):
        pass
    assert h.hexdigest() == hashlib.sha256(b"abc" * 1000).hexdigest()


def test_a_bucket_tells_its_region_and_a_local_store_has_none(s3_endpoint, tmp_path):
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, region_name="eu-central-1").create_bucket(
        Bucket="ckpt-frankfurt", CreateBucketConfiguration={"LocationConstraint": "eu-central-1"})
    assert open_store("s3://ckpt-frankfurt/job", endpoint_url=s3_endpoint).region() == "eu-central-1"
    # us-east-1 buckets answer no location constraint at all
    assert open_store("s3://ckpt/job", endpoint_url=s3_endpoint).region() == "us-east-1"
    assert open_store(f"file://{tmp_path}/job").region() is None


@pytest.mark.parametrize("uri", ["s3://bucket/a/b/", "s3://bucket", "file:///tmp/x/../y", "relative/dir", "/abs/z"])
def test_store_uri_names_the_store_as_open_store_does_without_a_client(uri):
    from airflow_spot.storage.object_store import store_uri

    assert store_uri(uri) == open_store(uri).uri


def test_exists_does_not_read_the_object(store, monkeypatch):
    # asking whether a key exists must not download it (S3: a HEAD request, not a GET of the whole object)
    store.put_bytes("big.bin", b"x" * 1024)
    monkeypatch.setattr(type(store), "get_bytes", lambda self, key: pytest.fail(f"exists() read {key}"))
    assert store.exists("big.bin") and not store.exists("absent.bin")
