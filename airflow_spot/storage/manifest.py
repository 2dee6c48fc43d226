"""Checkpoint manifests: what a committed checkpoint holds, sealed by its own checksum.

A manifest names the checkpoint's step, directory, writer and files (size, sha256) and carries ``checksum``,
the sha256 of its canonical JSON without that field. :meth:`Manifest.from_json` verifies the checksum and,
given the directory it was found in, that the step, writer and directory agree with that directory's name
(``<step:012d>-<writer>-<nonce>``, written before the manifest, so an independent record of the step).
Schema-1 manifests (before the checksum) are still read: the directory cross-check and the payload hash
still catch a changed step or payload. A manifest that carries a checksum is always held to it.

From schema 3 a file's ``sha256`` is a block SHA-256 when the entry names ``sha256_block`` (the block size;
:mod:`airflow_spot.storage.block_digest`), which every core computes at once; without it, and in schemas
1-2, it is the SHA-256 of the whole file. An older airflow-spot refuses a schema-3 manifest ("newer than
this code understands; upgrade"), so upgrade every worker of a deployment before its jobs save again.

Schema 4 is a sharded checkpoint (``meta["layout"] == "dcp"``): the files of a ``torch.distributed.checkpoint``
save (``.metadata``, one ``__<rank>_<n>.distcp`` or more a rank) beside the payload, which stays ``files[0]``.
The marker lives in ``meta`` rather than in a field of its own so that an airflow-spot from before it meets
only the schema number, and refuses the checkpoint with "newer than this code understands; upgrade" (a new
field would fail its field check first, with a message that does not say to upgrade). Checkpoints of one
payload file are still stamped 2 or 3, so a rollback keeps reading them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_spot.storage.block_digest import BlockSha256, block_sha256_of_file, check_block_bytes

#: 4: a sharded checkpoint (``meta["layout"]``, :data:`LAYOUT_DCP`);
#: 3: a file's ``sha256`` may be a block SHA-256 (``sha256_block`` names the block size);
#: 2: the manifest carries ``checksum``; 1: older manifests without it (still read, see the module doc)
MANIFEST_SCHEMA = 4
#: the ``meta`` key naming a checkpoint's layout (absent: one payload file), and its one value so far
LAYOUT_KEY = "layout"
LAYOUT_DCP = "dcp"
#: DCP's metadata file in a :data:`LAYOUT_DCP` checkpoint: every rank reads it (the shard files each rank reads only
#: those its plan names)
DCP_METADATA = ".metadata"
DIR_NAME_RE = re.compile(r"^(\d{12})-(.+)-([0-9a-f]{8})$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_MANIFEST_FIELDS = {"step", "directory", "files", "writer", "created_at", "save_seconds", "meta", "schema", "checksum"}


class CheckpointError(RuntimeError):
    """No usable checkpoint could be read, or a save failed."""


class ManifestError(CheckpointError):
    """A manifest exists but cannot be trusted (unparsable, checksum mismatch, wrong directory)."""



@dataclass(frozen=True)
class FileEntry:
    """One payload file. ``sha256`` is the SHA-256 of its bytes, or, when ``sha256_block`` is set, their
    block SHA-256 with blocks of that many bytes (:mod:`airflow_spot.storage.block_digest`), which every
    core computes at once."""

    name: str
    size: int
    sha256: str
    sha256_block: int = 0

    def new_hasher(self):
        """A hashlib-like object (``update``, ``hexdigest``) computing this entry's kind of digest."""
        return BlockSha256(self.sha256_block) if self.sha256_block else hashlib.sha256()

    def file_digest(self, path: str) -> str:
        """This entry's kind of digest of a local file."""
        if self.sha256_block:
            return block_sha256_of_file(path, self.sha256_block)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 * 1024 * 1024):
                h.update(chunk)
        return h.hexdigest()

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.sha256_block:  # entries of whole-file digests are written as before schema 3
            d.pop("sha256_block")
        return d


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
    checksum: str = ""

    def _body(self) -> dict[str, Any]:
        d = asdict(self)
        d["files"] = [f.as_json() for f in self.files]
        d.pop("checksum")
        return d

    def compute_checksum(self) -> str:
        return _canonical_sha256(self._body())

    def sealed(self) -> Manifest:
        """This manifest with its checksum filled in (what :meth:`CheckpointStore.save` writes). It is stamped
        with the oldest schema that can hold it, so a manifest of whole-file digests stays readable by an
        airflow-spot from before block digests (an upgrade can be rolled back)."""
        schema = 4 if self.layout else 3 if any(f.sha256_block for f in self.files) else 2
        stamped = dataclasses.replace(self, schema=schema, checksum="")
        return dataclasses.replace(stamped, checksum=stamped.compute_checksum())

    def to_json(self) -> bytes:
        d = self._body()
        if self.checksum:
            d["checksum"] = self.checksum
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, directory: str | None = None) -> Manifest:
        """Parse and verify a manifest; ``directory`` (where it was found) is cross-checked when given.

        :raises ManifestError: saying what is wrong.
        """
        try:
            d = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest is not valid JSON ({len(raw)} bytes): {exc}") from None
        if not isinstance(d, dict):
            raise ManifestError(f"manifest is {type(d).__name__}, not a JSON object")
        # the schema first: a newer one may carry fields this code does not know, and the fix is to upgrade
        schema = d.get("schema", 1)
        if not is_int(schema) or schema < 1:
            raise ManifestError(f"manifest schema {schema!r} is not a positive integer")
        if schema > MANIFEST_SCHEMA:
            raise ManifestError(f"manifest schema {schema} is newer than this code understands; upgrade airflow-spot")
        unknown, missing = set(d) - _MANIFEST_FIELDS, {"step", "directory", "files", "writer"} - set(d)
        if unknown or missing:
            raise ManifestError(f"manifest has unknown fields {sorted(unknown)} / lacks fields {sorted(missing)}")
        checksum = d.pop("checksum", None)
        if checksum is not None or schema >= 2:
            if checksum is None:
                raise ManifestError(f"manifest of schema {schema} has no checksum")
            if checksum != _canonical_sha256(d):
                raise ManifestError("manifest checksum does not match its content (corrupt or edited)")
        manifest = cls._typed(d, checksum or "")
        if directory is not None:
            _cross_check_directory(manifest, directory)
        return manifest

    @classmethod
    def _typed(cls, d: dict[str, Any], checksum: str) -> Manifest:
        problems = []
        if not is_int(d["step"]) or d["step"] < 0:
            problems.append(f"step {d['step']!r} is not an integer >= 0")
        for name in ("directory", "writer"):
            if not isinstance(d[name], str) or not d[name]:
                problems.append(f"{name} {d[name]!r} is not a non-empty string")
        for name in ("created_at", "save_seconds"):
            if name in d and (isinstance(d[name], bool) or not isinstance(d[name], (int, float))):
                problems.append(f"{name} {d[name]!r} is not a number")
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            problems.append("meta is not an object")
        elif LAYOUT_KEY in meta and (meta[LAYOUT_KEY] != LAYOUT_DCP or d.get("schema", 1) < 4):
            problems.append(f"meta.{LAYOUT_KEY} {meta[LAYOUT_KEY]!r} is not a layout of manifest schema "
                            f"{d.get('schema', 1)} (schema 4 knows {LAYOUT_DCP!r})")
        files = d["files"]
        if not isinstance(files, list) or not files:
            problems.append("files is not a non-empty list")
            files = []
        entries = []
        blocks_allowed = d.get("schema", 1) >= 3
        for f in files:
            if isinstance(f, dict) and "sha256_block" in f and not blocks_allowed:
                problems.append(f"file entry {f.get('name')!r} names sha256_block, which needs manifest schema 3 or "
                                f"newer, not {d.get('schema', 1)}")
                continue
            if not isinstance(f, dict) or not {"name", "size", "sha256"} <= set(f) <= {
                    "name", "size", "sha256", "sha256_block"}:
                problems.append(f"file entry {f!r} does not have exactly name, size, sha256"
                                + (" (and optionally sha256_block)" if blocks_allowed else ""))
                continue
            block = f.get("sha256_block", 0)
            problem = check_block_bytes(block) if "sha256_block" in f else None
            if problem:
                problems.append(f"sha256_block {block!r} of {f['name']!r} {problem}")
                block = 0
            if not isinstance(f["name"], str) or not f["name"] or "/" in f["name"]:
                problems.append(f"file name {f['name']!r} is not a plain file name")
            if not is_int(f["size"]) or f["size"] < 0:
                problems.append(f"size {f['size']!r} of {f['name']!r} is not an integer >= 0")
            if not isinstance(f["sha256"], str) or not _SHA256_RE.match(f["sha256"]):
                problems.append(f"sha256 {f['sha256']!r} of {f['name']!r} is not 64 lowercase hex digits")
            entries.append(FileEntry(f["name"], f["size"], f["sha256"], block))
        if problems:
            raise ManifestError("manifest is malformed: " + "; ".join(problems))
        return cls(
            step=d["step"], directory=d["directory"], files=tuple(entries), writer=d["writer"],
            created_at=float(d.get("created_at", 0.0)), save_seconds=float(d.get("save_seconds", 0.0)),
            meta=d.get("meta", {}), schema=d.get("schema", 1), checksum=checksum,
        )

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def layout(self) -> str | None:
        """:data:`LAYOUT_DCP` for a sharded checkpoint (several files, ``files[0]`` the payload); None for one
        payload file."""
        return self.meta.get(LAYOUT_KEY)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def manifest_checksum(d: dict[str, Any]) -> str:
    """The ``checksum`` a manifest whose other fields are ``d`` must carry."""
    return _canonical_sha256({k: v for k, v in d.items() if k != "checksum"})


def _canonical_sha256(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _cross_check_directory(manifest: Manifest, directory: str) -> None:
    """The directory name is written once, before the manifest, so it is an independent record of the step."""
    m = DIR_NAME_RE.match(directory)
    if not m:
        raise ManifestError(f"directory name {directory!r} is not <step:012d>-<writer>-<nonce>")
    problems = []
    if manifest.directory != directory:
        problems.append(f"manifest names directory {manifest.directory!r}")
    if manifest.step != int(m.group(1)):
        problems.append(f"manifest says step {manifest.step} but the directory name says {int(m.group(1))}")
    if manifest.writer != m.group(2):
        problems.append(f"manifest says writer {manifest.writer!r} but the directory name says {m.group(2)!r}")
    if problems:
        raise ManifestError("manifest does not belong to its directory: " + "; ".join(problems))
