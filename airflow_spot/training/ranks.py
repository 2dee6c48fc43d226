"""The processes of one attempt when the training command is data parallel (``torchrun``, DDP).

Under ``torchrun`` every rank runs the training script, and so builds its own ``SpotSession``. Data parallel
ranks hold the same model and optimizer state, so one checkpoint serves them all: rank 0 writes it (and the
heartbeats), every rank restores from it. What the ranks must agree on is *when*: a preemption notice may
reach one rank a step before another, and a rank that leaves the loop for its emergency save while the
others enter the next step's all-reduce deadlocks the job until the kill. So once a step, between steps,
the ranks agree on a few flags (notice, saves due, the writer busy) with one all-reduce, and act on the
agreed values only.

That all-reduce runs on a gloo group of its own, on CPU tensors: on the job's NCCL group it would put a
device synchronisation into every step.
"""
from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("airflow_spot.session")

#: what ``torchrun`` sets in each rank's environment
WORLD_SIZE_ENV = "WORLD_SIZE"


class Ranks:
    """This process's place among the attempt's ranks, and the collectives the session needs."""

    def __init__(self, rank: int, world_size: int, group: Any = None) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group

    @property
    def writer(self) -> bool:
        """Rank 0 writes checkpoints and heartbeats for the attempt."""
        return self.rank == 0

    @classmethod
    def detect(cls) -> Ranks | None:
        """The ranks of this process's job, or None for a single process.

        :raises RuntimeError: when ``WORLD_SIZE`` says this is one of several processes but
            ``torch.distributed`` is not initialised: each rank would save on its own schedule.
        """
        try:
            world = int(os.environ.get(WORLD_SIZE_ENV) or 1)
        except ValueError:
            raise ValueError(f"{WORLD_SIZE_ENV}={os.environ[WORLD_SIZE_ENV]!r} is not a number of processes") from None
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
        if not initialised:
            if world > 1:
                raise RuntimeError(
                    f"{WORLD_SIZE_ENV}={world}: this process is one of {world} ranks (torchrun), but "
                    "torch.distributed is not initialised. Call torch.distributed.init_process_group() before "
                    "SpotSession.from_env(...), so the ranks agree on when to save and stop"
                )
            return None
        if dist.get_world_size() == 1:
            return None
        # A CPU group of its own for the per-step agreement (the default group may be NCCL); every rank
        # builds its session, so every rank takes part in creating it, as new_group requires.
        group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        return cls(dist.get_rank(), dist.get_world_size(), group)

    # ------------------------------------------------------------------ collectives
    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag true on any rank is true on every rank (one all-reduce of ``len(flags)`` bytes)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.uint8)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(bool(v) for v in t.tolist())

    def from_writer(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def to_writer(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0; None on the others."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.writer else None
        dist.gather_object(obj, out, dst=self._global(0), group=self.group)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist

        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)
