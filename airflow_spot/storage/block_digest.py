"""Block SHA-256: a payload digest that every core can compute, for the checkpoint's save and restore.

One SHA-256 stream runs at 1.3-2 GB/s, and a checkpoint's save and its restore's verify both wait for
it (``benchmarks/results/gpu_staging.txt``). Here the payload is cut into fixed blocks of
``block_bytes`` (the last may be shorter), each block is hashed on its own, on a shared pool of threads
(hashlib releases the GIL), and the digest is the SHA-256 of the blocks' digests in order — a hash list.
The manifest records the block size beside the digest and the payload's size, so the digest names one
byte string, exactly as a whole-file SHA-256 does.

:class:`BlockSha256` has two ways in:

* :meth:`~BlockSha256.update` for a caller that reuses its buffer as soon as the call returns (a
  serialiser writing a tensor's storage): the blocks it completes are hashed in parallel before it
  returns, and the unfinished tail of a block is copied (at most one block per call);
* :meth:`~BlockSha256.update_owned` for bytes nobody will change (a file's or a download's reads): a
  completed block is hashed in the background and the call returns at once, with a bounded number of
  blocks in flight, so reading and hashing overlap.
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

#: what new checkpoints use; 8 MiB makes a 64 MB tensor eight parallel blocks
BLOCK_BYTES = 8 * 1024 * 1024
MIN_BLOCK_BYTES = 64 * 1024

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def hash_workers() -> int:
    """Threads of the shared pool: the cores this process may use, at most 16 (beyond that the disk or
    the network bounds a checkpoint's transfer, not SHA-256)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=hash_workers(), thread_name_prefix="spot-block-sha256")
        return _pool


def _hash_pieces(pieces: list) -> bytes:
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.digest()


class BlockSha256:
    """The block SHA-256 of a byte stream fed in order (see the module doc). Not thread-safe: one feeder.

    :param block_bytes: the block size (the manifest's ``sha256_block``).
    """

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes < MIN_BLOCK_BYTES:
            raise ValueError(f"block size must be an integer >= {MIN_BLOCK_BYTES} bytes, got {block_bytes!r}")
        self.block_bytes = block_bytes
        self.size = 0
        self._pieces: list = []  # the current, unfinished block: immutable pieces, in order
        self._filled = 0
        self._digests: list[bytes | Future] = []  # one per finished block, in order
        self._in_flight: deque[Future] = deque()

    # ---- feeding
    def update(self, data) -> None:
        """Hash ``data``; the caller may change its buffer as soon as this returns."""
        view = memoryview(data).cast("B")
        mine = []
        pos = 0
        while pos < view.nbytes:
            take = min(self.block_bytes - self._filled, view.nbytes - pos)
            piece = view[pos:pos + take]
            pos += take
            if self._filled + take == self.block_bytes:
                mine.append(self._finish_block(piece))
            else:  # the block's tail outlives this call: keep a copy
                self._pieces.append(bytes(piece))
                self._filled += take
        self.size += view.nbytes
        for fut in mine:  # the caller's buffer is free once the blocks that read it are hashed
            fut.result()

    def update_owned(self, data: bytes) -> None:
        """Hash ``data``, an immutable ``bytes`` the caller hands over; returns before it is hashed."""
        if not isinstance(data, bytes):
            raise TypeError(f"update_owned takes bytes (immutable), got {type(data).__name__}; use update()")
        view = memoryview(data)
        pos = 0
        while pos < view.nbytes:
            take = min(self.block_bytes - self._filled, view.nbytes - pos)
            piece = view[pos:pos + take]
            pos += take
            if self._filled + take == self.block_bytes:
                self._in_flight.append(self._finish_block(piece))
                while len(self._in_flight) > 2 * hash_workers():  # bounded memory: wait for the oldest
                    self._in_flight.popleft().result()
            else:
                self._pieces.append(piece)
                self._filled += take
        self.size += view.nbytes

    def _finish_block(self, last_piece) -> Future:
        pieces, self._pieces, self._filled = self._pieces + [last_piece], [], 0
        fut = _shared_pool().submit(_hash_pieces, pieces)
        self._digests.append(fut)
        return fut

    # ---- the digest
    def digest(self) -> bytes:
        """The digest of everything fed so far (feeding may go on after it)."""
        blocks = [d.result() if isinstance(d, Future) else d for d in self._digests]
        self._digests = list(blocks)
        self._in_flight.clear()
        if self._pieces:
            blocks.append(_hash_pieces(self._pieces))
        return hashlib.sha256(b"".join(blocks)).digest()

    def hexdigest(self) -> str:
        return self.digest().hex()


def block_sha256_of_file(path: str, block_bytes: int = BLOCK_BYTES, read_bytes: int = 8 * 1024 * 1024) -> str:
    """The block SHA-256 of a file, reading it while its blocks are hashed."""
    h = BlockSha256(block_bytes)
    with open(path, "rb") as f:
        while chunk := f.read(read_bytes):
            h.update_owned(chunk)
    return h.hexdigest()


__all__ = ["BLOCK_BYTES", "MIN_BLOCK_BYTES", "BlockSha256", "block_sha256_of_file", "hash_workers"]
