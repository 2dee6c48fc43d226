"""A store that cannot lose progress silently: manifest checksums, directory cross-checks, no silent restart."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil

import pytest

from airflow_spot.storage.checkpoint import (
    MANIFEST,
    MANIFEST_SCHEMA,
    CheckpointSaveError,
    CheckpointStore,
    Manifest,
    ManifestError,
    NoUsableCheckpointError,
    manifest_checksum,
)
from airflow_spot.storage.object_store import open_store
from airflow_spot.testing.manifest_faults import build_store, payload_for, run_campaign


def _read(path: str) -> bytes:
    return open(path, "rb").read()


@pytest.fixture
def ckpts(tmp_path):
    return CheckpointStore(open_store(str(tmp_path / "checkpoints")), writer="try1")


def _manifest_key(ckpts: CheckpointStore, step: int) -> str:
    return next(f"{m.directory}/{MANIFEST}" for m in ckpts.committed() if m.step == step)


def test_flipped_step_digit_never_restores_the_wrong_step(ckpts, caplog):
    """The issue's case: one bit turns "step": 200 into 280 while the payload still matches."""
    build_store(ckpts, [100, 200])
    key = _manifest_key(ckpts, 200)
    raw = ckpts.store.get_bytes(key)
    assert b'"step": 200' in raw
    ckpts.store.put_bytes(key, raw.replace(b'"step": 200', b'"step": 280'))  # '0' ^ 0x08 == '8'
    with caplog.at_level(logging.ERROR):
        manifest, data = ckpts.restore_latest(_read)
    assert (manifest.step, data) == (100, payload_for(100))
    assert ckpts.latest_step() == 100
    assert any("checksum" in r.getMessage() and key.split("/")[0] in r.getMessage() for r in caplog.records)


def test_unparsable_sole_manifest_is_an_error_not_a_fresh_start(ckpts):
    m = ckpts.save(5, lambda f: f.write(b"five"))
    ckpts.store.put_bytes(f"{m.directory}/{MANIFEST}", b'{"step": 5, "dire')
    with pytest.raises(NoUsableCheckpointError) as err:
        ckpts.restore_latest(_read)
    message = str(err.value)
    assert m.directory in message and "not valid JSON" in message
    assert f"airflow-spot checkpoints verify {ckpts.store.uri}" in message
    assert "checkpoints restore --step N" in message
    with pytest.raises(NoUsableCheckpointError):
        ckpts.latest_step()  # the job must not look fresh to the operator either


def test_unparsable_newest_falls_back_to_older_verified_and_logs_error(ckpts, caplog):
    build_store(ckpts, [1, 2, 3])
    ckpts.store.put_bytes(_manifest_key(ckpts, 3), b"\x00garbage")
    with caplog.at_level(logging.ERROR):
        manifest, data = ckpts.restore_latest(_read)
        assert ckpts.latest_step() == 2
    assert (manifest.step, data) == (2, payload_for(2))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("000000000003-try1-" in e for e in errors)


@pytest.mark.parametrize("field,value", [
    ("step", 7), ("writer", "other"), ("created_at", 1.0), ("save_seconds", 9.0), ("meta", {"reason": "x"}),
    ("schema", 1), ("files", [{"name": "state.pt", "size": 1, "sha256": "0" * 64}]),
])
def test_any_edited_field_breaks_the_checksum(ckpts, field, value):
    m = ckpts.save(3, lambda f: f.write(b"three"))
    d = json.loads(ckpts.store.get_bytes(f"{m.directory}/{MANIFEST}"))
    d[field] = value
    with pytest.raises(ManifestError, match="checksum does not match"):
        Manifest.from_json(json.dumps(d).encode(), m.directory)


@pytest.mark.parametrize("field,value,problem", [
    ("step", 4, "says step 4 but the directory name says 3"),
    ("directory", "000000000003-try1-00000000", "names directory"),
    ("writer", "try2", "says writer 'try2'"),
])
def test_resealed_manifest_is_still_cross_checked_against_its_directory(ckpts, field, value, problem):
    """Even with a valid checksum (a tool rewrote it), the directory name is an independent record."""
    m = ckpts.save(3, lambda f: f.write(b"three"))
    d = json.loads(ckpts.store.get_bytes(f"{m.directory}/{MANIFEST}"))
    d[field] = value
    d["checksum"] = manifest_checksum(d)
    with pytest.raises(ManifestError, match=problem):
        Manifest.from_json(json.dumps(d).encode(), m.directory)


def test_swapped_manifest_is_rejected_and_restore_falls_back(ckpts):
    build_store(ckpts, [10, 20])
    older, newer = _manifest_key(ckpts, 10), _manifest_key(ckpts, 20)
    ckpts.store.put_bytes(newer, ckpts.store.get_bytes(older))
    statuses = ckpts.scan()
    assert [s.ok for s in statuses] == [True, False] and "does not belong to its directory" in statuses[1].problem
    assert ckpts.restore_latest(_read)[0].step == 10


def test_checksum_cannot_be_dodged_by_downgrading_the_schema_or_dropping_it(ckpts):
    m = ckpts.save(3, lambda f: f.write(b"three"))
    d = json.loads(ckpts.store.get_bytes(f"{m.directory}/{MANIFEST}"))
    # one payload file: the oldest schema that holds it (3, block digests), not MANIFEST_SCHEMA (4, sharded)
    assert d["schema"] == 3 < MANIFEST_SCHEMA and d["checksum"] == manifest_checksum(d)
    downgraded = dict(d, schema=1)
    with pytest.raises(ManifestError, match="checksum"):
        Manifest.from_json(json.dumps(downgraded).encode(), m.directory)
    dropped = {k: v for k, v in d.items() if k != "checksum"}
    with pytest.raises(ManifestError, match="has no checksum"):
        Manifest.from_json(json.dumps(dropped).encode(), m.directory)


def test_legacy_manifest_without_checksum_is_read_but_cross_checked(ckpts):
    """Schema-1 manifests (written before the checksum) still restore; their step is checked against the
    directory name and their payload against its sha256."""
    m = ckpts.save(40, lambda f: f.write(b"forty"))
    key = f"{m.directory}/{MANIFEST}"
    legacy = {k: v for k, v in json.loads(ckpts.store.get_bytes(key)).items() if k != "checksum"}
    legacy["schema"] = 1  # which named the payload's whole-file sha256
    legacy["files"] = [{"name": "state.pt", "size": 5, "sha256": hashlib.sha256(b"forty").hexdigest()}]
    ckpts.store.put_bytes(key, json.dumps(legacy).encode())
    assert ckpts.restore_latest(_read)[1] == b"forty"
    ckpts.store.put_bytes(key, json.dumps(dict(legacy, step=48)).encode())
    with pytest.raises(NoUsableCheckpointError, match="says step 48 but the directory name says 40"):
        ckpts.restore_latest(_read)


def test_corruption_campaign_small_deterministic(tmp_path):
    """50 corruptions of a 4-checkpoint store (the chaos suite runs >= 1,000): none restores the wrong step
    or starts silently from scratch."""
    ckpts = CheckpointStore(open_store(str(tmp_path / "ckpts")), writer="w")
    keys = build_store(ckpts, [100, 200, 300, 400])
    result = run_campaign(ckpts, keys, cases=50, seed=8)
    assert result.failures == []
    v = result.verdicts
    assert v["wrong_restore"] == v["silent_restart"] == v["refused"] == v["wrong_latest"] == 0
    assert v["correct"] + v["latest_ahead_unhashed"] == 50
    assert v["fell_back"] >= 3 and v["raised_no_intact"] >= 3  # it really damaged the newest / every checkpoint
    assert ckpts.restore_latest(_read)[0].step == 400  # every case put the store back


def test_store_replaced_under_the_job_gives_a_clear_error_and_keeps_what_was_saved(tmp_path):
    root = tmp_path / "job"
    ckpts = CheckpointStore(open_store(str(root)), writer="w")
    ckpts.save(1, lambda f: f.write(b"one"))
    moved = tmp_path / "moved-away"
    root.rename(moved)
    root.write_text("not a directory any more")  # e.g. a mount point gone, a file in its place
    with pytest.raises(CheckpointSaveError, match="cannot save the checkpoint at step 2 .* committed checkpoints"):
        ckpts.save(2, lambda f: f.write(b"two"))
    with pytest.raises(NotADirectoryError):
        ckpts.restore_latest(_read)  # an error, never "no checkpoint: start from 0"
    root.unlink()
    moved.rename(root)
    assert ckpts.restore_latest(_read)[1] == b"one"


def test_checkpoint_directory_deleted_mid_save_fails_that_save_only(tmp_path):
    root = tmp_path / "job"
    ckpts = CheckpointStore(open_store(str(root)), writer="w")
    first = ckpts.save(1, lambda f: f.write(b"one"))
    shutil.copytree(root, tmp_path / "backup")

    def write_then_lose_directory(f):
        f.write(b"two")
        shutil.rmtree(root)  # someone deletes the checkpoint directory while the save runs

    with pytest.raises(CheckpointSaveError, match="step 2"):
        ckpts.save(2, write_then_lose_directory)
    assert ckpts.scan() == []  # no manifest was committed without its payload
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(tmp_path / "backup", root)
    assert ckpts.restore_latest(_read) == (first, b"one")


def test_payload_deleted_after_commit_falls_back(ckpts):
    build_store(ckpts, [1, 2])
    newest = ckpts.committed()[-1]
    ckpts.store.delete([f"{newest.directory}/state.pt"])
    assert ckpts.restore_latest(_read)[0].step == 1
    statuses = ckpts.inspect()
    assert statuses[-1].problem.endswith("file is missing")


def test_s3_store_gone_mid_run_is_a_clear_save_error(tmp_path):
    pytest.importorskip("moto")
    import boto3

    from airflow_spot.testing.moto_s3 import create_bucket, moto_server

    with moto_server() as endpoint:
        create_bucket(endpoint, "vanishing")
        ckpts = CheckpointStore(open_store("s3://vanishing/job/checkpoints", endpoint_url=endpoint), writer="w")
        ckpts.save(1, lambda f: f.write(b"one"))
        s3 = boto3.client("s3", endpoint_url=endpoint)
        for obj in s3.list_objects_v2(Bucket="vanishing")["Contents"]:
            s3.delete_object(Bucket="vanishing", Key=obj["Key"])
        s3.delete_bucket(Bucket="vanishing")
        with pytest.raises(CheckpointSaveError, match="NoSuchBucket"):
            ckpts.save(2, lambda f: f.write(b"two"))
        with pytest.raises(Exception, match="NoSuchBucket"):
            ckpts.restore_latest(_read)  # the store's own error, never "no checkpoint"


def test_no_checkpoint_at_all_is_still_none(ckpts):
    assert ckpts.restore_latest(_read) is None and ckpts.latest_step() is None
    ckpts.store.put_bytes("000000000007-w-deadbeef/state.pt", b"orphan")  # a save killed before its manifest
    assert ckpts.restore_latest(_read) is None and ckpts.latest_step() is None

