"""Two-phase saves: the caller stages state to host memory, one background thread writes and commits.

At most one write is in flight. A periodic save that comes due while one is writing is not queued: the
caller tries again at the next step (coalescing into the newest state), so memory holds at most one
staged copy beside the live state. Emergency and final saves wait for the writer, then write at once.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

from airflow_spot.storage.checkpoint import CheckpointStore, Manifest

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """
    :param checkpoints: where checkpoints are committed.
    :param serialize: ``serialize(staged_state, fileobj)`` writes the payload (e.g. ``torch.save``).
    :param keep: committed checkpoints kept after each save (retention).
    """

    def __init__(
        self, checkpoints: CheckpointStore, serialize: Callable[[Any, BinaryIO], None], keep: int = 3
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.checkpoints = checkpoints
        self.serialize = serialize
        self.keep = keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spot-ckpt-writer")
        self._inflight: Future | None = None
        self.last_manifest: Manifest | None = None
        self.last_write_seconds: float = 0.0
        self.failures = 0

    @property
    def busy(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    @property
    def last_committed_step(self) -> int | None:
        return self.last_manifest.step if self.last_manifest else None

    def _write(self, step: int, staged: Any, meta: dict) -> Manifest:
        started = time.monotonic()
        manifest = self.checkpoints.save(step, lambda f: self.serialize(staged, f), meta)
        self.committed(manifest, time.monotonic() - started)
        return manifest

    def committed(self, manifest: Manifest, write_seconds: float) -> None:
        """Record a committed save (this writer's, or one written by other means: a sharded save), and prune."""
        self.last_write_seconds = write_seconds
        self.last_manifest = manifest
        try:
            # counted back from this save: a newer step in the store is one a resume found unusable
            self.checkpoints.prune(self.keep, newest_step=manifest.step)
        except OSError as exc:  # retention is housekeeping; a failure must not fail the save
            log.warning("pruning old checkpoints failed: %s", exc)

    def save_async(self, step: int, staged: Any, meta: dict | None = None) -> bool:
        """Start writing ``staged``; returns False (and writes nothing) while another write is in flight."""
        return self.submit(self._write, step, staged, dict(meta or {}))

    def submit(self, write: Callable[..., Any], *args: Any) -> bool:
        """Run ``write(*args)`` as this writer's background write (a sharded save brings its own: every rank
        writes its shards, rank 0 commits and calls :meth:`committed`); returns False while another is in
        flight. Its failure is logged and counted as any background write's is; :meth:`wait` and
        :meth:`close` wait for it."""
        if self.busy:
            return False
        self._collect()
        self._inflight = self._pool.submit(write, *args)
        return True

    def _collect(self) -> None:
        """Surface the result of a finished background write (a failed one is logged, not fatal)."""
        fut, self._inflight = self._inflight, None
        if fut is not None and fut.done() and fut.exception() is not None:
            self.failures += 1
            log.error("background checkpoint write failed: %s", fut.exception())

    def wait(self, timeout: float | None = None) -> None:
        """Block until the in-flight write (if any) has finished."""
        if self._inflight is not None:
            try:
                self._inflight.result(timeout=timeout)
            except TimeoutError:
                raise
            except Exception:  # reported by _collect
                pass
            self._collect()

    def save_sync(self, step: int, staged: Any, meta: dict | None = None) -> Manifest:
        """Wait for the writer, then write and commit ``staged``; errors propagate."""
        self.wait()
        self._inflight = self._pool.submit(self._write, step, staged, dict(meta or {}))
        fut, self._inflight = self._inflight, None
        return fut.result()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
