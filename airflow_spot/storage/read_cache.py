"""Reads of a store served again from memory while the object is unchanged: for a reader that reads the
same job over and over (the Spot Training page reloads a running job every 5 s).

A job's records are many small objects, nearly all final once written (ledger rows, statuses, launches,
requests, checkpoint manifests, the heartbeats of ended attempts); reading them all on every load made a
200-attempt job's page cost about a thousand GETs. :class:`CachedReads` wraps a store: its listings
come with each object's version (:meth:`ObjectStore.list_versions`: S3's ETag; a file's time, size and
inode, none while the file is younger than ``LocalStore.RACY_SECONDS``), and a listed object whose
version it has read before is served from a :class:`ReadCache` shared by every reader of the process.
Nothing is assumed final: an object written again has a new version and is read again, and an object
read without being listed (a fixed key such as ``control/job.json``) is always read. The cost of a load
is then its LISTs, its fixed keys and the objects that changed.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator

from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore


#: what one kept object costs besides its bytes (the entry, its key's strings), charged to ``max_bytes``
ENTRY_OVERHEAD = 400


class ReadCache:
    """Objects by (store URI, key, version), least recently used dropped past ``max_bytes`` (the objects'
    bytes and :data:`ENTRY_OVERHEAD` each); thread-safe."""

    def __init__(self, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: tuple[str, str, str]) -> bytes | None:
        with self._lock:
            raw = self._items.get(key)
            if raw is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return raw

    def put(self, key: tuple[str, str, str], raw: bytes) -> None:
        if len(raw) > self.max_bytes // 16:  # one large object must not flush the many small ones
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= self._cost(key, old)
            self._items[key] = raw
            self._bytes += self._cost(key, raw)
            while self._bytes > self.max_bytes:
                dropped_key, dropped = self._items.popitem(last=False)
                self._bytes -= self._cost(dropped_key, dropped)

    @staticmethod
    def _cost(key: tuple[str, str, str], raw: bytes) -> int:
        return len(raw) + sum(map(len, key)) + ENTRY_OVERHEAD

    def __len__(self) -> int:
        return len(self._items)


class CachedReads(ObjectStore):
    """``inner`` with its reads of listed objects served from ``cache`` while their version is the listed one.

    Writes, deletes and transfers go to ``inner`` unchanged. One instance serves one load (it remembers the
    versions its listings showed: open a new one for the next load, so an object read without a listing
    is never answered from an older one); the cache is shared. Bytes are kept under the version of the
    bytes read (:meth:`ObjectStore.get_many_versioned`), so an object written again between its listing
    and its read is served only when a listing shows that newer version.
    """

    def __init__(self, inner: ObjectStore, cache: ReadCache) -> None:
        self.inner = inner
        self.cache = cache
        self.uri = inner.uri
        self.reads_in_place = inner.reads_in_place
        self._versions: dict[str, str | None] = {}

    # ------------------------------------------------------------------ listing remembers versions
    def list_versions(self, prefix: str = "", *, start_after: str | None = None) -> dict[str, str | None]:
        versions = self.inner.list_versions(prefix, start_after=start_after)
        self._versions.update(versions)
        return versions

    def list(self, prefix: str = "", *, include_temporary: bool = False, start_after: str | None = None) -> list[str]:
        if include_temporary:  # temp files have no version worth keeping: retention's listing, not a read
            return self.inner.list(prefix, include_temporary=True, start_after=start_after)
        return sorted(self.list_versions(prefix, start_after=start_after))

    # ------------------------------------------------------------------ reads
    def get_bytes(self, key: str) -> bytes:
        got = self.get_many([key])
        if key not in got:
            raise ObjectNotFound(key)
        return got[key]

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        missing = []
        for key in keys:
            version = self._versions.get(key)
            raw = self.cache.get((self.uri, key, version)) if version is not None else None
            if raw is None:
                missing.append(key)
            else:
                found[key] = raw
        for key, (raw, version) in self.inner.get_many_versioned(missing).items():
            found[key] = raw
            # kept under the version of the bytes read, which a listing may show again (a key read without
            # a listing, such as the job record, is read every time: not kept)
            if version is not None and key in self._versions:
                self.cache.put((self.uri, key, version), raw)
        return {k: found[k] for k in keys if k in found}

    def get_many_versioned(self, keys: list[str]) -> dict[str, tuple[bytes, str | None]]:
        return self.inner.get_many_versioned(keys)

    # ------------------------------------------------------------------ everything else is the inner store's
    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)

    def delete(self, keys: list[str]) -> None:
        self.inner.delete(keys)
        for key in keys:
            self._versions.pop(key, None)

    def writing(self, key: str) -> contextlib.AbstractContextManager[str]:
        return self.inner.writing(key)

    def reading(self, key: str, hasher=None) -> contextlib.AbstractContextManager[str]:
        return self.inner.reading(key, hasher)

    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator:
        with self.inner.open_write(key) as f:
            yield f

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def tidy(self) -> None:
        self.inner.tidy()

    def region(self) -> str | None:
        return self.inner.region()

    def child(self, prefix: str) -> ObjectStore:
        return CachedReads(self.inner.child(prefix), self.cache)

    def at(self, uri: str) -> ObjectStore:
        return CachedReads(self.inner.at(uri), self.cache)


__all__ = ["CachedReads", "ObjectNotFound", "ReadCache"]
