"""The ranks of one host fetch a checkpoint's files once between them (``storage/host_share.py``).

A store that downloads (as S3 does: ``reading`` yields a fresh local copy) counts its downloads; readers on
threads stand in for ranks (``flock`` locks of two open files exclude each other within one process too).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time

import pytest

from airflow_spot.storage.checkpoint import PAYLOAD, CheckpointError, CheckpointStore
from airflow_spot.storage.file_store import LocalStore
from airflow_spot.storage.host_share import SHARE_PREFIX, HostShare


class DownloadingStore(LocalStore):
    """A file:// store that hands out downloaded copies, like S3, slowly, counting each download."""

    reads_in_place = False

    def __init__(self, root) -> None:
        super().__init__(root)
        self.downloads: list[str] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reading(self, key: str, hasher=None):
        with self._lock:
            self.downloads.append(key)
        time.sleep(0.05)  # a slow download: a second reader arrives while the first still fetches
        with super().reading(key, hasher) as path:
            fd, tmp = tempfile.mkstemp(prefix="test-down-")
            os.close(fd)
            shutil.copyfile(path, tmp)
        try:
            yield tmp
        finally:
            os.unlink(tmp)


@pytest.fixture
def saved(tmp_path):
    store = DownloadingStore(tmp_path / "ckpts")
    ckpts = CheckpointStore(store, writer="w")
    manifest = ckpts.save(5, lambda f: f.write(b"model bytes" * 1000))
    return ckpts, manifest


def _read_all(ckpts: CheckpointStore, directory: str, token: str, root, n: int) -> list[bytes]:
    got: list[bytes] = [b""] * n
    errors: list[BaseException] = []

    def rank(i: int) -> None:
        try:
            share = HostShare(token, root=str(root))
            got[i] = ckpts.sharing(share).restore(directory, lambda p: open(p, "rb").read())[1]
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return got


def test_four_ranks_of_one_host_download_the_payload_once(saved, tmp_path):
    ckpts, manifest = saved
    got = _read_all(ckpts, manifest.directory, "t1", tmp_path, 4)
    assert got == [b"model bytes" * 1000] * 4
    assert ckpts.store.downloads == [f"{manifest.directory}/{PAYLOAD}"]
    # without a share each reads its own copy: the number a host paid before
    for _ in range(2):
        ckpts.restore(manifest.directory, lambda p: None)
    assert len(ckpts.store.downloads) == 3


def test_ranks_of_another_host_fetch_their_own_copy(saved, tmp_path):
    ckpts, manifest = saved
    _read_all(ckpts, manifest.directory, "t2", tmp_path / "host-a", 2)
    _read_all(ckpts, manifest.directory, "t2", tmp_path / "host-b", 2)  # another temporary directory
    assert len(ckpts.store.downloads) == 2


def test_a_corrupt_file_is_never_served_to_another_rank(saved, tmp_path):
    ckpts, manifest = saved
    path = ckpts.store.root / manifest.directory / PAYLOAD
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF
    path.write_bytes(bytes(raw))
    share = HostShare("t3", root=str(tmp_path))
    for _ in range(2):  # each reader downloads and rejects it: nothing unverified was put in the share
        with pytest.raises(CheckpointError, match="sha256 mismatch"):
            ckpts.sharing(share).restore(manifest.directory, lambda p: None)
    assert len(ckpts.store.downloads) == 2
    assert [n for n in os.listdir(share.folder) if not n.endswith(".lock")] == []
    assert (share.fetched, share.reused) == (0, 0)


def test_a_sharded_checkpoints_files_are_linked_out_of_the_share_not_copied(tmp_path):
    store = DownloadingStore(tmp_path / "ckpts")
    ckpts = CheckpointStore(store, writer="w")
    directory = ckpts.new_directory(3)
    entries = [ckpts.put_file(directory, name, lambda f, n=name: f.write(n.encode() * 100), 3)
               for name in (PAYLOAD, ".metadata", "__0_0.distcp")]
    manifest = ckpts.commit(3, directory, tuple(entries), {}, 0.1, layout="dcp")
    share = HostShare("t4", root=str(tmp_path))
    for rank in ("rank0", "rank1"):  # each rank its own folder (DCP's reader), from one share
        (tmp_path / rank).mkdir()
        ckpts.sharing(HostShare("t4", root=str(tmp_path))).fetch_all(manifest, str(tmp_path / rank))
    assert len(store.downloads) == 3  # the second rank fetched nothing
    shard = tmp_path / "rank1" / "__0_0.distcp"
    assert shard.read_bytes() == b"__0_0.distcp" * 100 and shard.stat().st_nlink == 3  # share + two ranks
    share.remove()
    assert not os.path.exists(share.folder) and shard.read_bytes() == b"__0_0.distcp" * 100


def test_a_file_store_reads_in_place_and_ignores_the_share(tmp_path):
    ckpts = CheckpointStore(LocalStore(tmp_path / "ckpts"), writer="w")
    manifest = ckpts.save(1, lambda f: f.write(b"x"))
    view = ckpts.sharing(HostShare("t5", root=str(tmp_path)))
    assert view.share is None and ckpts.share is None
    path = view.restore(manifest.directory, lambda p: p)[1]
    assert path == str(tmp_path / "ckpts" / manifest.directory / PAYLOAD)


@pytest.mark.parametrize("token", ["", "../up", "a b", "x/y"])
def test_a_token_that_is_not_a_plain_name_is_refused(token, tmp_path):
    with pytest.raises(ValueError, match="letters, digits"):
        HostShare(token, root=str(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(SHARE_PREFIX)]
