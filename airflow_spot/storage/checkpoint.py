"""Committed checkpoints: data files first, manifest last, everything verified before it is trusted.

Layout (relative to the store, usually ``<job>/checkpoints``)::

    <step:012d>-<writer>-<nonce>/state.pt        payload, written first
    <step:012d>-<writer>-<nonce>/.metadata, __<rank>_<n>.distcp   a sharded save's DCP files, each rank its own
    <step:012d>-<writer>-<nonce>/MANIFEST.json   written last: step, files, sizes, digests, save time, checksum
    quarantine/<step:012d>-<writer>-<nonce>/...  set aside by ``airflow-spot checkpoints restore`` (never read)

A checkpoint exists only once its manifest does, and the manifest names the files with their checksums,
so a crash mid-save leaves a directory without a manifest, which restore ignores. Every save goes to a
directory of its own (writer id + random nonce): two attempts of one job racing can never interleave
into one checkpoint, and nothing committed is ever overwritten.

A manifest is trusted only when (1) its own ``checksum`` (sha256 of its canonical JSON without that
field) matches, (2) its ``step``, ``writer`` and ``directory`` agree with the directory it was found in,
and (3) at restore, every file's size and digest match (a block SHA-256 since manifest schema 3,
:mod:`~airflow_spot.storage.block_digest`; a whole-file SHA-256 before). Manifests written before the checksum existed
(schema 1, no ``checksum``) are still read, because (2) and (3) still catch a changed step or payload;
a manifest that carries a checksum is always held to it, whatever its ``schema`` says.

A checkpoint whose manifest exists but does not verify is never treated as absent: restore falls back to
the newest older one that verifies, logging an ERROR that names what is broken, and when checkpoints
exist and none verifies it raises :class:`NoUsableCheckpointError` (never a silent start from step 0).

This module knows nothing about torch: callers pass a ``write(fileobj)`` and a ``read(path)`` function.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from airflow_spot.storage.block_digest import BLOCK_BYTES  # noqa: F401 - re-exported (benchmarks read it here)
from airflow_spot.storage.host_share import HostShare, link_or_copy
from airflow_spot.storage.manifest import (  # re-exported: callers import them from here
    DCP_METADATA,
    LAYOUT_DCP,
    LAYOUT_KEY,
    MANIFEST_SCHEMA,
    CheckpointError,
    FileEntry,
    Manifest,
    ManifestError,
    is_int,
    manifest_checksum,
)
from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore, store_errors
from airflow_spot.storage.protocol import safe_id
# the save's digest setting and hashing writer; re-exported (callers and tests import them from here)
from airflow_spot.storage.save_digest import (  # noqa: F401
    DIGEST_ENV,
    _HashingWriter,
    digest_setting,
    save_block_bytes,
    sha256_file,
)

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
PAYLOAD = "state.pt"
QUARANTINE = "quarantine"
#: the local folders a sharded checkpoint is fetched into (:meth:`CheckpointStore.read_checkpoint`)
FETCH_PREFIX = "airflow-spot-ckpt-"
_DIR_RE = re.compile(r"^(\d{12})-")


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written or committed; committed checkpoints are untouched."""


class NoUsableCheckpointError(CheckpointError):
    """Checkpoints exist but none of them verifies: resuming from step 0 would silently lose progress.

    :param uri: the checkpoint store's URI (used in the recovery hint).
    :param problems: one line per broken checkpoint, newest first.
    """

    def __init__(self, uri: str, problems: list[str]) -> None:
        self.uri = uri
        self.problems = problems
        super().__init__(
            f"no usable checkpoint: {len(problems)} checkpoint(s) exist in {uri} but none verifies, so training "
            "will not silently start again from step 0. Broken, newest first:\n  " + "\n  ".join(problems) + "\n"
            f"To recover: inspect them with `airflow-spot checkpoints verify {uri}`; then either repair the store "
            f"(e.g. restore the files from a backup) or make an older good step the one a resume uses with "
            f"`airflow-spot checkpoints restore --step N {uri}` (sets newer ones aside under {QUARANTINE}/); "
            "to really start from scratch, move the checkpoints away or use a new checkpoint_uri."
        )


@dataclass(frozen=True)
class CheckpointStatus:
    """One checkpoint directory that has a manifest, as found in the store.

    :param directory: the directory name; ``step`` is the step its name says.
    :param manifest: the verified manifest, or None when it did not verify.
    :param problem: what is wrong (None when nothing is known to be wrong).
    """

    directory: str
    step: int
    manifest: Manifest | None
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.manifest is not None and self.problem is None


class CheckpointStore:
    """Save, list, verify, restore and prune the checkpoints of one job.

    :param store: object store rooted at the job's ``checkpoints/`` prefix.
    :param writer: identity of this writer (an attempt id); part of every directory name it creates.
    """

    def __init__(self, store: ObjectStore, writer: str = "local") -> None:
        self.store = store
        self.writer = safe_id(writer)
        #: the payload digest's block size for saves (0: whole-file sha256); None: :data:`DIGEST_ENV`'s, read at
        #: each save (a reader, such as the UI, never depends on the writers' setting)
        self.block_bytes: int | None = None
        #: where the ranks of one host share what they fetch (:meth:`sharing`); None: each read fetches its own
        self.share: HostShare | None = None

    def sharing(self, share: HostShare | None) -> CheckpointStore:
        """This store reading through ``share``: a file one rank of this host fetched and verified is not fetched
        again by another (a store that reads in place, ``file://``, gains nothing and ignores it)."""
        view = copy.copy(self)
        view.share = None if self.store.reads_in_place else share
        return view

    # ---- writing
    def save(
        self, step: int, write: Callable[[BinaryIO], None], meta: dict[str, Any] | None = None
    ) -> Manifest:
        """Write one checkpoint at ``step`` (one payload file) and commit it. Returns the committed manifest.

        :raises CheckpointSaveError: when the store refuses the write (read-only, gone, full) or the
            checkpoint's directory vanished before the commit; nothing committed earlier is touched.
        """
        started = time.monotonic()
        directory = self.new_directory(step)
        entry = self.put_file(directory, PAYLOAD, write, step)
        return self.commit(step, directory, (entry,), meta, time.monotonic() - started, recheck=False)

    def new_directory(self, step: int) -> str:
        """A fresh directory name for one save at ``step`` (never one already used)."""
        if not is_int(step) or step < 0:
            raise ValueError(f"checkpoint step must be >= 0 and an integer, got {step!r}")
        return f"{step:012d}-{self.writer}-{uuid.uuid4().hex[:8]}"

    def put_file(self, directory: str, name: str, write: Callable[[BinaryIO], None], step: int) -> FileEntry:
        """Write one data file of the (uncommitted) checkpoint in ``directory``, hashed as it is written;
        returns its manifest entry. Several processes may each put their own files into one directory (the
        ranks of a sharded save) before one of them commits it with :meth:`commit`.

        :raises CheckpointSaveError: as :meth:`save`."""
        key = f"{directory}/{name}"
        with self._save_errors(step, key):
            block_bytes = save_block_bytes() if self.block_bytes is None else self.block_bytes
            with self.store.open_write(key) as raw, _HashingWriter(raw, block_bytes) as hw:
                write(hw)
                raw.flush()
            # Someone deleting the directory mid-save must not leave a manifest without its payload.
            published = self.store.size(key)
            if published != hw.size:
                raise CheckpointSaveError(
                    f"checkpoint at step {step}: {self.store.uri}/{key} holds {published} bytes after the "
                    f"save wrote {hw.size}; something else is writing to this store"
                )
        return FileEntry(name, hw.size, hw.hasher.hexdigest(), hw.block_bytes)

    def commit(self, step: int, directory: str, files: tuple[FileEntry, ...], meta: dict[str, Any] | None,
               save_seconds: float, layout: str | None = None, recheck: bool = True) -> Manifest:
        """Commit the checkpoint in ``directory`` (its ``files`` all put and published): the manifest, last.

        :param layout: ``None``, one payload file; :data:`~airflow_spot.storage.manifest.LAYOUT_DCP`, the
            files of a ``torch.distributed.checkpoint`` save beside the payload (manifest schema 4).
        :param recheck: check that every file is still there with its size (False: its writer just did).
        :raises CheckpointSaveError: as :meth:`save`; also when a file is missing or has another size now."""
        with self._save_errors(step, f"{directory}/{MANIFEST}"):
            for entry in files if recheck else ():  # each rank checked its own; this catches a deletion since
                published = self.store.size(f"{directory}/{entry.name}")
                if published != entry.size:
                    raise CheckpointSaveError(
                        f"checkpoint at step {step}: {self.store.uri}/{directory}/{entry.name} holds {published} "
                        f"bytes, the save wrote {entry.size}; something else is writing to this store")
            manifest = Manifest(
                step=step, directory=directory, files=tuple(files), writer=self.writer, created_at=time.time(),
                save_seconds=save_seconds, meta={**(meta or {}), **({LAYOUT_KEY: layout} if layout else {})},
            ).sealed()
            self.store.put_bytes(f"{directory}/{MANIFEST}", manifest.to_json())  # the commit point
        return manifest

    @contextlib.contextmanager
    def _save_errors(self, step: int, key: str) -> Iterator[None]:
        try:
            yield
        except ObjectNotFound:
            raise CheckpointSaveError(
                f"checkpoint at step {step}: {self.store.uri}/{key} vanished before the commit (the checkpoint "
                "directory was deleted while saving); nothing was committed for this step, earlier checkpoints "
                "are untouched"
            ) from None
        except CheckpointError:
            raise
        except store_errors() as exc:
            raise CheckpointSaveError(
                f"cannot save the checkpoint at step {step} to {self.store.uri}: {type(exc).__name__}: {exc}. "
                "The store refused the write (read-only, full, unreachable, or the directory was removed); "
                "committed checkpoints are untouched and training resumes from the newest of them once the "
                "store is writable again"
            ) from exc

    # ---- reading
    def scan(self) -> list[CheckpointStatus]:
        """Every checkpoint directory that has a manifest, oldest first, with its manifest verified
        (checksum and directory cross-check; the payload is checked by :meth:`inspect` and restore)."""
        out = []
        # manifests only: not payloads, partial saves, quarantine/...
        manifests = [k for k in self.store.list() if k.endswith("/" + MANIFEST) and k.count("/") == 1
                     and _DIR_RE.match(k.partition("/")[0])]
        # one pruned between the listing and the read is left out
        for key, raw in self.store.get_many(manifests).items():
            directory = key.partition("/")[0]
            step = int(directory[:12])
            try:
                out.append(CheckpointStatus(directory, step, Manifest.from_json(raw, directory)))
            except ManifestError as exc:
                out.append(CheckpointStatus(directory, step, None, str(exc)))
        return sorted(out, key=lambda s: (s.step, s.manifest.created_at if s.manifest else 0.0, s.directory))

    def committed(self) -> list[Manifest]:
        """Committed checkpoints whose manifests verify, oldest first. Broken ones are logged, not returned:
        use :meth:`scan` (or :meth:`latest_step` / :meth:`restore_latest`, which refuse to treat a store
        holding only broken checkpoints as empty)."""
        out = []
        for status in self.scan():
            if status.ok:
                out.append(status.manifest)
            else:
                log.warning("checkpoint %s/%s does not verify: %s", self.store.uri, status.directory, status.problem)
        return out

    def latest_step(self) -> int | None:
        """Step of the newest checkpoint whose manifest verifies and whose payload files exist with the
        sizes it names (one metadata request each; the sha256 is checked by :meth:`restore_latest` and
        :meth:`inspect`, as re-hashing gigabytes here would make every caller download them). None when
        the job has no checkpoint at all. Newer broken checkpoints are logged as errors and skipped, as
        :meth:`restore_latest` will skip them.

        :raises NoUsableCheckpointError: when checkpoints exist but none passes these checks.
        """
        latest = self.latest()
        return None if latest is None else latest.step

    def latest(self) -> Manifest | None:
        """The manifest of the checkpoint :meth:`latest_step` names (its ``size`` is what a restore reads)."""
        statuses = self.scan()
        problems = []
        for status in reversed(statuses):
            problem = status.problem if not status.ok else self._payload_size_problem(status.manifest)
            if problem is None:
                return status.manifest
            log.error("checkpoint %s/%s at step %d is broken and will be skipped: %s",
                      self.store.uri, status.directory, status.step, problem)
            problems.append(f"{status.directory}: {problem}")
        if statuses:
            raise NoUsableCheckpointError(self.store.uri, problems)
        return None

    def _payload_size_problem(self, manifest: Manifest) -> str | None:
        for entry in manifest.files:
            try:
                size = self.store.size(f"{manifest.directory}/{entry.name}")
            except ObjectNotFound:
                return f"checkpoint {manifest.directory}/{entry.name}: file is missing"
            if size != entry.size:
                return f"checkpoint {manifest.directory}/{entry.name}: size {size} != {entry.size} in manifest"
        return None

    def verify(self, manifest: Manifest, path: str, entry: FileEntry, digest: str | None = None) -> None:
        """Check size and sha256 of a fetched payload against its manifest (``digest`` if already known)."""
        size = os.path.getsize(path)
        if size != entry.size:
            raise CheckpointError(
                f"checkpoint {manifest.directory}/{entry.name}: size {size} != {entry.size} in manifest"
            )
        if (digest or entry.file_digest(path)) != entry.sha256:
            raise CheckpointError(
                f"checkpoint {manifest.directory}/{entry.name}: sha256 mismatch (corrupt or tampered)"
            )

    def fetch_verified(self, manifest: Manifest, entry: FileEntry, use: Callable[[str], Any]) -> Any:
        """Fetch one payload file, verify it and pass its local path to ``use``. A missing or mismatching
        file raises :class:`CheckpointError`; a store that cannot be read raises its own error. A
        ``FileNotFoundError`` that ``use`` raises is reported as the payload missing too: a ``use`` that
        writes elsewhere wraps its own errors (``checkpoints restore --to`` does)."""
        try:
            if self.share is not None:
                return use(self.share.path(f"{self.store.uri}/{manifest.directory}/{entry.name}",
                                           lambda dest: self._download_verified(manifest, entry, dest)))
            hasher = entry.new_hasher()
            with self.store.reading(f"{manifest.directory}/{entry.name}", hasher=hasher) as path:
                self.verify(manifest, path, entry, digest=hasher.hexdigest())
                return use(path)
        except (ObjectNotFound, FileNotFoundError):
            raise CheckpointError(f"checkpoint {manifest.directory}/{entry.name}: file is missing") from None

    def _download_verified(self, manifest: Manifest, entry: FileEntry, dest: str) -> None:
        hasher = entry.new_hasher()
        with self.store.reading(f"{manifest.directory}/{entry.name}", hasher=hasher) as path:
            self.verify(manifest, path, entry, digest=hasher.hexdigest())
            link_or_copy(path, dest)

    def read_checkpoint(self, manifest: Manifest, read: Callable[[str], Any]) -> Any:
        """``read(path)`` of the checkpoint's verified payload. For a sharded checkpoint (``manifest.layout``) the
        payload and DCP's ``.metadata`` are fetched and verified into one local folder that ``path`` lies in (``read``
        may move them out; the folder is removed afterwards); the shard files are left for :meth:`fetch_into`, so a
        rank fetches only those it reads (their sizes are checked once, when :meth:`restore_latest` chooses it)."""
        if manifest.layout is None:
            return self.fetch_verified(manifest, manifest.files[0], read)
        with tempfile.TemporaryDirectory(prefix=FETCH_PREFIX) as folder:
            self.fetch_into(manifest, folder, [e.name for e in manifest.files
                                               if e is manifest.files[0] or e.name == DCP_METADATA])
            return read(os.path.join(folder, manifest.files[0].name))

    def fetch_all(self, manifest: Manifest, folder: str) -> None:
        """Copy every file of the checkpoint into the local ``folder``, each verified against the manifest.

        :raises CheckpointError: naming the first file missing or not matching its size and digest."""
        self.fetch_into(manifest, folder)

    def fetch_into(self, manifest: Manifest, folder: str, names: Iterable[str] | None = None) -> int:
        """Copy the checkpoint's files named (all by default) into the local ``folder``, each verified against the
        manifest; a file already there is kept. Returns how many were fetched.

        :raises CheckpointError: naming the first file missing, not in the manifest or not matching its size and
            digest."""
        entries = {e.name: e for e in manifest.files}
        # a downloaded file is linked, not copied; a file:// store's own file is copied (nothing may write to it)
        put = shutil.copyfile if self.store.reads_in_place else link_or_copy
        fetched = 0
        for name in entries if names is None else names:
            entry = entries.get(name)
            if entry is None:
                raise CheckpointError(f"checkpoint {manifest.directory}: {name} is not one of its files (its manifest "
                                      f"lists {sorted(entries)})")
            dest = os.path.join(folder, name)
            if not os.path.exists(dest):
                self.fetch_verified(manifest, entry, lambda path, d=dest: put(path, d))
                fetched += 1
        return fetched

    def restore_latest(self, read: Callable[[str], Any],
                       skip: dict[str, str] | None = None) -> tuple[Manifest, Any] | None:
        """Read the newest checkpoint that verifies; fall back to older ones, newest first, logging an
        ERROR for each broken one.

        ``read(path)`` parses the verified payload; if it raises, that checkpoint is skipped too, as are those in
        ``skip`` (directory: why; found broken after they were read, e.g. a shard file of a sharded one).
        Returns ``None`` only when the job has no checkpoint at all.
        :raises NoUsableCheckpointError: when checkpoints exist but none of them is usable.
        :raises CheckpointError: when the store cannot be read (nothing is skipped on a store error, so
            a flaky store never makes a resume fall back to an older checkpoint).
        """
        statuses = self.scan()
        problems = []
        for status in reversed(statuses):
            problem = status.problem
            if status.ok and skip and status.directory in skip:
                problem = skip[status.directory]
            elif status.ok:
                manifest = status.manifest
                try:
                    # a sharded one's files are fetched by each rank as it reads them: a missing one is found
                    # here, once, by the rank that chooses, before any rank reads
                    problem = self._payload_size_problem(manifest) if manifest.layout else None
                    if problem is None:
                        return manifest, self.read_checkpoint(manifest, read)
                except CheckpointError as exc:
                    problem = str(exc)
                except store_errors() as exc:
                    raise CheckpointError(
                        f"cannot read checkpoint {self.store.uri}/{status.directory}: {type(exc).__name__}: {exc}; "
                        "the store is unreachable or refuses reads: retry once it is back"
                    ) from exc
                except Exception as exc:  # the caller's parser rejected the payload
                    problem = f"payload verified but could not be loaded: {type(exc).__name__}: {exc}"
            log.error("checkpoint %s/%s at step %d is unusable, falling back to the previous one: %s",
                      self.store.uri, status.directory, status.step, problem)
            problems.append(f"{status.directory}: {problem}")
        if statuses:
            raise NoUsableCheckpointError(self.store.uri, problems)
        return None

    def restore(self, directory: str, read: Callable[[str], Any]) -> tuple[Manifest, Any]:
        """Read the checkpoint in ``directory``, verified (the one another rank chose with
        :meth:`restore_latest`); no fall-back.

        :raises CheckpointError: when it is gone, does not verify, or the store cannot be read."""
        for status in self.scan():
            if status.directory != directory:
                continue
            if not status.ok:
                raise CheckpointError(f"checkpoint {self.store.uri}/{directory} does not verify: {status.problem}")
            try:
                return status.manifest, self.read_checkpoint(status.manifest, read)
            except store_errors() as exc:
                raise CheckpointError(f"cannot read checkpoint {self.store.uri}/{directory}: "
                                      f"{type(exc).__name__}: {exc}") from exc
        raise CheckpointError(f"checkpoint {self.store.uri}/{directory} is gone (pruned or deleted)")

    def inspect(self, verify_payloads: bool = True) -> list[CheckpointStatus]:
        """:meth:`scan`, with every payload fetched and checked too when ``verify_payloads``."""
        out = []
        for status in self.scan():
            if status.ok and verify_payloads:
                try:
                    for entry in status.manifest.files:
                        self.fetch_verified(status.manifest, entry, lambda path: None)
                except CheckpointError as exc:
                    status = dataclasses.replace(status, problem=str(exc))
            out.append(status)
        return out

    def quarantine(self, directory: str) -> list[str]:
        """Move one checkpoint directory under ``quarantine/`` (copied first, then the manifest removed
        first), so a resume no longer sees it and nothing is lost. Returns the new keys."""
        if not _DIR_RE.match(directory) or "/" in directory:
            raise ValueError(f"{directory!r} is not a checkpoint directory name")
        keys = self.store.list(f"{directory}/")
        keys.sort(key=lambda k: k.endswith("/" + MANIFEST))  # manifest copied last, so the copy is committed last
        moved = []
        for key in keys:
            target = f"{QUARANTINE}/{key}"
            with self.store.reading(key) as src, self.store.writing(target) as dst:
                with open(src, "rb") as fin, open(dst, "wb") as fout:
                    while block := fin.read(8 * 1024 * 1024):
                        fout.write(block)
            moved.append(target)
        self.store.delete(sorted(keys, key=lambda k: not k.endswith("/" + MANIFEST)))
        self.store.tidy()
        return moved

    # ---- retention
    def prune(self, keep: int, newest_step: int | None = None) -> list[str]:
        """Keep the newest ``keep`` committed checkpoints; delete older ones and abandoned partial saves
        older than the oldest kept one. Partial directories newer than that may be a live writer's.

        :param newest_step: count back from this step (the save just written): a checkpoint of a later
            step is left alone and not counted (one whose payload a resume found corrupt verifies by its
            manifest; counted, it would prune the save that replaced it and the one it resumed from)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        committed = [m for m in self.committed() if newest_step is None or m.step <= newest_step]
        if not committed:
            return []
        # with no more than ``keep`` committed there is still cleaning: partial saves older than the oldest
        # kept one (a writer killed inside a save leaves one; the early return here let them pile up)
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


__all__ = [
    "DIGEST_ENV", "FETCH_PREFIX", "LAYOUT_DCP", "MANIFEST", "MANIFEST_SCHEMA", "PAYLOAD", "QUARANTINE",
    "CheckpointError", "CheckpointSaveError",
    "CheckpointStatus", "CheckpointStore", "FileEntry", "Manifest", "ManifestError", "NoUsableCheckpointError",
    "manifest_checksum", "sha256_file",
]
