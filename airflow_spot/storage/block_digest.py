"""Block SHA-256: a payload digest that every core can compute, for the checkpoint's save and restore.

One SHA-256 stream runs at 1.2-2 GB/s, and a checkpoint's save and its restore's verify both wait for
it (``benchmarks/results/gpu_staging.txt``). Here the payload is cut into fixed blocks of
``block_bytes`` (the last may be shorter), each block is hashed on its own, on a shared pool of threads
(hashlib releases the GIL), and the digest is the SHA-256 of the blocks' digests in order — a hash list.
The manifest records the block size beside the digest and the payload's size, so the digest names one
byte string, exactly as a whole-file SHA-256 does.

:class:`BlockSha256` has two ways in:

* :meth:`~BlockSha256.update` for a caller that reuses its buffer as soon as the call returns (a
  serialiser writing a tensor's storage). A write smaller than a block is copied (a copy is several
  times cheaper than hashing) and hashed in the background; the blocks a larger write completes are
  hashed in parallel before it returns, and its unfinished tail is copied;
* :meth:`~BlockSha256.update_owned` for bytes nobody will change (a file's or a download's reads): a
  completed block is hashed in the background and the call returns at once.

Either way at most ``hash_workers() + 2`` blocks, and about :data:`IN_FLIGHT_BYTES` (a gathered buffer of
small writes, under two blocks, is held whole until its last block is hashed), wait in the background; a
finished block keeps only its 32-byte digest.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

#: what new checkpoints use; 8 MiB makes a 64 MB tensor eight parallel blocks
BLOCK_BYTES = 8 * 1024 * 1024
#: the block sizes a manifest may name: below, the digests' overhead grows; above, so does the memory a
#: block in flight holds (a manifest naming a huge block must not make a restore read a payload into memory)
MIN_BLOCK_BYTES = 64 * 1024
MAX_BLOCK_BYTES = 256 * 1024 * 1024
#: at most this much of the stream waits in the background to be hashed (and at least one block)
IN_FLIGHT_BYTES = 256 * 1024 * 1024

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool_after_fork() -> None:
    # a forked child inherits the pool object but none of its threads (and maybe a held lock); a hasher
    # that was mid-stream in the parent cannot be finished in the child (its blocks were the parent's)
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()
    hash_workers.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _quota_cores(read, dirs: list[str], v2: bool) -> int | None:
    """The tightest CPU quota, in whole cores, over ``dirs`` (a cgroup and its parents): a parent's quota
    bounds every cgroup under it."""
    best = None
    for d in dirs:
        try:
            if v2:
                quota, period = read(f"{d}/cpu.max").split()[:2]
                if quota == "max":
                    continue
            else:
                quota, period = read(f"{d}/cpu.cfs_quota_us").strip(), read(f"{d}/cpu.cfs_period_us").strip()
                if int(quota) < 0:  # -1: no limit
                    continue
            cores = max(1, math.ceil(int(quota) / int(period)))
        except (OSError, ValueError, ZeroDivisionError):
            continue
        best = cores if best is None else min(best, cores)
    return best


def _lineage(mount_point: str, path: str) -> list[str]:
    """``mount_point/path`` and each parent up to the mount point (the cgroups above it are not visible)."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    return [mount_point + "".join("/" + p for p in parts[:i]) for i in range(len(parts), -1, -1)]


def _cgroup_mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """``(fstype, root, mount point, super options)`` of each cgroup / cgroup2 mount in ``/proc/self/mountinfo``
    (fields: id, parent, dev, root, mount point, options, optional fields, ``-``, fstype, source, super options)."""
    def unescape(field: str) -> str:  # a space is written \040
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)

    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and tail and tail[0] in ("cgroup", "cgroup2"):
            out.append((tail[0], unescape(fields[3]), unescape(fields[4]),
                        set(tail[2].split(",")) if len(tail) > 2 else set()))
    return out


def cgroup_cpu_cores(proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") -> int | None:
    """Whole cores the process's CPU quota allows (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``
    / ``cpu.cfs_period_us``), the tightest of its cgroup and the parents visible; None without a quota.

    The cgroup's directory is its path (``/proc/self/cgroup``) below the mount's own root (``mountinfo``):
    a container without a cgroup namespace mounts its own cgroup (root ``/docker/<id>``) at
    ``/sys/fs/cgroup``, with a namespace the path and the root are both ``/``."""
    def read(path: str) -> str:
        with open(path) as f:
            return f.read()

    try:
        lines, mounts = read(proc_cgroup).splitlines(), _cgroup_mounts(read(mountinfo))
    except OSError:
        return None
    found = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        for fstype, root, point, options in mounts:
            if (fstype == "cgroup2") if v2 else (fstype == "cgroup" and "cpu" in options):
                top = root.rstrip("/")
                below = path[len(top):] if path == top or path.startswith(top + "/") else ""
                found.append(_quota_cores(read, _lineage(point, below), v2))
                break
    limits = [c for c in found if c is not None]
    return min(limits) if limits else None


@functools.lru_cache(maxsize=1)
def hash_workers() -> int:
    """Threads of the shared pool: the cores this process may use (its CPU affinity and its cgroup's CPU
    quota, v2 or v1, as a container limit sets it), at most 16; beyond that the disk or the network bounds
    a checkpoint's transfer, not SHA-256."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_cores()
    if quota is not None:
        cores = min(cores, quota)
    return max(1, min(16, cores))


def check_block_bytes(block_bytes) -> str | None:
    """What is wrong with a block size (None when nothing is)."""
    if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) \
            or not MIN_BLOCK_BYTES <= block_bytes <= MAX_BLOCK_BYTES:
        return f"is not an integer from {MIN_BLOCK_BYTES} to {MAX_BLOCK_BYTES} (bytes)"
    return None


def _submit(pieces: list) -> Future:
    """Hash one block's pieces on the shared pool; inline where no pool can run (interpreter shutdown)."""
    global _pool
    try:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=hash_workers(), thread_name_prefix="spot-block-sha256")
            pool = _pool
        return pool.submit(_hash_pieces, pieces)
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        done: Future = Future()
        done.set_result(_hash_pieces(pieces))
        return done


def _hash_pieces(pieces: list) -> bytes:
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    pieces.clear()  # drop the views into the caller's buffer now, not when the future is collected
    return h.digest()


class BlockSha256:
    """The block SHA-256 of a byte stream fed in order (see the module doc). Not thread-safe: one feeder.

    :param block_bytes: the block size (the manifest's ``sha256_block``).
    """

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        problem = check_block_bytes(block_bytes)
        if problem:
            raise ValueError(f"block size {block_bytes!r} {problem}")
        self.block_bytes = block_bytes
        self.size = 0
        self._small = bytearray()  # small writes copied, not yet cut into blocks (they follow _pieces)
        self._pieces: list = []  # the current, unfinished block: immutable pieces, in order
        self._filled = 0
        self._digests: list[bytes | Future] = []  # one per finished block, in order (a future until hashed)
        self._in_flight: deque[Future] = deque()
        self._max_in_flight = max(1, min(hash_workers() + 2, IN_FLIGHT_BYTES // block_bytes))

    # ---- feeding
    def update(self, data) -> None:
        """Hash ``data``; the caller may change its buffer as soon as this returns. After an exception from
        a feeding method the digest is undefined: a failed save discards its hasher."""
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        if view.nbytes < self.block_bytes:  # copied (one memcpy, cheaper than hashing it), hashed later
            self._small += view
            if len(self._small) >= self.block_bytes:
                self._flush_small()
            return
        self._flush_small()
        mine: list[Future] = []
        pos = 0
        try:
            while pos < view.nbytes:
                take = min(self.block_bytes - self._filled, view.nbytes - pos)
                if self._filled + take == self.block_bytes:
                    mine.append(self._finish_block(view[pos:pos + take]))
                else:  # the block's tail outlives this call: keep a copy
                    self._pieces.append(bytes(view[pos:pos + take]))
                    self._filled += take
                pos += take
        finally:
            for fut in mine:  # the caller's buffer is free once the blocks that read it are hashed
                fut.result()
            self.size -= view.nbytes - pos  # what a failure left unfed is not counted

    def update_owned(self, data: bytes) -> None:
        """Hash ``data``, an immutable ``bytes`` the caller hands over; returns before it is hashed."""
        if not isinstance(data, bytes):
            raise TypeError(f"update_owned takes bytes (immutable), got {type(data).__name__}; use update()")
        self._flush_small()
        self.size += len(data)
        self._feed_owned(memoryview(data))

    def _flush_small(self) -> None:
        if self._small:
            small, self._small = self._small, bytearray()  # handed over: never written to again
            self._feed_owned(memoryview(small))

    def _feed_owned(self, view: memoryview) -> None:
        pos = 0
        while pos < view.nbytes:
            take = min(self.block_bytes - self._filled, view.nbytes - pos)
            if self._filled + take == self.block_bytes:
                self._in_flight.append(self._finish_block(view[pos:pos + take]))
                while len(self._in_flight) > self._max_in_flight:  # bounded memory: wait for the oldest
                    self._in_flight.popleft().result()
            else:
                self._pieces.append(view[pos:pos + take])
                self._filled += take
            pos += take

    def _finish_block(self, last_piece) -> Future:
        fut = _submit(self._pieces + [last_piece])  # state changes only once the block is on its way
        digests, index = self._digests, len(self._digests)
        digests.append(fut)
        fut.add_done_callback(lambda f: f.exception() is None and digests.__setitem__(index, f.result()))
        self._pieces, self._filled = [], 0
        return fut

    # ---- the digest
    def digest(self) -> bytes:
        """The digest of everything fed so far (feeding may go on after it)."""
        self._flush_small()
        blocks = [d.result() if isinstance(d, Future) else d for d in self._digests]
        self._digests = list(blocks)
        self._in_flight.clear()
        if self._pieces:
            blocks.append(_hash_pieces(list(self._pieces)))
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


__all__ = ["BLOCK_BYTES", "MAX_BLOCK_BYTES", "MIN_BLOCK_BYTES", "BlockSha256", "block_sha256_of_file",
           "check_block_bytes", "hash_workers"]
