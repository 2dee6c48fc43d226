"""``train_tiny`` fed the other ways people feed data, each resumable bit for bit under ``SpotSession``.

``--feed`` picks the way:

* ``dataloader``: a plain ``DataLoader(dataset, sampler=ResumableSampler(...), num_workers=0)`` passed to
  ``spot.track(loader=...)``;
* ``loader-workers``: a :class:`~airflow_spot.training.ResumableLoader` with two worker processes;
* ``iterable``: a ``ResumableLoader`` over an ``IterableDataset`` that exposes its position;
* ``accumulation``: gradient accumulation, ``--accumulate`` micro-batches from a ``ResumableLoader`` per step.

The datasets draw random augmentations (python's and torch's RNGs) for every sample, so a resume that
feeds a different sample, or the same sample with a different draw, gives different weights::

    python -m airflow_spot.examples.train_feeds --feed loader-workers --total-steps 200 --job-uri /tmp/f
"""
from __future__ import annotations

import argparse
import logging
import random
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from airflow_spot.examples.train_tiny import build
from airflow_spot.training import ResumableLoader, ResumableSampler, SpotSession

FEEDS = ("dataloader", "loader-workers", "iterable", "accumulation")


def augment(x: torch.Tensor) -> torch.Tensor:
    """A random scale and jitter: draws from torch's and python's RNGs for each sample."""
    return x * (1.0 + 0.05 * torch.rand(())) + 0.01 * random.random()


class NoisyPairs(Dataset):
    """Map-style (x, y) pairs with a random augmentation per fetch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return augment(self.x[i]), self.y[i]


class PairStream(IterableDataset):
    """A stream of (x, y) pairs, one shuffled pass after another, with the position protocol of
    :mod:`airflow_spot.training.data`: ``state_dict`` is (pass, items of it yielded)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
        self.x, self.y, self.seed = x, y, seed
        self.pass_, self.position = 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + self.pass_))
        while self.position < len(order):
            i = int(order[self.position])
            self.position += 1  # before the yield: the state then counts the item being handed out
            yield augment(self.x[i]), self.y[i]
        self.pass_, self.position = self.pass_ + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"pass": self.pass_, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pass_, self.position = int(state["pass"]), int(state["position"])


class PlainLoaderBatches:
    """Endless batches from a plain DataLoader: a new iterator at each epoch's end, as scripts do."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.iterator = loader, None

    def __next__(self):
        for _ in range(2):
            if self.iterator is None:
                self.iterator = iter(self.loader)
            try:
                return next(self.iterator)
            except StopIteration:
                self.iterator = None
        raise RuntimeError("the DataLoader gave no batch in a whole epoch")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--feed", choices=FEEDS, required=True)
    p.add_argument("--total-steps", type=int, default=300, help="length of the whole job (LR schedule)")
    p.add_argument("--job-uri", default=None, help="checkpoint root when run outside airflow-spot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64, help="width of the MLP (larger: longer saves)")
    p.add_argument("--accumulate", type=int, default=3, help="micro-batches per step (--feed accumulation)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (--feed loader-workers)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (slower demo)")
    p.add_argument("--final-weights", default=None, help="write the model's state_dict here at the last step")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    x, y, model, opt = build(args.seed, args.hidden)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.total_steps)
    loss_fn = nn.MSELoss()
    micro = args.accumulate if args.feed == "accumulation" else 1
    if args.feed == "dataloader":
        sampler = ResumableSampler(len(x), seed=args.seed)
        data = DataLoader(NoisyPairs(x, y), sampler=sampler, batch_size=args.batch_size, num_workers=0)
        batches = PlainLoaderBatches(data)
    elif args.feed == "iterable":
        data = batches = ResumableLoader(PairStream(x, y, args.seed), batch_size=args.batch_size)
    else:
        workers = args.workers if args.feed == "loader-workers" else 0
        data = batches = ResumableLoader(NoisyPairs(x, y), batch_size=args.batch_size // micro, seed=args.seed,
                                         num_workers=workers)

    with SpotSession.from_env(total_steps=args.total_steps, job_uri=args.job_uri) as spot:
        start = spot.track(model=model, optimizer=opt, scheduler=sched, loader=data)
        print(f"resuming at step {start}", flush=True)
        for _ in spot.steps():
            model.train()
            opt.zero_grad()
            total = 0.0
            for _ in range(micro):  # a kill between micro-batches loses the step, never counts one twice
                xb, yb = next(batches)
                loss = loss_fn(model(xb), yb) / micro
                loss.backward()
                total += loss.item()
            opt.step()
            sched.step()
            spot.report(loss=total)
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
