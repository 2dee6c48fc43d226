"""Committed checkpoints: data files first, manifest last, verified on restore.

Layout (relative to the store, usually ``<job>/checkpoints``)::

    <step:012d>-<writer>-<nonce>/state.pt        payload, written first
    <step:012d>-<writer>-<nonce>/MANIFEST.json   written last: step, files, sizes, sha256, save time

A checkpoint exists only once its manifest does, and the manifest names the files with their checksums,
so a crash mid-save leaves a directory without a manifest, which restore ignores. Every save goes to a
directory of its own (writer id + random nonce): two attempts of one job racing can never interleave
into one checkpoint, and nothing committed is ever overwritten.

This module knows nothing about torch: callers pass a ``write(fileobj)`` and a ``read(path)`` function.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
PAYLOAD = "state.pt"
MANIFEST_SCHEMA = 1
_DIR_RE = re.compile(r"^(\d{12})-")


class CheckpointError(RuntimeError):
    """No usable checkpoint could be read, or a save failed."""


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    directory: str
    files: tuple[FileEntry, ...]
    writer: str
    created_at: float
    save_seconds: float
    meta: dict[str, Any] = field(default_factory=dict)
    schema: int = MANIFEST_SCHEMA

    def to_json(self) -> bytes:
        d = asdict(self)
        d["files"] = [asdict(f) for f in self.files]
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Manifest":
        d = json.loads(raw)
        if int(d.get("schema", 0)) > MANIFEST_SCHEMA:
            raise CheckpointError(f"manifest schema {d.get('schema')} is newer than this code understands")
        d["files"] = tuple(FileEntry(**f) for f in d["files"])
        return cls(**d)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


class _HashingWriter:
    """File wrapper that checksums and counts bytes as they are written (no second read)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha.update(data)
        n = self._f.write(data)
        self.size += len(memoryview(data).cast("B")) if n is None else n
        return n if n is not None else len(data)

    def flush(self) -> None:
        self._f.flush()


def sha256_file(path: str, chunk: int = 8 * 1024 * 1024) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class CheckpointStore:
    """Save, list, verify, restore and prune the checkpoints of one job.

    :param store: object store rooted at the job's ``checkpoints/`` prefix.
    :param writer: identity of this writer (an attempt id); part of every directory name it creates.
    """

    def __init__(self, store: ObjectStore, writer: str = "local") -> None:
        self.store = store
        self.writer = re.sub(r"[^A-Za-z0-9_.=-]+", "_", writer)

    # ---- writing
    def save(
        self, step: int, write: Callable[[BinaryIO], None], meta: dict[str, Any] | None = None
    ) -> Manifest:
        """Write one checkpoint at ``step`` and commit it. Returns the committed manifest."""
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        started = time.monotonic()
        directory = f"{step:012d}-{self.writer}-{uuid.uuid4().hex[:8]}"
        with self.store.open_write(f"{directory}/{PAYLOAD}") as raw:
            hw = _HashingWriter(raw)
            write(hw)
            raw.flush()
        manifest = Manifest(
            step=step,
            directory=directory,
            files=(FileEntry(PAYLOAD, hw.size, hw.sha.hexdigest()),),
            writer=self.writer,
            created_at=time.time(),
            save_seconds=time.monotonic() - started,
            meta=dict(meta or {}),
        )
        self.store.put_bytes(f"{directory}/{MANIFEST}", manifest.to_json())  # the commit point
        return manifest

    # ---- reading
    def committed(self) -> list[Manifest]:
        """Committed checkpoints, oldest first. Unreadable manifests are skipped with a warning."""
        out = []
        for key in self.store.list():
            if not key.endswith("/" + MANIFEST):
                continue
            try:
                out.append(Manifest.from_json(self.store.get_bytes(key)))
            except (ObjectNotFound, ValueError, KeyError, TypeError, CheckpointError) as exc:
                log.warning("ignoring unreadable checkpoint manifest %s: %s", key, exc)
        return sorted(out, key=lambda m: (m.step, m.created_at))

    def latest_step(self) -> int | None:
        """Step of the newest committed checkpoint (manifest present; not checksum-verified)."""
        committed = self.committed()
        return committed[-1].step if committed else None

    def verify(self, manifest: Manifest, path: str, entry: FileEntry, digest: str | None = None) -> None:
        """Check size and sha256 of a fetched payload against its manifest (``digest`` if already known)."""
        size = os.path.getsize(path)
        if size != entry.size:
            raise CheckpointError(
                f"checkpoint {manifest.directory}/{entry.name}: size {size} != {entry.size} in manifest"
            )
        if (digest or sha256_file(path)) != entry.sha256:
            raise CheckpointError(
                f"checkpoint {manifest.directory}/{entry.name}: sha256 mismatch (corrupt or tampered)"
            )

    def restore_latest(self, read: Callable[[str], Any]) -> tuple[Manifest, Any] | None:
        """Read the newest checkpoint that verifies; fall back to older ones, newest first.

        ``read(path)`` parses the verified payload; if it raises, that checkpoint is skipped too.
        Returns ``None`` when the job has no checkpoint at all.
        :raises CheckpointError: when checkpoints exist but none of them is usable.
        """
        candidates = self.committed()
        errors = []
        for manifest in reversed(candidates):
            entry = manifest.files[0]
            try:
                hasher = hashlib.sha256()
                with self.store.reading(f"{manifest.directory}/{entry.name}", hasher=hasher) as path:
                    self.verify(manifest, path, entry, digest=hasher.hexdigest())
                    return manifest, read(path)
            except Exception as exc:  # any failure of one checkpoint means: try the previous one
                log.error(
                    "checkpoint at step %d (%s) is unusable, falling back to the previous one: %s",
                    manifest.step, manifest.directory, exc,
                )
                errors.append(f"{manifest.directory}: {exc}")
        if candidates:
            raise CheckpointError("no usable checkpoint; tried newest first:\n  " + "\n  ".join(errors))
        return None

    # ---- retention
    def prune(self, keep: int) -> list[str]:
        """Keep the newest ``keep`` committed checkpoints; delete older ones and abandoned partial saves
        older than the oldest kept one. Partial directories newer than that may be a live writer's."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        committed = self.committed()
        if len(committed) <= keep:
            return []
        kept = committed[-keep:]
        kept_dirs = {m.directory for m in kept}
        oldest_kept_step = kept[0].step
        doomed = []
        for key in self.store.list(include_temporary=True):
            directory = key.split("/", 1)[0]
            m = _DIR_RE.match(directory)
            if not m or directory in kept_dirs:
                continue
            if int(m.group(1)) < oldest_kept_step or any(directory == c.directory for c in committed):
                doomed.append(key)
        # delete manifests first so a half-pruned checkpoint is never seen as committed
        doomed.sort(key=lambda k: not k.endswith(MANIFEST))
        self.store.delete(doomed)
        self.store.tidy()
        return doomed
