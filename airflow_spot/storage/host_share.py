"""One download per host of the checkpoint every rank of a restore reads.

Under torchrun every rank restores: each reads the payload (the whole model under DDP) and a sharded
checkpoint's files. Fetched by each rank, an 8-GPU instance downloads the same bytes eight times from the
store. A :class:`HostShare` is a folder in the host's temporary directory named by a token rank 0 chose
for this restore, so the ranks of one host find one another's files there and the ranks of another host
(another temporary directory) do not: the first rank to need a file takes its lock (``flock``), downloads
and verifies it and renames it in place; the others wait on the lock and use the verified file. Only
verified files are ever renamed in, so a corrupt one fails the rank that fetched it (and the restore falls
back as before) and is never served to another rank.

The share is removed once every rank has read what it needs (:meth:`remove`, after the ranks agree);
readers hard-link files out of it (copies where linking is impossible), so removing it frees nothing a rank
still uses.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

log = logging.getLogger("airflow_spot.checkpoint")

#: the folder's prefix in the host's temporary directory
SHARE_PREFIX = "airflow-spot-share-"


class HostShare:
    """The files of one restore, fetched once per host (see the module doc)."""

    def __init__(self, token: str, root: str | None = None) -> None:
        if not token or not all(c.isalnum() or c in "-_" for c in token):
            raise ValueError(f"host share token {token!r}: letters, digits, '-' and '_' only")
        self.folder = os.path.join(root or tempfile.gettempdir(), SHARE_PREFIX + token)
        os.makedirs(self.folder, exist_ok=True)
        self.fetched = self.reused = 0  # files this process downloaded / found fetched by another rank

    def path(self, key: str, download: Callable[[str], None]) -> str:
        """The local path of ``key``'s verified file: ``download(dest)`` writes it to ``dest`` (and raises if it
        does not verify) unless a rank of this host already did."""
        name = hashlib.sha256(key.encode()).hexdigest()[:32]
        final = os.path.join(self.folder, name)
        with self._locked(final + ".lock"):
            if os.path.exists(final):
                self.reused += 1
                return final
            part = final + f".part-{os.getpid()}"
            try:
                download(part)
                os.replace(part, final)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
            self.fetched += 1
            return final

    @contextlib.contextmanager
    def _locked(self, lock_path: str) -> Iterator[None]:
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, also if this process dies
            yield
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Delete the folder (every rank may call it once all have read; the others' calls find nothing)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def link_or_copy(src: str, dest: str) -> None:
    """``dest`` holding ``src``'s bytes: a hard link where the filesystem allows (no second copy on disk),
    else a copy."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)
