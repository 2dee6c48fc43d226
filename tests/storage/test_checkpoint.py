from __future__ import annotations

import io
import logging
import threading

import pytest

from airflow_spot.storage.checkpoint import MANIFEST, CheckpointError, CheckpointStore, Manifest
from airflow_spot.storage.object_store import open_store


def _write(data: bytes):
    return lambda f: f.write(data)


def _read(path: str) -> bytes:
    return open(path, "rb").read()


@pytest.fixture
def ckpts(tmp_path):
    return CheckpointStore(open_store(str(tmp_path / "checkpoints")), writer="try1")


def test_manifest_is_written_last_and_describes_the_data(ckpts):
    m = ckpts.save(10, _write(b"hello"), {"reason": "periodic"})
    assert m.step == 10 and m.files[0].size == 5 and m.meta == {"reason": "periodic"}
    keys = ckpts.store.list()
    assert keys == [f"{m.directory}/{MANIFEST}", f"{m.directory}/state.pt"]
    assert Manifest.from_json(ckpts.store.get_bytes(keys[0])) == m
    assert ckpts.restore_latest(_read) == (m, b"hello")
    assert ckpts.latest_step() == 10


def test_empty_job_has_no_checkpoint(ckpts):
    assert ckpts.latest_step() is None
    assert ckpts.restore_latest(_read) is None


def test_save_without_manifest_is_invisible(ckpts):
    ckpts.save(5, _write(b"five"))
    with pytest.raises(RuntimeError):
        ckpts.save(6, lambda f: (f.write(b"half"), (_ for _ in ()).throw(RuntimeError("killed"))))
    # a data file whose manifest never arrived (a writer killed between the two)
    ckpts.store.put_bytes("000000000007-try2-deadbeef/state.pt", b"orphan")
    assert ckpts.latest_step() == 5
    assert ckpts.restore_latest(_read)[1] == b"five"


def test_flipped_byte_falls_back_to_previous_and_logs(ckpts, caplog):
    ckpts.save(1, _write(b"first"))
    newest = ckpts.save(2, _write(b"second"))
    path = ckpts.store._path(f"{newest.directory}/state.pt")
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0x01
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.ERROR):
        manifest, data = ckpts.restore_latest(_read)
    assert (manifest.step, data) == (1, b"first")
    assert "step 2" in caplog.text and "sha256 mismatch" in caplog.text


def test_truncated_file_and_unparseable_payload_fall_back(ckpts):
    ckpts.save(1, _write(b"good"))
    bad = ckpts.save(2, _write(b"not what read() expects"))
    ckpts.save(3, _write(b"three"))
    ckpts.store._path(f"{ckpts.committed()[-1].directory}/state.pt").write_bytes(b"thr")  # truncated

    def picky(path):
        data = _read(path)
        if data.startswith(b"not"):
            raise ValueError("cannot parse")
        return data

    assert ckpts.restore_latest(picky)[1] == b"good"
    assert bad.step == 2


def test_retention_cleans_abandoned_partial_saves_with_no_more_than_keep_committed(ckpts):
    """A writer killed inside a save leaves a partial directory; the next prune removes it even when exactly
    ``keep`` checkpoints are committed (the kill-during-save suite left them piling up in CI)."""
    for step in (4, 5):
        ckpts.save(step, _write(bytes([step])))
    ckpts.store.put_bytes("000000000003-killed-aaaa/state.pt", b"abandoned")
    ckpts.store.put_bytes("000000000009-live-bbbb/state.pt", b"in flight")
    ckpts.prune(keep=2)
    remaining = {k.split("/")[0] for k in ckpts.store.list(include_temporary=True)}
    assert "000000000003-killed-aaaa" not in remaining and "000000000009-live-bbbb" in remaining
    assert [m.step for m in ckpts.committed()] == [4, 5]


def test_all_checkpoints_corrupt_is_an_error_not_a_fresh_start(ckpts):
    m = ckpts.save(1, _write(b"x"))
    ckpts.store._path(f"{m.directory}/state.pt").write_bytes(b"y")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpts.restore_latest(_read)


def test_retention_keeps_last_k_and_spares_newer_partial_saves(ckpts):
    for step in range(1, 6):
        ckpts.save(step, _write(bytes([step])))
    ckpts.store.put_bytes("000000000002-old-aaaa/state.pt", b"abandoned")
    ckpts.store.put_bytes("000000000009-live-bbbb/state.pt", b"in flight")
    ckpts.prune(keep=2)
    assert [m.step for m in ckpts.committed()] == [4, 5]
    remaining = {k.split("/")[0] for k in ckpts.store.list()}
    assert "000000000002-old-aaaa" not in remaining
    assert "000000000009-live-bbbb" in remaining
    with pytest.raises(ValueError):
        ckpts.prune(keep=0)


def test_racing_writers_never_interleave(tmp_path):
    """Two attempts of one job saving the same steps at once: every committed checkpoint is whole."""
    root = open_store(str(tmp_path / "checkpoints"))
    errors = []

    def writer(name: str, fill: int):
        store = CheckpointStore(root, writer=name)
        try:
            for step in range(20):
                store.save(step, _write(bytes([fill]) * 50_000))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(f"try{i}", i)) for i in (1, 2)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    assert not errors
    ckpts = CheckpointStore(root)
    committed = ckpts.committed()
    assert len(committed) == 40
    for m in committed:
        with root.reading(f"{m.directory}/state.pt") as path:
            data = _read(path)
        ckpts.verify(m, path=_tmp(data, tmp_path), entry=m.files[0])
        assert len(set(data)) == 1 and data[0] == int(m.writer[-1])


def _tmp(data: bytes, tmp_path) -> str:
    p = tmp_path / "copy.bin"
    p.write_bytes(data)
    return str(p)


def test_negative_step_rejected(ckpts):
    with pytest.raises(ValueError, match="step must be >= 0"):
        ckpts.save(-1, _write(b""))


def test_hashing_writer_accepts_memoryviews(ckpts):
    buf = io.BytesIO(b"abc" * 100)
    m = ckpts.save(1, lambda f: f.write(buf.getbuffer()))
    assert m.files[0].size == 300
    assert ckpts.restore_latest(_read)[1] == b"abc" * 100


def test_large_chunks_are_hashed_in_order_while_the_caller_may_reuse_its_buffer(ckpts, monkeypatch):
    # a chunk of 1 MB or more is hashed beside its write, its blocks on several threads: the digest must
    # still be that of the bytes in the order written, as they were when written (the caller refills
    # its buffer after each write)
    import hashlib

    from airflow_spot.storage import checkpoint
    from airflow_spot.storage.block_digest import MIN_BLOCK_BYTES

    monkeypatch.setattr(checkpoint._HashingWriter, "PARALLEL_BYTES", 4096)
    ckpts.block_bytes = MIN_BLOCK_BYTES
    chunk = bytearray(MIN_BLOCK_BYTES * 3 // 2)
    written = []

    def write(f):
        for i in range(40):
            chunk[:] = bytes([i % 251]) * len(chunk)
            f.write(chunk if i % 3 else memoryview(chunk)[: 100 + i])  # large and small, mixed
            written.append(bytes(chunk if i % 3 else chunk[: 100 + i]))

    m = ckpts.save(3, write)
    data = b"".join(written)
    blocks = b"".join(hashlib.sha256(data[i:i + MIN_BLOCK_BYTES]).digest()
                      for i in range(0, len(data), MIN_BLOCK_BYTES))
    assert m.files[0].sha256 == hashlib.sha256(blocks).hexdigest() and m.files[0].size == len(data)
    assert m.files[0].sha256_block == MIN_BLOCK_BYTES
    assert ckpts.restore_latest(_read)[1] == data


def test_a_checkpoint_whose_manifest_names_a_whole_file_sha256_still_restores_and_is_still_checked(ckpts):
    # checkpoints saved before block digests (manifest schema 2) stay readable after an upgrade
    import hashlib
    import json

    from airflow_spot.storage.manifest import manifest_checksum

    m = ckpts.save(4, _write(b"payload-4"))
    d = json.loads(ckpts.store.get_bytes(f"{m.directory}/MANIFEST.json"))
    d.pop("checksum")
    d["schema"] = 2
    d["files"] = [{"name": "state.pt", "size": 9, "sha256": hashlib.sha256(b"payload-4").hexdigest()}]
    d["checksum"] = manifest_checksum(d)
    ckpts.store.put_bytes(f"{m.directory}/MANIFEST.json", json.dumps(d).encode())
    got, payload = ckpts.restore_latest(_read)
    assert (got.step, got.schema, got.files[0].sha256_block, payload) == (4, 2, 0, b"payload-4")
    assert all(s.ok for s in ckpts.inspect())
    ckpts.store.put_bytes(f"{m.directory}/state.pt", b"payload-5")  # same size, other bytes
    assert "sha256 mismatch" in ckpts.inspect()[0].problem


def test_a_file_save_flushes_to_disk_while_it_writes_and_a_failed_flush_fails_the_save(ckpts, monkeypatch):
    from airflow_spot.storage import object_store
    from airflow_spot.storage.checkpoint import CheckpointSaveError

    monkeypatch.setattr(object_store._EarlyWriteback, "EVERY_BYTES", 64 * 1024)
    flushed = []
    real = object_store._fdatasync
    monkeypatch.setattr(object_store, "_fdatasync", lambda fd: flushed.append(fd) or real(fd))
    payload = bytes(range(256)) * 4096  # 1 MiB in 16 writes of 64 KiB
    m = ckpts.save(1, lambda f: [f.write(payload[i:i + 65536]) for i in range(0, len(payload), 65536)])
    assert flushed, "nothing was flushed before the commit"
    assert ckpts.restore_latest(_read) == (m, payload)

    def broken(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(object_store, "_fdatasync", broken)
    with pytest.raises(CheckpointSaveError, match="Input/output error"):
        ckpts.save(2, lambda f: [f.write(payload[i:i + 65536]) for i in range(0, len(payload), 65536)])
    assert ckpts.latest_step() == 1  # nothing committed for step 2


def test_saves_write_whole_file_digests_that_older_versions_read_when_the_deployment_asks(tmp_path, monkeypatch):
    """AIRFLOW_SPOT_CHECKPOINT_DIGEST=sha256, for an upgrade or a rollback across block digests: a schema-2
    manifest naming the payload's plain SHA-256; anything else is refused before anything is saved."""
    import hashlib
    import json

    from airflow_spot.storage.checkpoint import DIGEST_ENV
    from airflow_spot.training.session import SpotSession

    monkeypatch.setenv(DIGEST_ENV, "sha256")
    ckpts = CheckpointStore(open_store(str(tmp_path / "a")), writer="try1")
    m = ckpts.save(5, _write(b"five" * 1000))
    d = json.loads(ckpts.store.get_bytes(f"{m.directory}/{MANIFEST}"))
    assert d["schema"] == 2 and d["files"] == [
        {"name": "state.pt", "size": 4000, "sha256": hashlib.sha256(b"five" * 1000).hexdigest()}]
    assert ckpts.restore_latest(_read)[1] == b"five" * 1000
    monkeypatch.setenv(DIGEST_ENV, "Block ")
    assert CheckpointStore(open_store(str(tmp_path / "b"))).save(1, _write(b"x")).schema == 3
    monkeypatch.setenv(DIGEST_ENV, "md5")
    bad = "AIRFLOW_SPOT_CHECKPOINT_DIGEST='md5' is not a checkpoint digest: use 'block'"
    with pytest.raises(ValueError, match=bad):  # the training process fails at its start, not its first save
        SpotSession(f"file://{tmp_path}/d", 10, notice_sources=[], heartbeat_seconds=3600)
    with pytest.raises(ValueError, match=bad):
        CheckpointStore(open_store(str(tmp_path / "c"))).save(1, _write(b"x"))
    # a reader (the UI, planning) does not depend on the writers' setting
    assert ckpts.restore_latest(_read)[1] == b"five" * 1000
