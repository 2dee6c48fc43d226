"""The stall of a background sharded (FSDP2) save: copying the shards to host memory into buffers allocated
for that save against into the buffers kept from the previous save (``training/sharded.py: _to_host``).

Side by side in one run, interleaved, on the same state: one process (gloo), an FSDP2 model of 64 MB linear
layers trained one Adam step (so the optimizer state is there), its model and optimizer state dicts as the
session takes them (``get_model_state_dict`` / ``get_optimizer_state_dict``: DTensors); ``--mb`` is the
model's parameters, the state is about three times that. On CPU the host buffers are pageable; on a GPU
they are pinned, whose allocation costs more (``bench_gpu_staging.py`` measures pinned against pageable).

    python benchmarks/bench_sharded_staging.py [--mb 256] [--repeats 7]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256, help="model parameters in MB (the state is ~3x: Adam)")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from airflow_spot.training.sharded import _to_host

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
        try:
            width = 4096  # a 4096 x 4096 float32 layer is 64 MB
            layers = [torch.nn.Linear(width, width, bias=False) for _ in range(max(1, args.mb // 64))]
            model = torch.nn.Sequential(*layers)
            mesh = init_device_mesh("cpu", (1,))
            for layer in layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            model(torch.randn(2, width)).sum().backward()
            opt.step()
            state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
            fresh, kept_times, kept = [], [], None
            _, kept = _to_host(state, None)  # the first save allocates in both designs
            for i in range(args.repeats):
                for reuse in ((False, True) if i % 2 == 0 else (True, False)):
                    gc.collect()
                    started = time.perf_counter()
                    copy, got = _to_host(state, kept if reuse else None)
                    (kept_times if reuse else fresh).append(time.perf_counter() - started)
                    del copy
                    if reuse:
                        assert got is kept, "the layout did not change: the buffers must be reused"
        finally:
            dist.destroy_process_group()
    print(f"host copy of an FSDP2 model + Adam state, {nbytes / 2**20:.0f} MB, one process (gloo), "
          f"{args.repeats} repeats interleaved; torch {torch.__version__}, {os.cpu_count()} cpus, "
          f"cuda {torch.cuda.is_available()}, python {sys.version.split()[0]}")
    for name, times in (("buffers allocated for each save", fresh), ("buffers kept from the last save", kept_times)):
        print(f"  {name:34s} median {statistics.median(times):.3f} s (min {min(times):.3f}, max {max(times):.3f})")
    print(f"  kept / allocated: {statistics.median(kept_times) / statistics.median(fresh):.2f}x")
    return 0


def _tensors(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, torch.Tensor):
        yield getattr(obj, "_local_tensor", obj)


if __name__ == "__main__":
    raise SystemExit(main())
