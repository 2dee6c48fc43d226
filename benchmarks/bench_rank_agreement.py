"""What the per-step agreement of data parallel ranks costs, beside the steps it sits between.

Under ``torchrun`` the session agrees once a step, in one all-reduce on a gloo group of its own
(``training/ranks.py``), on the notice, the saves due and whether rank 0's writer is busy. Side by side,
in one run, two ranks on this machine's CPU (gloo over 127.0.0.1): a DDP training step of a small MLP
alone, the same step followed by ``Ranks.agree`` (what the session adds), and ``Ranks.agree`` alone.
On a GPU host the step is the GPU's and the agreement stays on CPU (no device synchronisation), so the
agreement's absolute time is the figure to carry over, not the ratio.

    python benchmarks/bench_rank_agreement.py [--ranks 2] [--steps 400] [--width 512]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        dist.barrier()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _rank(rank: int, world: int, port: int, steps: int, width: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from airflow_spot.training.ranks import Ranks

    ranks = Ranks(rank, world)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, width), torch.randn(32, 1)

    def step() -> None:
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    def agree() -> None:
        ranks.agree(False, False, False, False, False, False, True)

    def step_and_agree() -> None:
        step()
        agree()

    for _ in range(20):  # warm-up
        step_and_agree()
    timings = {"step": _timed(step, steps), "step + agree": _timed(step_and_agree, steps),
               "agree": _timed(agree, steps)}
    if rank == 0:
        results.update({k: statistics.median(v) for k, v in timings.items()})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(args.ranks, _free_port(), args.steps, args.width, results), nprocs=args.ranks)
        medians = dict(results)
    print(f"{args.ranks} ranks, gloo on CPU, MLP width {args.width}, batch 32; median of {args.steps} per row")
    for name, seconds in medians.items():
        print(f"  {name:<14} {seconds * 1e6:9.0f} us")
    added = medians["step + agree"] - medians["step"]
    print(f"  agreement adds {added * 1e6:.0f} us a step ({added / medians['step']:.1%} of this CPU step)")


if __name__ == "__main__":
    main()
