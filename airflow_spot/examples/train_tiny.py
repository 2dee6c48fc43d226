"""A small, deterministic torch training script that survives preemptions through ``SpotSession``.

An MLP with dropout learns a synthetic regression task with AdamW, a cosine LR schedule and a shuffled,
resumable sampler; every step also draws from python's and numpy's RNGs, so a resume that misses any
piece of state produces different weights. Run by hand::

    python -m airflow_spot.examples.train_tiny --total-steps 300 --job-uri /tmp/tiny --final-weights w.pt

Under airflow-spot the segment's range and store come from the ``SPOT_*`` environment.
"""
from __future__ import annotations

import argparse
import logging
import random
import time

import numpy as np
import torch
from torch import nn

from airflow_spot.training import ResumableSampler, SpotSession


def build(seed: int, hidden: int, samples: int = 512, features: int = 16):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    true_w = torch.randn(features, 1, generator=g)
    y = torch.sin(x @ true_w) + 0.1 * torch.randn(samples, 1, generator=g)
    model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-3)
    return x, y, model, opt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-steps", type=int, default=300, help="length of the whole job (LR schedule)")
    p.add_argument("--job-uri", default=None, help="checkpoint root when run outside airflow-spot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (slower demo)")
    p.add_argument("--final-weights", default=None, help="write the model's state_dict here at the last step")
    p.add_argument("--fail-at-step", type=int, default=None, help="raise at this step (tests a code failure)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    x, y, model, opt = build(args.seed, args.hidden)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.total_steps)
    sampler = ResumableSampler(len(x), seed=args.seed)
    loss_fn = nn.MSELoss()

    with SpotSession.from_env(total_steps=args.total_steps, job_uri=args.job_uri) as spot:
        start = spot.track(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
        print(f"resuming at step {start}", flush=True)
        batches = sampler.batches(args.batch_size)
        for step in spot.steps():
            if args.fail_at_step is not None and step == args.fail_at_step:
                raise RuntimeError(f"injected failure at step {step}")
            idx = torch.tensor(next(batches))
            # python and numpy randomness on purpose: their RNG states must survive a resume too
            scale = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
            model.train()
            opt.zero_grad()
            loss = loss_fn(model(x[idx] * scale), y[idx])
            loss.backward()
            opt.step()
            sched.step()
            spot.report(loss=loss.item(), lr=sched.get_last_lr()[0])
            if args.step_sleep:
                time.sleep(args.step_sleep)
        if "loss" in spot.metrics:
            print(f"segment done at step {spot.step} loss={spot.metrics['loss']:.5f}", flush=True)
        else:  # no step to run: resumed at or past the segment's end (a finished job run again by hand)
            print(f"nothing to train: resumed at step {spot.step}, the segment's end", flush=True)
        if args.final_weights and spot.step >= args.total_steps:
            torch.save(model.state_dict(), args.final_weights)
            torch.save(opt.state_dict(), args.final_weights + ".optim")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
