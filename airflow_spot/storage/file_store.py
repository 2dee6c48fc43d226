"""The ``file://`` backend of :class:`~airflow_spot.storage.object_store.ObjectStore`: a folder on a local or
shared disk.

Kept apart from the interface and from ``s3://`` because its guarantees are POSIX ones (write a temporary
name, fsync, rename, fsync the folder) and its reads need a version of their own (modification time, size,
inode). Open it through :func:`~airflow_spot.storage.object_store.open_store`; ``LocalStore`` is importable
from :mod:`airflow_spot.storage.object_store` too.
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore, _EarlyWriteback, _feeder, file_uri


class LocalStore(ObjectStore):
    """``file://`` store: commit by write-to-temp, fsync, rename (atomic on POSIX)."""

    reads_in_place = True

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.uri = file_uri(str(self.root))

    def _path(self, key: str) -> Path:
        key = key.strip("/")
        if ".." in key.split("/"):
            raise ValueError(f"object key must not contain '..': {key!r}")
        return self.root / key if key else self.root

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.writing(key) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key) from None

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            if path.is_file():
                return path.stat().st_size
        except FileNotFoundError:
            pass  # removed between the two calls
        raise ObjectNotFound(key)

    def list(self, prefix: str = "", *, include_temporary: bool = False, start_after: str | None = None) -> list[str]:
        return sorted(rel for rel, _path in self._walk(prefix, include_temporary, start_after))

    #: a file modified less than this before it is listed has no version: a file system's clock ticks
    #: (1 s on some) could give a rewrite within the same tick the same time, size and a reused inode
    #: (git's "racy clean" rule)
    RACY_SECONDS = 2.0

    def list_versions(self, prefix: str = "", *, start_after: str | None = None) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        now = time.time()
        for rel, path in sorted(self._walk(prefix, False, start_after)):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue  # deleted since the walk saw it, as list() would have left it out a moment later
            out[rel] = self._version(st, now)
        return out

    @classmethod
    def _version(cls, st: os.stat_result, now: float) -> str | None:
        # a write renames a new file into place: its time moves on by at least RACY_SECONDS once settled
        if now - st.st_mtime < cls.RACY_SECONDS:
            return None
        return f"{st.st_mtime_ns}-{st.st_size}-{st.st_ino}"

    def get_many_versioned(self, keys: list[str]) -> dict[str, tuple[bytes, str | None]]:
        out = {}
        now = time.time()
        for key in keys:
            try:
                with open(self._path(key), "rb") as f:  # the version of the very file read, not of a later one
                    out[key] = (f.read(), self._version(os.fstat(f.fileno()), now))
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                continue
        return out

    def _walk(self, prefix: str, include_temporary: bool, start_after: str | None) -> Iterator[tuple[str, str]]:
        if self.root.exists() and not self.root.is_dir():  # not "empty": the store is gone or replaced
            raise NotADirectoryError(f"store root {self.root} exists but is not a directory")
        base = self._path(prefix) if prefix.endswith("/") or not prefix else self._path(prefix).parent
        if not base.is_dir():
            return
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-") and not include_temporary:
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, self.root).replace(os.sep, "/")
                if rel.startswith(prefix.lstrip("/")) and (start_after is None or rel > start_after):
                    yield rel, path

    def delete(self, keys: list[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            parents.add(path.parent)
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            if parent != self.root:
                with contextlib.suppress(OSError):  # not empty: something else lives there
                    parent.rmdir()

    def tidy(self) -> None:
        for dirpath, dirs, files in os.walk(self.root, topdown=False):
            if not dirs and not files and dirpath != str(self.root):
                with contextlib.suppress(OSError):  # a writer may have just created it
                    os.rmdir(dirpath)

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[str]:
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            yield str(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        with self.writing(key) as path, open(path, "wb") as f, _EarlyWriteback(f) as w:
            yield w

    @contextlib.contextmanager
    def reading(self, key: str, hasher=None) -> Iterator[str]:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        if hasher is not None:
            feed = _feeder(hasher)
            with open(path, "rb") as f:
                while block := f.read(8 * 1024 * 1024):
                    feed(block)
        yield str(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
