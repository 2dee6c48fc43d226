"""Reads of a store served again from memory while the object is unchanged: for a reader that reads the
same job over and over (the Spot Training page reloads a running job every 5 s).

A job's records are many small objects, nearly all final once written (ledger rows, statuses, launches,
requests, checkpoint manifests, the heartbeats of ended attempts); reading them all on every load made a
200-attempt job's page cost about a thousand GETs. :class:`CachedReads` wraps a store: its listings
come with each object's version (:meth:`ObjectStore.list_versions`: S3's ETag, a file's time, size and
inode), and a listed object whose version it has read before is served from a :class:`ReadCache`
shared by every reader of the process. Nothing is assumed final: an object written again has a new
version and is read again, and an object read without being listed (a fixed key such as
``control/job.json``) is always read. The cost of a load is then its LISTs and the objects that changed.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator

from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore


class ReadCache:
    """Objects by (store URI, key, version), least recently used dropped past ``max_bytes``; thread-safe."""

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
            self._bytes += len(raw) - (len(old) if old is not None else 0)
            self._items[key] = raw
            while self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= len(dropped)

    def __len__(self) -> int:
        return len(self._items)


class CachedReads(ObjectStore):
    """``inner`` with its reads of listed objects served from ``cache`` while their version is the listed one.

    Writes, deletes and transfers go to ``inner`` unchanged. One instance belongs to one reader at a time
    (it remembers the versions of what it listed); the cache may be shared. An object written again
    between its listing and its read is kept under the listed version; the next listing shows the new
    one, which is read again.
    """

    def __init__(self, inner: ObjectStore, cache: ReadCache) -> None:
        self.inner = inner
        self.cache = cache
        self.uri = inner.uri
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
    def _cache_key(self, key: str) -> tuple[str, str, str] | None:
        version = self._versions.get(key)
        return None if version is None else (self.uri, key, version)

    def get_bytes(self, key: str) -> bytes:
        ck = self._cache_key(key)
        raw = self.cache.get(ck) if ck else None
        if raw is None:
            raw = self.inner.get_bytes(key)
            if ck:
                self.cache.put(ck, raw)
        return raw

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        missing = []
        for key in keys:
            ck = self._cache_key(key)
            raw = self.cache.get(ck) if ck else None
            if raw is None:
                missing.append(key)
            else:
                found[key] = raw
        for key, raw in self.inner.get_many(missing).items():
            found[key] = raw
            ck = self._cache_key(key)
            if ck:
                self.cache.put(ck, raw)
        return {k: found[k] for k in keys if k in found}

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
