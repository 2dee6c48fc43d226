"""What running outside the checkpoint store's region costs: restoring across regions, and saving back.

The offer plan, the replay and the hindsight optimum all price it the same way
(:class:`~airflow_spot.policy.decision.DecisionParams` ``transfer_seconds`` / ``transfer_dollars`` /
``remote_dollars_per_hour``), from figures given flat or derived from the checkpoint's size:

* a new instance there restores the checkpoint out of the store's region: one inter-region transfer,
  billed per GiB, and ``seconds_per_gib`` of start-up per GiB;
* while it runs, every checkpoint it commits (at each segment boundary, and in the notice) is written back
  into the store's region: one transfer per save, priced per hour of running there from the number of
  saves an hour (the segment boundaries; periodic saves inside a segment are not counted). Saves upload
  while training goes on, so they cost money, not time.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = float(1 << 30)


@dataclass(frozen=True)
class TransferCost:
    """The price of running outside the store's region: per new instance there (``seconds``, ``dollars``) and
    per hour it runs there (``dollars_per_hour``)."""

    seconds: float = 0.0
    dollars: float = 0.0
    dollars_per_hour: float = 0.0


def transfer_cost(checkpoint_bytes: float | None, *, seconds: float = 0.0, dollars: float = 0.0,
                  seconds_per_gib: float = 0.0, dollars_per_gib: float = 0.0,
                  saves_per_hour: float = 0.0) -> TransferCost:
    """The flat part of a move (``seconds``, ``dollars``: what any move costs whatever its size) plus the part
    that grows with the checkpoint: ``seconds_per_gib`` of restore and ``dollars_per_gib`` of transfer (e.g.
    AWS's inter-region rate) for each GiB restored, and the same rate for each GiB saved back,
    ``saves_per_hour`` times an hour. No checkpoint yet (None) means nothing to restore or save yet: only the
    flat part, until the first save tells the size.

    :raises ValueError: on a negative or non-number input, naming it.
    """
    values = {"seconds": seconds, "dollars": dollars, "seconds_per_gib": seconds_per_gib,
              "dollars_per_gib": dollars_per_gib, "saves_per_hour": saves_per_hour,
              "checkpoint_bytes": checkpoint_bytes or 0.0}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"transfer cost: {name} must be a number >= 0, got {value!r}")
    gib = (checkpoint_bytes or 0.0) / GIB
    return TransferCost(seconds=seconds + gib * seconds_per_gib, dollars=dollars + gib * dollars_per_gib,
                        dollars_per_hour=saves_per_hour * gib * dollars_per_gib)


def saves_per_hour(segment_steps: int, step_seconds: float | None) -> float:
    """Segment boundaries an hour at the measured step time (each commits a checkpoint); 0 before the job's
    speed is known."""
    if not step_seconds or step_seconds <= 0 or segment_steps <= 0:
        return 0.0
    return 3600.0 / (segment_steps * step_seconds)


__all__ = ["GIB", "TransferCost", "saves_per_hour", "transfer_cost"]
