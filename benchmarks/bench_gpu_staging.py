"""Checkpoint stall of a large state on the GPU: staging through pinned against pageable host memory.

Side by side in one run, on the same GPU state (float32 parameters in 64 MB tensors, plus Adam-sized
moments: ``--gb`` is the whole state):

* the training stall of a two-phase save (``SpotSession``'s staging: what training waits for), with
  page-locked (pinned) host buffers — the default — and with pageable ones (``Stager(pin_memory=False)``),
  warm buffers (median of ``--repeats``) and the first save (buffers allocated, pinned ones locked);
* the synchronous save a loop without the two-phase design would wait for (stage + serialise + sha256 +
  fsync + manifest, file:// on the machine's disk), and the background write after a pinned stage;
* the emergency save, notice to committed checkpoint, with the block SHA-256 and with a whole-file one;
* the store's write of the staged state with a block SHA-256 hashed on every core while each chunk is
  written, against a whole-file sha256 and against hashing then writing, and the restore's verify of
  each (``bench_checkpoint_save.bench_hash_overlap``).

Needs a CUDA GPU. Figures go to stdout and, with ``--json F``, to a file.

    python benchmarks/bench_gpu_staging.py [--gb 2,8] [--repeats 5] [--dir /tmp] [--json F]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from bench_checkpoint_save import (
    BEFORE,
    bench_hash_overlap,
    drop_page_cache,
    emergency_after_notice,
    mixed_state,
    print_hash_overlap,
)

from airflow_spot.training.session import SpotSession
from airflow_spot.training.state import Stager

TENSOR_MB = 64


class GpuState(torch.nn.Module):
    """``gb`` gigabytes of float32 state on the GPU, in 64 MB tensors (a third parameters, two thirds
    optimizer moments, as Adam keeps them)."""

    def __init__(self, gb: float) -> None:
        super().__init__()
        n = max(3, int(gb * 1024 / TENSOR_MB) // 3 * 3)
        numel = TENSOR_MB * 1024 * 1024 // 4
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(numel, device="cuda")) for _ in range(n)
        )

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.ps)


def stall(stager: Stager, model: GpuState, repeats: int) -> tuple[float, float]:
    """(first stage, median warm stage) in seconds; each after the GPU has finished a kernel on every tensor."""
    times = []
    for _ in range(repeats + 1):
        with torch.no_grad():
            for p in model.ps:
                p.add_(1.0)
        torch.cuda.synchronize()  # a training step has just ended
        t = time.perf_counter()
        staged = stager.stage(model.state_dict(), ("model",))
        times.append(time.perf_counter() - t)
        assert torch.equal(staged[next(iter(staged))], model.ps[0].detach().cpu())
    return times[0], statistics.median(times[1:])


def session_saves(directory: str, model: GpuState, repeats: int) -> dict:
    spot = SpotSession(f"file://{directory}", 10**9, notice_sources=[], heartbeat_seconds=3600, keep=2)
    spot.__enter__()
    spot.track(model=model)
    sync, pinned_stall, background = [], [], []
    for i in range(repeats):
        spot.step = 2 * i + 1
        torch.cuda.synchronize()
        t = time.perf_counter()
        spot._save("final", wait=True)
        sync.append(time.perf_counter() - t)
        spot.step += 1
        torch.cuda.synchronize()
        t = time.perf_counter()
        spot._save("periodic", wait=False)
        pinned_stall.append(time.perf_counter() - t)
        spot.writer.wait()
        background.append(time.perf_counter() - t)
    spot.__exit__(None, None, None)
    return {"sync": statistics.median(sync), "session_stall": statistics.median(pinned_stall),
            "stall_plus_write": statistics.median(background)}


def emergency_alone(directory: str, model: GpuState, block_bytes: int, warm: bool = True) -> float:
    """A fresh session's emergency save of ``model``, its payload digest a block SHA-256 or, with
    ``block_bytes=0``, the whole-file sha256 of before; ``warm``: after one periodic save (warm staging
    buffers, as a session's emergency save usually has), else straight after ``track()`` allocated them
    (a state too large for two checkpoints on the disk). Starts on a quiet disk and an empty page cache."""
    from airflow_spot.storage.checkpoint import DIGEST_ENV

    before = os.environ.get(DIGEST_ENV)
    os.environ[DIGEST_ENV] = "block" if block_bytes else "sha256"
    try:
        spot = SpotSession(f"file://{directory}", 10**9, notice_sources=[], heartbeat_seconds=3600, keep=2)
        spot.__enter__()
        spot.track(model=model)
        spot.step = 1
        if warm:
            spot._save("periodic", wait=True)
            spot.step = 2
        drop_page_cache()
        return emergency_after_notice(spot)
    finally:
        if before is None:
            os.environ.pop(DIGEST_ENV, None)
        else:
            os.environ[DIGEST_ENV] = before


def paired_emergencies(directory: str, model: GpuState, repeats: int) -> dict:
    """The emergency save with each digest, ``repeats`` times, which goes first alternating, each in a
    fresh store: medians."""
    from airflow_spot.storage.block_digest import BLOCK_BYTES

    times: dict[str, list[float]] = {"block sha256": [], "sha256": []}
    modes = (("block sha256", BLOCK_BYTES), ("sha256", 0))
    for i in range(repeats):
        for label, block in modes[i % 2:] + modes[:i % 2]:
            with tempfile.TemporaryDirectory(dir=directory) as d:
                times[label].append(emergency_alone(d, model, block))
    return {k: statistics.median(v) for k, v in times.items()}


def large_emergencies(sizes: list[float], directory: str) -> dict:
    """The emergency save of each size with the block and the whole-file digest, one checkpoint on the disk
    at a time; which goes first alternates from one size to the next."""
    from airflow_spot.storage.block_digest import BLOCK_BYTES

    out = {}
    for i, gb in enumerate(sizes):
        model = GpuState(gb)
        size = model.nbytes / 1e9
        row = {}
        modes = (("block sha256", BLOCK_BYTES), ("sha256", 0))
        for label, block in modes[i % 2:] + modes[:i % 2]:
            with tempfile.TemporaryDirectory(dir=directory) as d:
                row[label] = emergency_alone(d, model, block, warm=False)
            gc.collect()
        out[f"{size:.2f}"] = row
        print(f"emergency save of {size:.2f} GB, notice -> committed, file:// in {directory} (once each, "
              f"{next(iter(row))} first):")
        for label, t in sorted(row.items()):
            print(f"  {label:14s} {t:7.3f} s   {t / 30:.1%} of a 30 s notice, {t / 120:.1%} of 120 s")
        print(f"  block / whole-file {row['block sha256'] / row['sha256']:.3f}")
        del model
        gc.collect()  # the sessions' pinned buffers go before the next size's are locked
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", default="2,8", help="comma-separated state sizes in GB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the file:// store goes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--session-gb", type=float, default=2.0,
                    help="state size for the session's synchronous and emergency saves (disk-bound)")
    ap.add_argument("--mixed-gb", type=float, default=0.0,
                    help="also the store's save and verify of a host state this large in tensors of 4 KiB-16 MiB")
    ap.add_argument("--emergency-gb", default="",
                    help="comma-separated sizes whose emergency save alone is measured, block and whole-file digest "
                         "(needs the state's size free on the disk); with it, nothing else is measured")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_staging: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    out: dict = {"device": name, "torch": torch.__version__, "sizes": {}}
    if args.emergency_gb:
        out["emergency"] = large_emergencies([float(x) for x in args.emergency_gb.split(",") if x], args.dir)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        return 0
    for gb in [float(x) for x in args.gb.split(",") if x]:
        model = GpuState(gb)
        size = model.nbytes / 1e9
        row = {}
        for label, stager in (("pageable", Stager(pin_memory=False)), ("pinned", Stager())):
            first, warm = stall(stager, model, args.repeats)
            row[label] = {"first_s": first, "warm_s": warm, "GB_per_s": size / warm}
            del stager
        row["pinned_over_pageable"] = row["pinned"]["warm_s"] / row["pageable"]["warm_s"]
        out["sizes"][f"{size:.2f}"] = row
        print(f"state {size:.2f} GB on the GPU, staging stall (median of {args.repeats}, warm buffers):")
        for label in ("pageable", "pinned"):
            r = row[label]
            print(f"  {label:9s} {r['warm_s']:7.3f} s  ({r['GB_per_s']:5.1f} GB/s; first save {r['first_s']:6.2f} s)")
        print(f"  pinned / pageable {row['pinned_over_pageable']:.3f}")
        del model
        torch.cuda.empty_cache()
    model = GpuState(args.session_gb)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        s = session_saves(d, model, args.repeats)
    e = paired_emergencies(args.dir, model, args.repeats)  # each on a disk without other checkpoints
    s["emergency"], s["emergency_sha256"] = e["block sha256"], e["sha256"]
    size = model.nbytes / 1e9
    out["session"] = {"GB": size, **s, "stall_over_sync": s["session_stall"] / s["sync"]}
    print(f"SpotSession, {size:.2f} GB on the GPU, file:// in {args.dir} (median of {args.repeats}):")
    print(f"  synchronous save (training waits for all of it)  {s['sync']:7.3f} s   1.000")
    print(f"  two-phase: training stall (pinned staging)       {s['session_stall']:7.3f} s   "
          f"{s['session_stall'] / s['sync']:.3f}   target <= 0.10")
    print(f"  two-phase: stall + background write              {s['stall_plus_write']:7.3f} s")
    print(f"  emergency save, notice -> committed (a fresh store each, order alternated, median of {args.repeats}):")
    print(f"    block sha256                                   {s['emergency']:7.3f} s   "
          f"{s['emergency'] / 30:.1%} of a 30 s notice, {s['emergency'] / 120:.1%} of 120 s")
    print(f"    whole-file sha256 (before)                     {s['emergency_sha256']:7.3f} s   "
          f"{s['emergency_sha256'] / 30:.1%} of a 30 s notice; block / whole-file "
          f"{s['emergency'] / s['emergency_sha256']:.3f}")
    # the write of a staged state (host memory, as the background thread and the emergency save see it)
    staged = Stager().stage(model.state_dict())
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        h = bench_hash_overlap(d, staged, args.repeats)
    print_hash_overlap(model.nbytes / 1e6, h, args.repeats)
    out["session"]["store_save"] = {**h, "block_over_before": h["block sha256, overlapped"] / h[BEFORE],
                                    "block_over_sha256": h["block sha256, overlapped"] / h["sha256, overlapped"]}
    if args.mixed_gb:  # a model's many small tensors: the case least favourable to block hashing
        del staged
        mixed = mixed_state(args.mixed_gb * 1000)
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            h = bench_hash_overlap(d, mixed, args.repeats)
        print(f"the same for {len(mixed)} host tensors of 4 KiB to 16 MiB in turn:")
        print_hash_overlap(args.mixed_gb * 1000, h, args.repeats)
        out["mixed_store_save"] = h
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
