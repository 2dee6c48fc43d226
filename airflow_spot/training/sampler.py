"""A sampler whose position (epoch, offset) is part of the checkpoint."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Shuffled (or sequential) indices, one permutation per epoch from ``seed + epoch``.

    ``state_dict()`` records the epoch and how many indices of it were handed out, so a restored sampler
    continues with the very next index. Worker prefetching takes indices before the step that uses them
    has run, so with a ``DataLoader`` this position is training's only with ``num_workers=0``.
    Iterating past the end of an epoch starts the next one, so ``iter(sampler)`` can feed many epochs.
    For workers, use :class:`~airflow_spot.training.data.ResumableLoader`, which counts the batches
    training received; a plain DataLoader over this sampler resumes bit-exactly with ``num_workers=0``
    when it is tracked (``spot.track(loader=...)``), which gives it a generator of its own.

    **Data parallel** (``torchrun``): give each rank ``rank=`` and ``num_replicas=`` (as for
    ``DistributedSampler``); rank ``r`` takes every ``num_replicas``-th index of the epoch's order from ``r``
    on, and the tail that does not divide evenly is left out, so the ranks take their steps together. The
    ranks' positions are then the same, and the one rank 0 saves restores every rank. Resumed on another
    number of ranks, the epoch continues after the items already taken (to within a rank's share).
    """

    def __init__(self, length: int, seed: int = 0, shuffle: bool = True, *, rank: int = 0,
                 num_replicas: int = 1) -> None:
        if length < 1:
            raise ValueError(f"ResumableSampler needs a positive dataset length, got {length}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"ResumableSampler needs 0 <= rank < num_replicas, got rank={rank}, "
                             f"num_replicas={num_replicas}")
        if length < num_replicas:
            raise ValueError(f"a dataset of {length} items cannot give each of {num_replicas} ranks one")
        self.length = length
        self.seed = seed
        self.shuffle = shuffle
        self.rank, self.num_replicas = rank, num_replicas
        self.per_rank = length // num_replicas  # this rank's items an epoch
        self.epoch = 0
        self.offset = 0  # this rank's items taken this epoch

    def order(self) -> list[int]:
        """This rank's indices of the current epoch, in the order they are handed out."""
        if not self.shuffle:
            order = list(range(self.length))
        else:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        return order[self.rank::self.num_replicas][: self.per_rank]

    def __iter__(self) -> Iterator[int]:
        while True:
            order = self.order()
            while self.offset < self.per_rank:
                i = order[self.offset]
                self.offset += 1
                yield i
            self.epoch += 1
            self.offset = 0
            return  # one epoch per iter(); the position carries over to the next iter()

    def batches(self, batch_size: int) -> Iterator[list[int]]:
        """Endless batches across epochs, resuming from the saved position."""
        while True:
            batch = []
            for i in self:
                batch.append(i)
                if len(batch) == batch_size:
                    yield batch
                    batch = []
            if batch:
                yield batch

    def __len__(self) -> int:
        return self.per_rank - self.offset

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "length": self.length,
                "shuffle": self.shuffle, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # the saved position means something only in the order it was taken from: another length, seed or
        # shuffle would resume mid-epoch in another permutation (items seen twice, others never)
        if state.get("length", self.length) != self.length:
            raise ValueError(
                f"sampler was saved for a dataset of {state['length']} items, this one has {self.length}"
            )
        for name in ("seed", "shuffle"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"sampler was saved with {name}={state[name]!r}, this one has {name}={getattr(self, name)!r}: "
                    f"resuming would feed another order of the data; build it with {name}={state[name]!r}, or "
                    "start a new job (a new checkpoint_uri) for the new order")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        saved_replicas = int(state.get("num_replicas", 1))
        if saved_replicas != self.num_replicas:  # the items the saved ranks took, shared among these
            self.offset = min(self.per_rank, self.offset * saved_replicas // self.num_replicas)
