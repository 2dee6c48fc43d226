"""Two-phase save vs synchronous save, and emergency-save time for large states.

Measures, side by side in one run on the same state:
  * the synchronous save (stage + serialise + sha256 + fsync + manifest) a training loop would wait for
    without the two-phase design,
  * the stall of a two-phase save (what training waits for: staging into reused host buffers),
  * the store's save of the staged state with a block SHA-256 computed on every core while each chunk is
    written, against a whole-file sha256 and against hashing then writing; the restore's verify of each,
  * the emergency save of ~1 GB (notice to committed checkpoint) on file:// and s3:// (moto server),
    against the 30 s notice of GCP/Azure and the 120 s of AWS.

    python benchmarks/bench_checkpoint_save.py [--mb 500] [--emergency-mb 1024] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from airflow_spot.storage import checkpoint as checkpoint_module
from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.training.session import SpotSession


class Blob(torch.nn.Module):
    """A 'model' whose state is ``mb`` megabytes of float32 in 16 MB tensors."""

    def __init__(self, mb: int) -> None:
        super().__init__()
        n = max(1, mb // 16)
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4 * 1024 * 1024)) for _ in range(n))


#: tensor sizes of a state like a model's many layers (norms and biases of KBs beside matrices of MBs), cycled
MIXED_TENSOR_BYTES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def mixed_state(mb: float) -> dict:
    """``mb`` megabytes of float32 host tensors of :data:`MIXED_TENSOR_BYTES` sizes in turn (each size the
    same count, so the small ones are many but hold few of the bytes)."""
    state, total, i = {}, 0, 0
    while total < mb * 1e6:
        n = MIXED_TENSOR_BYTES[i % len(MIXED_TENSOR_BYTES)]
        state[f"t{i}"] = torch.randn(n // 4)
        total += n
        i += 1
    return state


def session(uri: str, mb: int) -> tuple[SpotSession, Blob]:
    model = Blob(mb)
    spot = SpotSession(uri, 10**9, notice_sources=[], heartbeat_seconds=3600, keep=2)
    spot.__enter__()
    spot.track(model=model)
    return spot, model


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_two_phase(mb: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        spot, model = session(d, mb)
        spot.step = 1
        first_stall = timed(lambda: spot._save("periodic", wait=False))  # cold buffers
        spot.writer.wait()
        sync, stall, bg = [], [], []
        for _ in range(repeats):
            spot.step += 1
            with torch.no_grad():
                model.ps[0].add_(1.0)
            sync.append(timed(lambda: spot._save("final", wait=True)))
            spot.step += 1
            stall.append(timed(lambda: spot._save("periodic", wait=False)))
            bg.append(timed(spot.writer.wait) + stall[-1])
        spot.__exit__(None, None, None)
    return {
        "sync": statistics.median(sync),
        "stall": statistics.median(stall),
        "stall_first": first_stall,
        "background_total": statistics.median(bg),
    }


#: how the store's save overlaps its parts: (label, digest block size (0: whole-file sha256), hash chunks
#: while writing them, flush to disk while writing)
WRITE_MODES = (
    ("block sha256, overlapped", checkpoint_module.BLOCK_BYTES, True, True),
    ("sha256, overlapped", 0, True, True),
    ("sha256, hash overlapped", 0, True, False),
    ("sequential (before)", 0, False, False),
)
BEFORE = "sequential (before)"


def bench_hash_overlap(directory: str, state: dict, repeats: int) -> dict:
    """``CheckpointStore.save`` of ``state`` (host tensors) to file:// in each of :data:`WRITE_MODES`,
    alternated, median of each: the write as it is (a block SHA-256 hashed on every core while each chunk
    is written, dirty pages flushed while later ones are written), with a whole-file sha256 instead, with
    the hash overlap alone, and as before (serialise and hash, then the whole fsync at the commit).
    Then the restore's read and verify of the payload each digest names (warm page cache)."""
    from airflow_spot.storage import object_store

    store = CheckpointStore(open_store(f"file://{directory}"), writer="bench")
    times: dict[str, list[float]] = {label: [] for label, *_ in WRITE_MODES}
    verify: dict[str, list[float]] = {"block sha256": [], "sha256": []}
    writer = checkpoint_module._HashingWriter
    defaults = writer.PARALLEL_BYTES, object_store._EarlyWriteback.EVERY_BYTES
    step = 0
    cold = False
    try:
        for i in range(repeats):
            # each mode leads in turn, and each starts on a quiet disk and an empty page cache: the previous
            # save's writeback and the deletion of its files must not be charged to the next one
            n = len(WRITE_MODES)
            for label, block, hash_overlap, early_flush in WRITE_MODES[i % n:] + WRITE_MODES[:i % n]:
                writer.PARALLEL_BYTES = defaults[0] if hash_overlap else float("inf")
                store.block_bytes = block
                object_store._EarlyWriteback.EVERY_BYTES = defaults[1] if early_flush else float("inf")
                step += 1
                store.store.delete(store.store.list())  # a large state must not fill the disk
                drop_page_cache()
                times[label].append(timed(lambda: store.save(step, lambda f: torch.save(state, f))))
                if label in ("block sha256, overlapped", "sha256, overlapped"):
                    manifest = store.committed()[-1]
                    kind = label.partition(",")[0]
                    cold = drop_page_cache()
                    verify[kind].append(timed(lambda: store.fetch_verified(manifest, manifest.files[0], len)))
    finally:
        writer.PARALLEL_BYTES, object_store._EarlyWriteback.EVERY_BYTES = defaults
    out = {k: statistics.median(v) for k, v in times.items()}
    out["verify"] = {k: statistics.median(v) for k, v in verify.items()}
    out["verify_cache"] = "cold" if cold else "warm"
    return out


def drop_page_cache() -> bool:
    """Empty the page cache where this process may (root on Linux), so a read comes from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def print_hash_overlap(mb: float, h: dict, repeats: int) -> None:
    from airflow_spot.storage.block_digest import hash_workers

    print(f"CheckpointStore.save of {mb:.0f} MB to file:// (serialise + digest + write + fsync), median of {repeats}; "
          f"block sha256 on {hash_workers()} threads:")
    before = h[BEFORE]
    for label, *_ in WRITE_MODES:
        print(f"  {label:26s} {h[label]:7.3f} s   {h[label] / before:.3f}")
    v = h["verify"]
    print(f"restore's read + verify of that payload ({h['verify_cache']} page cache), median of {repeats}:")
    for kind in ("block sha256", "sha256"):
        print(f"  {kind:26s} {v[kind]:7.3f} s   {v[kind] / v['sha256']:.3f}   ({mb / 1000 / v[kind]:.2f} GB/s)")


def _human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def bench_write_sizes(total_mb: int = 512, repeats: int = 3) -> dict[int, float]:
    """The digest's cost alone, by write size: ``_HashingWriter`` over a sink that keeps nothing, fed as
    ``torch.save`` feeds it (a few small record headers, then a tensor's storage from one reused buffer),
    block / whole-file SHA-256 time (best of ``repeats``)."""
    import io

    class Null(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            return memoryview(b).nbytes

    def run(block: int, tensor: int) -> float:
        buf, headers = bytearray(tensor), [b"x" * n for n in (30, 16, 34, 16)]
        t = time.perf_counter()
        with checkpoint_module._HashingWriter(Null(), block) as hw:
            for _ in range(total_mb * 2**20 // tensor):
                for h in headers:
                    hw.write(h)
                hw.write(memoryview(buf))
            hw.hasher.hexdigest()
        return time.perf_counter() - t

    out = {}
    for tensor in (4 << 10, 256 << 10, 4 << 20, 64 << 20):
        whole = min(run(0, tensor) for _ in range(repeats))
        block = min(run(checkpoint_module.BLOCK_BYTES, tensor) for _ in range(repeats))
        out[tensor] = block / whole
        print(f"  writes of {_human(tensor):>7}: whole-file {total_mb / whole:6.0f} MiB/s, block {total_mb / block:6.0f} "
              f"MiB/s, block / whole-file time {block / whole:.2f}")
    return out


def emergency_after_notice(spot: SpotSession) -> float:
    """Seconds from a preemption notice to the committed emergency checkpoint; closes ``spot``."""
    spot._on_notice("preemption", "benchmark")
    t = time.perf_counter()
    try:
        spot._emergency_exit()
    except SystemExit:
        pass
    took = time.perf_counter() - t
    spot.__exit__(None, None, None)
    return took


def bench_emergency(uri: str, mb: int) -> float:
    spot, model = session(uri, mb)
    spot.step = 1
    spot._save("periodic", wait=False)  # a save is usually in flight or done when the notice comes
    spot.writer.wait()
    spot.step = 2
    return emergency_after_notice(spot)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=500)
    p.add_argument("--emergency-mb", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write-sizes-only", action="store_true", help="only the digest's cost by write size")
    args = p.parse_args()

    print(f"the digest alone by write size, 512 MiB to a null sink, best of {args.repeats}:")
    bench_write_sizes(repeats=args.repeats)
    if args.write_sizes_only:
        return 0

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (the machine may be shared)")
    r = bench_two_phase(args.mb, args.repeats)
    print(f"state {args.mb} MB, file:// on local disk, median of {args.repeats}")
    print(f"  synchronous save (training waits for all of it)  {r['sync']:7.3f} s   1.000")
    print(f"  two-phase: training stall (warm buffers)         {r['stall']:7.3f} s   {r['stall']/r['sync']:.3f}"
          "   target <= 0.10")
    print(f"  two-phase: first stall (buffers allocated)       {r['stall_first']:7.3f} s   "
          f"{r['stall_first']/r['sync']:.3f}")
    print(f"  two-phase: stall + background write              {r['background_total']:7.3f} s   "
          f"{r['background_total']/r['sync']:.3f}")

    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        state = {k: v.detach().clone() for k, v in Blob(args.mb).state_dict().items()}
        print_hash_overlap(args.mb, bench_hash_overlap(d, state, args.repeats), args.repeats)
        state = mixed_state(args.mb)
        print(f"the same with {len(state)} tensors of {', '.join(_human(b) for b in MIXED_TENSOR_BYTES)} in turn:")
        print_hash_overlap(args.mb, bench_hash_overlap(d, state, args.repeats), args.repeats)

    from airflow_spot.testing.moto_s3 import create_bucket, moto_server_process

    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        t_file = bench_emergency(d, args.emergency_mb)
    with moto_server_process() as endpoint:
        create_bucket(endpoint, "bench")
        os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
        t_s3 = bench_emergency("s3://bench/emergency", args.emergency_mb)
    print(f"emergency save of {args.emergency_mb} MB (notice -> committed)")
    for name, t in (("file://", t_file), ("s3:// (moto server)", t_s3)):
        print(f"  {name:22s} {t:7.2f} s   {t/30:5.1%} of a 30 s notice (GCP/Azure), {t/120:5.1%} of 120 s (AWS)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
