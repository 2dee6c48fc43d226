"""How a checkpoint save digests what it writes: the digest setting (:data:`DIGEST_ENV`: block or whole-file
SHA-256) and :class:`_HashingWriter`, which hashes and counts the bytes as they are written, with no second
read. Used by :meth:`airflow_spot.storage.checkpoint.CheckpointStore.put_file`; the manifest's side of digests
(checking a file against its entry) is in :mod:`airflow_spot.storage.manifest`.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

from airflow_spot.storage.block_digest import BLOCK_BYTES, BlockSha256
from airflow_spot.storage.manifest import FileEntry


#: ``sha256`` makes saves write whole-file digests (manifest schema 2), which an airflow-spot from before block
#: digests reads: set it in the Airflow workers' environment (the operators hand it to the training instances)
#: while a deployment is upgraded or rolled back across that change; ``block`` (the default) is the fast one
DIGEST_ENV = "AIRFLOW_SPOT_CHECKPOINT_DIGEST"


def digest_setting(value: str | None) -> str:
    """The digest a :data:`DIGEST_ENV` value asks for, ``block`` or ``sha256`` (unset or empty: ``block``).

    :raises ValueError: naming the variable and its valid values when it holds anything else."""
    choice = (value or "").strip().lower() or "block"
    if choice not in ("block", "sha256"):
        raise ValueError(f"{DIGEST_ENV}={value!r} is not a checkpoint digest: use 'block' (the default: a block "
                         "SHA-256 hashed on every core) or 'sha256' (a whole-file digest that airflow-spot versions "
                         "from before block digests can read)")
    return choice


def save_block_bytes() -> int:
    """The digest block size saves use now (0: a whole-file sha256), from :data:`DIGEST_ENV`.

    :raises ValueError: naming the variable and its valid values when it holds anything else."""
    return BLOCK_BYTES if digest_setting(os.environ.get(DIGEST_ENV)) == "block" else 0


class _HashingWriter:
    """File wrapper that checksums and counts bytes as they are written (no second read).

    The digest is a block SHA-256 (:mod:`~airflow_spot.storage.block_digest`), whose blocks are hashed
    on every core, or with ``block_bytes=0`` a whole-file SHA-256. A large chunk (a tensor's storage, as
    ``torch.save`` writes it) is hashed in a helper thread while this one writes it, so a chunk costs the
    longer of the two instead of their sum. Each chunk is hashed (or copied) before ``write`` returns, so
    the caller may reuse its buffer at once. Use as a context manager (it owns the helper thread)."""

    PARALLEL_BYTES = 1 << 20

    def __init__(self, f: BinaryIO, block_bytes: int = BLOCK_BYTES) -> None:
        self._f = f
        self.block_bytes = block_bytes
        self.hasher = BlockSha256(block_bytes) if block_bytes else hashlib.sha256()
        self.size = 0
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> _HashingWriter:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= self.PARALLEL_BYTES:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spot-sha256")
            hashed = self._pool.submit(self.hasher.update, view)
            try:
                n = self._f.write(data)
            finally:
                hashed.result()
        else:
            self.hasher.update(view)
            n = self._f.write(data)
        self.size += view.nbytes if n is None else n
        return n if n is not None else view.nbytes

    def flush(self) -> None:
        self._f.flush()


def sha256_file(path: str) -> str:
    """The whole-file SHA-256 of a local file (what manifests before schema 3 name)."""
    return FileEntry("", 0, "").file_digest(path)
