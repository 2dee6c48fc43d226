"""The block SHA-256 a checkpoint's manifest names: its definition, its two ways in, and its manifests."""
from __future__ import annotations

import hashlib
import json
import random

import pytest

from airflow_spot.storage import block_digest
from airflow_spot.storage.block_digest import MAX_BLOCK_BYTES, MIN_BLOCK_BYTES, BlockSha256, block_sha256_of_file
from airflow_spot.storage.manifest import FileEntry, Manifest, ManifestError, manifest_checksum

BLOCK = MIN_BLOCK_BYTES


def reference(data: bytes, block: int) -> str:
    """The definition, written out: SHA-256 over the SHA-256 of each block, in order."""
    digests = b"".join(hashlib.sha256(data[i:i + block]).digest() for i in range(0, len(data), block))
    return hashlib.sha256(digests).hexdigest()


def pieces(data: bytes, rng: random.Random) -> list[bytes]:
    """``data`` cut at random places: tiny pieces, pieces across block ends, pieces of many blocks."""
    out, pos = [], 0
    while pos < len(data):
        n = rng.choice([1, 7, BLOCK - 3, BLOCK, BLOCK + 5, 3 * BLOCK + 11, 4096])
        out.append(data[pos:pos + n])
        pos += n
    return out


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 10 * BLOCK + 12345])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_digest_is_the_hash_of_the_blocks_hashes_however_the_bytes_arrive(size, seed):
    rng = random.Random(seed * 1000 + size)
    data = rng.randbytes(size)
    want = reference(data, BLOCK)
    for way in ("update", "owned", "mixed"):
        h = BlockSha256(BLOCK)
        for i, piece in enumerate(pieces(data, rng)):
            if way == "update" or (way == "mixed" and i % 2):
                h.update(memoryview(piece))
            else:
                h.update_owned(piece)
        assert h.size == size
        assert h.hexdigest() == want, way


def test_update_leaves_the_callers_buffer_free_when_it_returns():
    # a serialiser refills one buffer after each write: the digest must be that of the bytes as written
    rng = random.Random(5)
    buf = bytearray(3 * BLOCK + 100)
    written = []
    h = BlockSha256(BLOCK)
    for _ in range(12):
        n = rng.choice([10, BLOCK // 2, len(buf)])
        buf[:n] = rng.randbytes(n)
        h.update(memoryview(buf)[:n])
        written.append(bytes(buf[:n]))
        buf[:] = b"\xff" * len(buf)  # the caller reuses the buffer at once
    assert h.hexdigest() == reference(b"".join(written), BLOCK)


def test_the_digest_differs_from_a_whole_file_sha256_and_names_the_block_size():
    data = random.Random(2).randbytes(3 * BLOCK)
    h = BlockSha256(BLOCK)
    h.update_owned(data)
    assert h.hexdigest() != hashlib.sha256(data).hexdigest()
    h2 = BlockSha256(2 * BLOCK)
    h2.update_owned(data)
    assert h2.hexdigest() != h.hexdigest()


def test_digest_of_a_file_and_of_nothing(tmp_path):
    data = random.Random(3).randbytes(5 * BLOCK + 17)
    path = tmp_path / "f"
    path.write_bytes(data)
    assert block_sha256_of_file(str(path), BLOCK, read_bytes=BLOCK // 3) == reference(data, BLOCK)
    assert BlockSha256(BLOCK).hexdigest() == hashlib.sha256(b"").hexdigest()


def test_bad_block_sizes_and_mutable_owned_bytes_are_refused():
    for bad in (0, MIN_BLOCK_BYTES - 1, MAX_BLOCK_BYTES + 1, 2**40, 1.5, True, "8M"):
        with pytest.raises(ValueError, match="is not an integer from 65536 to 268435456"):
            BlockSha256(bad)
    with pytest.raises(TypeError, match="immutable"):
        BlockSha256(BLOCK).update_owned(bytearray(10))


# ---- manifests

def _manifest_json(schema: int, entry: dict) -> bytes:
    d = {"step": 3, "directory": "000000000003-w-0123abcd", "files": [entry], "writer": "w",
         "created_at": 1.0, "save_seconds": 0.1, "meta": {}, "schema": schema}
    d["checksum"] = manifest_checksum(d)
    return json.dumps(d).encode()


def test_a_manifest_carries_the_block_size_and_old_manifests_keep_whole_file_digests(tmp_path):
    block = FileEntry("state.pt", 5, "a" * 64, BLOCK)
    m = Manifest(3, "000000000003-w-0123abcd", (block,), "w", 1.0, 0.1).sealed()
    back = Manifest.from_json(m.to_json(), "000000000003-w-0123abcd")
    assert back.files[0].sha256_block == BLOCK and back.schema == 3
    # schema 2 (and schema 3 without the field): the digest is the whole file's SHA-256
    for schema in (2, 3):
        old = Manifest.from_json(_manifest_json(schema, {"name": "state.pt", "size": 5, "sha256": "b" * 64}))
        assert old.files[0].sha256_block == 0
        assert "sha256_block" not in json.loads(old.to_json())["files"][0]
    path = tmp_path / "p"
    path.write_bytes(b"hello")
    assert FileEntry("p", 5, "", 0).file_digest(str(path)) == hashlib.sha256(b"hello").hexdigest()
    assert FileEntry("p", 5, "", BLOCK).file_digest(str(path)) == reference(b"hello", BLOCK)


@pytest.mark.parametrize("schema, block, problem", [
    (2, BLOCK, "names sha256_block, which needs manifest schema 3 or newer, not 2"),  # never written so
    (3, 100, "sha256_block 100 of 'state.pt' is not an integer from 65536 to 268435456"),
    (3, 2**40, "is not an integer from"),  # would hold a whole payload in memory while it is verified
    (3, 0, "is not an integer from"),
    (3, "8M", "is not an integer"),
    (5, BLOCK, "schema 5 is newer than this code understands; upgrade airflow-spot"),
])
def test_a_malformed_block_size_makes_the_manifest_untrusted(schema, block, problem):
    raw = _manifest_json(schema, {"name": "state.pt", "size": 5, "sha256": "b" * 64, "sha256_block": block})
    with pytest.raises(ManifestError, match=problem):
        Manifest.from_json(raw)


def test_a_manifest_of_whole_file_digests_is_stamped_schema_2_so_older_versions_read_it():
    whole = Manifest(3, "000000000003-w-0123abcd", (FileEntry("state.pt", 5, "a" * 64),), "w", 1.0, 0.1).sealed()
    block = Manifest(3, "000000000003-w-0123abcd", (FileEntry("state.pt", 5, "a" * 64, BLOCK),), "w", 1.0,
                     0.1).sealed()
    assert (whole.schema, block.schema) == (2, 3)
    for m in (whole, block):
        assert Manifest.from_json(m.to_json(), m.directory) == m


def test_update_and_the_digest_stay_consistent_when_a_block_cannot_be_handed_to_the_pool(monkeypatch):
    data = random.Random(7).randbytes(3 * BLOCK)
    h = BlockSha256(BLOCK)
    h.update(memoryview(data[:BLOCK // 2]))
    real = block_digest._submit
    monkeypatch.setattr(block_digest, "_submit", lambda pieces: (_ for _ in ()).throw(MemoryError("no room")))
    with pytest.raises(MemoryError):
        h.update(memoryview(data[BLOCK // 2:]))
    monkeypatch.setattr(block_digest, "_submit", real)
    # nothing of the failed call was counted or hashed: feeding it again gives the whole stream's digest
    assert h.size == BLOCK // 2
    h.update(memoryview(data[BLOCK // 2:]))
    assert h.hexdigest() == reference(data, BLOCK)


def test_the_callers_buffer_can_be_resized_as_soon_as_update_returns():
    buf = bytearray(random.Random(8).randbytes(2 * 1024 * 1024 + 5))  # large: hashed by reference
    h = BlockSha256(BLOCK)
    for _ in range(50):
        h.update(buf)
        buf.extend(b"x")  # BufferError if a view into it were still held
        del buf[-1:]
    assert h.size == 50 * len(buf) and h.hexdigest() == reference(bytes(buf) * 50, BLOCK)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork")  # what the test is about
def test_a_forked_child_hashes_with_a_pool_of_its_own():
    import os
    import select
    import signal

    data = random.Random(9).randbytes(6 * BLOCK)
    h = BlockSha256(BLOCK)
    h.update(data)  # the parent's pool exists and has threads
    want = h.hexdigest()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the inherited pool has no threads; it must make its own
        try:
            c = BlockSha256(BLOCK)
            c.update(data)
            os.write(w, c.hexdigest().encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 30)
        assert ready, "the forked child hung hashing"
        assert os.read(r, 64).decode() == want
    finally:
        os.close(r)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_blocks_in_flight_are_bounded(monkeypatch):
    from concurrent.futures import Future

    pending: list[Future] = []

    def never_done(pieces):  # blocks that take their time: feeding must stop and wait, not pile them up
        f = Future()
        pending.append(f)
        if len(pending) > block_digest.hash_workers() + 2:
            pending[0].set_result(b"\0" * 32)
            pending.pop(0)
        return f

    monkeypatch.setattr(block_digest, "_submit", never_done)
    h = BlockSha256(BLOCK)
    for _ in range(4 * block_digest.hash_workers() + 10):
        h.update_owned(bytes(BLOCK))
        assert len(h._in_flight) <= block_digest.hash_workers() + 2
    # and by bytes: large blocks wait in fewer numbers (a manifest may name blocks of 256 MiB)
    assert BlockSha256(block_digest.MAX_BLOCK_BYTES)._max_in_flight == 1
    assert BlockSha256(64 * 1024 * 1024)._max_in_flight == min(4, block_digest.hash_workers() + 2)


def test_a_finished_block_keeps_only_its_digest():
    h = BlockSha256(BLOCK)
    h.update(random.Random(10).randbytes(40 * BLOCK))
    import time

    deadline = time.monotonic() + 10  # the last callbacks run just after the waits return
    while any(not isinstance(d, bytes) for d in h._digests) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(h._digests) == 40 and all(isinstance(d, bytes) and len(d) == 32 for d in h._digests)


def _tree(tmp_path, files: dict[str, str], proc: str, mounts: list[tuple[str, str, str]]):
    """A cgroup tree under ``tmp_path/cg``, ``/proc/self/cgroup`` and a mountinfo whose mounts are
    ``(fstype, root, super options)`` at ``tmp_path/cg``, one mount each (v1: one per controller set)."""
    base = tmp_path / "cg"
    for rel, text in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    lines = []
    for i, (fstype, root, options) in enumerate(mounts):
        point = base / options.split(",", 1)[1] if fstype == "cgroup" else base
        point.mkdir(parents=True, exist_ok=True)
        lines.append(f"{30 + i} 23 0:{28 + i} {root} {point} rw,nosuid - {fstype} {fstype} {options}")
    lines.insert(0, "22 1 0:21 / /proc rw - proc proc rw")
    (tmp_path / "proc").write_text(proc)
    (tmp_path / "mountinfo").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "proc"), str(tmp_path / "mountinfo")


def test_cpu_quota_is_the_tightest_of_the_cgroup_and_its_parents_v2(tmp_path):
    paths = _tree(tmp_path, {
        "kubepods/cpu.max": "200000 100000\n",  # the pod: 2 cores
        "kubepods/c1/cpu.max": "max 100000\n",  # the container: no limit of its own
    }, "0::/kubepods/c1\n", [("cgroup2", "/", "rw")])
    assert block_digest.cgroup_cpu_cores(*paths) == 2
    # a container with a cgroup namespace: its own cgroup is the mount's root, and its path is /
    paths = _tree(tmp_path / "b", {"cpu.max": "250000 100000\n"}, "0::/\n", [("cgroup2", "/", "rw")])
    assert block_digest.cgroup_cpu_cores(*paths) == 3
    paths = _tree(tmp_path / "c", {"x/cpu.max": "max 100000\n"}, "0::/x\n", [("cgroup2", "/", "rw")])
    assert block_digest.cgroup_cpu_cores(*paths) is None


def test_cpu_quota_of_cgroup_v1_below_the_mounts_own_root(tmp_path):
    # no cgroup namespace: the container's cgroup /docker/abc is mounted at the mount point, and the
    # process sits in a child of it (systemd inside the container) with the tighter quota
    paths = _tree(tmp_path, {
        "cpu,cpuacct/cpu.cfs_quota_us": "400000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/system.slice/x/cpu.cfs_quota_us": "150000\n",
        "cpu,cpuacct/system.slice/x/cpu.cfs_period_us": "100000\n",
    }, "4:memory:/docker/abc/system.slice/x\n2:cpu,cpuacct:/docker/abc/system.slice/x\n0::/\n",
        [("cgroup", "/docker/abc", "rw,cpu,cpuacct"), ("cgroup", "/docker/abc", "rw,memory")])
    assert block_digest.cgroup_cpu_cores(*paths) == 2
    # the controllers listed the other way round, and no quota (-1) anywhere
    paths = _tree(tmp_path / "b", {
        "cpuacct,cpu/cpu.cfs_quota_us": "-1\n", "cpuacct,cpu/cpu.cfs_period_us": "100000\n",
    }, "3:cpuacct,cpu:/\n", [("cgroup", "/", "rw,cpuacct,cpu")])
    assert block_digest.cgroup_cpu_cores(*paths) is None
    # a cgroup outside the mount's root: only the mount point can be read
    paths = _tree(tmp_path / "c", {
        "cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n",
    }, "3:cpu:/elsewhere/y\n", [("cgroup", "/docker/abc", "rw,cpu")])
    assert block_digest.cgroup_cpu_cores(*paths) == 1
    assert block_digest.cgroup_cpu_cores(str(tmp_path / "none"), str(tmp_path / "none")) is None
