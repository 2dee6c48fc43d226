"""Feeding data so that a resume is bit-exact: a checkpointable DataLoader and the checks behind it.

Ways of feeding data that resume bit for bit (weights, optimizer state and every later batch identical to
a run that was never interrupted):

* ``ResumableSampler.batches(n)`` in the training process (:mod:`airflow_spot.training.sampler`);
* :class:`ResumableLoader`: a ``torch.utils.data.DataLoader`` that the session checkpoints, with any
  ``num_workers``, over a map-style dataset, or (``num_workers=0``) over an ``IterableDataset`` that exposes
  its position (the protocol below);
* a plain ``DataLoader(dataset, sampler=ResumableSampler(...), batch_size=..., num_workers=0)`` handed to
  ``spot.track(loader=...)``: the session gives it a generator of its own (see :func:`adopt_data_loader`).

Why a DataLoader needs help. Every new DataLoader iterator draws its base seed from the *global* torch RNG
unless the loader has a ``generator``: after a resume the script builds an iterator mid-epoch that the
uninterrupted run never built, which shifts the global RNG, and so every later dropout mask. With
workers, the sampler's position also runs ahead of training (workers prefetch), so the position saved
must be the number of batches handed to training, not the sampler's. And worker RNGs are seeded from
the base seed when the workers start: a worker restarted mid-epoch draws different augmentations. The
:class:`ResumableLoader` therefore owns its generator, counts the batches it hands out, and in a worker
seeds python's, numpy's and torch's RNGs for each sample from (seed, epoch, position in the epoch), so a
sample's random transform does not depend on which worker fetched it or on what it fetched before.
(In the training process, ``num_workers=0``, a transform draws from the global RNGs, which the session
checkpoints.)

Position protocol for an ``IterableDataset``: ``state_dict()`` returns the position after the items
yielded so far; ``load_state_dict(state)`` moves there; ``iter(dataset)`` continues from the current
position, and a dataset at its end starts its next pass. With ``num_workers=0`` a DataLoader takes
exactly ``batch_size`` items per batch, so the saved position is what training consumed.

Gradient accumulation needs nothing special: the session saves only between steps, so a step of k
micro-batches killed half-way restarts from the previous step's checkpoint, position included; no
micro-batch is counted twice.
"""
from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, get_worker_info

from airflow_spot.training.sampler import ResumableSampler

_MASK63 = (1 << 63) - 1
#: DataLoader arguments the ResumableLoader decides itself
_OWNED_ARGUMENTS = ("sampler", "batch_sampler", "generator", "shuffle", "batch_size", "drop_last", "num_workers")


def has_position(obj: Any) -> bool:
    """Whether ``obj`` follows the position protocol (``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): nearby inputs give unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & _MASK63


def seed_worker_rngs(seed: int) -> None:
    """Seed python's, numpy's (when installed) and torch's RNGs of this process."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % (1 << 32))


class _SeededSamples(Dataset):
    """Map-style wrapper whose keys are ``(index, seed)``: in a worker process the RNGs are seeded with
    ``seed`` before the user's ``__getitem__``; in the training process they are left alone (they are the
    global RNGs the session checkpoints)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        if get_worker_info() is not None:
            seed_worker_rngs(seed)
        return self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


class ResumableLoader:
    """An endless stream of batches (epoch after epoch) from a DataLoader, with a checkpointable position.

    Draw batches with ``next(loader)``; ``loader.epoch`` says which pass over the data they come from.
    Track it like a model: ``spot.track(model=model, optimizer=opt, data=loader)``.

    :param dataset: a map-style dataset (any ``num_workers``) or an ``IterableDataset`` following the
        position protocol of this module (``num_workers=0``).
    :param batch_size: items per batch.
    :param shuffle: a new permutation per epoch from ``seed + epoch`` (map-style datasets only).
    :param seed: seeds the order and the per-sample worker RNGs.
    :param drop_last: drop each epoch's last, incomplete batch.
    :param num_workers: DataLoader worker processes (map-style datasets only).
    :param rank: this process's rank under data parallel training (``torchrun``), with ``num_replicas``:
        each rank takes its own stride of every epoch's order (map-style datasets; an ``IterableDataset``
        shards itself), as :class:`~airflow_spot.training.sampler.ResumableSampler` does.
    :param num_replicas: the number of data parallel ranks.
    :param dataloader_kwargs: passed on to ``DataLoader`` (``collate_fn``, ``pin_memory``, ...), except
        the arguments the loader decides itself (sampler, batch_sampler, generator, ...).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool | None = None,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        rank: int = 0,
        num_replicas: int = 1,
        **dataloader_kwargs: Any,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"ResumableLoader: batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"ResumableLoader: num_workers must be an integer >= 0, got {num_workers!r}")
        owned = sorted(set(dataloader_kwargs) & set(_OWNED_ARGUMENTS))
        if owned:
            raise TypeError(f"ResumableLoader decides {', '.join(owned)} itself: remove "
                            f"{'it' if len(owned) == 1 else 'them'} from the arguments")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_workers = num_workers
        self.dataloader_kwargs = dataloader_kwargs
        self.iterable = isinstance(dataset, IterableDataset)
        if self.iterable:
            if shuffle:
                raise ValueError("ResumableLoader: an IterableDataset decides its own order; drop shuffle=True "
                                 "(shuffle inside the dataset, from a seed it saves in its state_dict)")
            if num_workers:
                raise ValueError(
                    f"ResumableLoader: num_workers={num_workers} with an IterableDataset: each worker iterates "
                    "its own copy of the dataset, so no single position can be saved. Use num_workers=0, or a "
                    "map-style dataset (__getitem__/__len__) with any num_workers"
                )
            if num_replicas != 1:
                raise ValueError("ResumableLoader: rank/num_replicas with an IterableDataset: the dataset shards "
                                 "itself (e.g. by torch.distributed.get_rank()); leave them out")
            self.length = None
        else:
            if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
                raise TypeError(f"ResumableLoader: {type(dataset).__name__} is neither a map-style dataset "
                                "(__getitem__ and __len__) nor an IterableDataset")
            self.length = len(dataset)
            self._order = ResumableSampler(self.length, seed=self.seed, shuffle=True if shuffle is None else shuffle,
                                           rank=rank, num_replicas=num_replicas)
        self.rank, self.num_replicas = rank, num_replicas
        self.epoch = 0
        self.batches = 0  # batches of this epoch handed to training: the position that is saved
        self._iterator: Any = None

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "batches": self.batches, "seed": self.seed,
                                 "batch_size": self.batch_size, "length": self.length,
                                 "num_replicas": self.num_replicas}
        if self.iterable and has_position(self.dataset):
            state["dataset"] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("batch_size", "length", "seed"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"ResumableLoader: the checkpoint was saved with {key}={state.get(key)!r}, this loader has "
                    f"{key}={getattr(self, key)!r}; resuming would feed different batches. Build the loader "
                    "as it was built when the checkpoint was taken"
                )
        if "dataset" in state and has_position(self.dataset):
            self.dataset.load_state_dict(state["dataset"])
        self.epoch, self.batches = int(state["epoch"]), int(state["batches"])
        saved_replicas = int(state.get("num_replicas", 1))
        if saved_replicas != self.num_replicas:  # the batches the saved ranks took, shared among these
            self.batches = min(len(self), self.batches * saved_replicas // self.num_replicas)
        self._iterator = None  # the next batch comes from a DataLoader opened at the restored position

    def resume_warnings(self) -> list[str]:
        """Why a resume of this loader would not be bit-exact (empty when it is)."""
        if self.iterable and not has_position(self.dataset):
            return [f"ResumableLoader over {type(self.dataset).__name__}: the IterableDataset has no "
                    "state_dict/load_state_dict, so after a resume it starts from its beginning and the "
                    "run is not bit-exact (see airflow_spot.training.data for the position protocol)"]
        return []

    # ------------------------------------------------------------------ batches
    def __len__(self) -> int:
        """Batches per epoch (map-style datasets)."""
        if self.length is None:
            raise TypeError("ResumableLoader over an IterableDataset has no length")
        full, rest = divmod(self._order.per_rank, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self) -> Any:
        for _ in range(2):  # the rest of this epoch, then at most one new epoch
            if self._iterator is None:
                self._iterator = self._open()
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                self.epoch, self.batches = self.epoch + 1, 0
                continue
            self.batches += 1
            return batch
        raise RuntimeError(
            f"ResumableLoader: a whole epoch gave no batch (dataset of {self.length} items, batch_size="
            f"{self.batch_size}, drop_last={self.drop_last}): give it more data or a smaller batch_size"
        )

    def _open(self) -> Any:
        # A generator of our own: the iterator's base seed never comes from the global RNG.
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch, self.batches))
        if self.iterable:
            loader = DataLoader(self.dataset, batch_size=self.batch_size, drop_last=self.drop_last,
                                num_workers=0, generator=generator, **self.dataloader_kwargs)
            return iter(loader)
        batches = self._epoch_batches()
        if not batches:
            return iter(())
        loader = DataLoader(_SeededSamples(self.dataset), batch_sampler=batches, num_workers=self.num_workers,
                            generator=generator, **self.dataloader_kwargs)
        return iter(loader)

    def _epoch_batches(self) -> list[list[tuple[int, int]]]:
        """This epoch's batches from the current position on, as ``(index, per-sample seed)`` keys."""
        self._order.epoch = self.epoch
        order = self._order.order()
        out = []
        for b in range(self.batches, len(self)):
            positions = range(b * self.batch_size, min((b + 1) * self.batch_size, len(order)))
            # seeded by the item's place in the whole epoch (the same on any rank that draws it)
            out.append([(order[p], mix_seed(self.seed, self.epoch, p * self.num_replicas + self.rank))
                        for p in positions])
        return out


def find_resumable_sampler(loader: DataLoader) -> ResumableSampler | None:
    """The ResumableSampler that orders a plain DataLoader, if any."""
    sampler = loader.sampler
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, BatchSampler):
        sampler = batch_sampler.sampler
    return sampler if isinstance(sampler, ResumableSampler) else None


def adopt_data_loader(name: str, loader: DataLoader) -> tuple[Any | None, list[str]]:
    """What the session tracks for a plain DataLoader handed to ``track()``, and why a resume of it would
    not be bit-exact.

    A DataLoader over a :class:`ResumableSampler` with ``num_workers=0`` takes its indices as training
    asks for batches, so the sampler's position is the loader's: the sampler is tracked, and a loader
    without a generator gets one (seeded from the sampler's seed) so its iterators stop drawing from the
    global RNG. With workers it prefetches, and the sampler's position runs ahead: refused, with the
    fix. Any other DataLoader cannot be positioned: returned untracked, with a warning.
    """
    sampler = find_resumable_sampler(loader)
    if sampler is not None and loader.num_workers > 0:
        raise ValueError(
            f"track({name}=...): this DataLoader has num_workers={loader.num_workers}; its workers prefetch "
            "batches, so the ResumableSampler's position runs ahead of training and a resume would skip "
            "batches. Use airflow_spot.training.ResumableLoader(dataset, batch_size=..., "
            f"num_workers={loader.num_workers}) and track that instead"
        )
    if sampler is not None:
        if loader.generator is None:
            loader.generator = torch.Generator().manual_seed(mix_seed(sampler.seed, 1))
        return sampler, []
    what = "IterableDataset" if isinstance(loader.dataset, IterableDataset) else type(loader.sampler).__name__
    return None, [
        f"track({name}=...): this DataLoader is ordered by a {what}, whose position cannot be saved: after a "
        "resume it starts a new pass over the data, and its iterators draw seeds from the global RNG, so the "
        "run is not bit-exact. Use ResumableLoader(dataset, batch_size=...) or "
        "DataLoader(dataset, sampler=ResumableSampler(len(dataset), seed=...), num_workers=0)"
    ]


class GeneratorState:
    """Adapts an RNG object (``torch.Generator``, ``numpy.random.Generator``/``RandomState``,
    ``random.Random``) to ``state_dict``/``load_state_dict`` so the session can checkpoint it."""

    def __init__(self, rng: Any) -> None:
        self.rng = rng

    @staticmethod
    def supports(obj: Any) -> bool:
        if isinstance(obj, (torch.Generator, random.Random)):
            return True
        try:
            import numpy as np
        except ImportError:
            return False
        return isinstance(obj, (np.random.Generator, np.random.RandomState))

    def state_dict(self) -> Any:
        rng = self.rng
        if isinstance(rng, torch.Generator):
            return {"torch": rng.get_state()}
        if isinstance(rng, random.Random):
            return {"python": rng.getstate()}
        if hasattr(rng, "bit_generator"):
            return {"numpy_generator": rng.bit_generator.state}
        return {"numpy_random_state": rng.get_state()}

    def load_state_dict(self, state: Any) -> None:
        rng = self.rng
        if "torch" in state:
            rng.set_state(state["torch"])
        elif "python" in state:
            rng.setstate(state["python"])
        elif "numpy_generator" in state:
            rng.bit_generator.state = state["numpy_generator"]
        else:
            rng.set_state(state["numpy_random_state"])
