"""What an attempt outside the checkpoint store's region pays to restore and save across regions.

One figure per new instance outside the store's region, as the offer plan, the replay and the hindsight
optimum all price it (:class:`~airflow_spot.policy.decision.DecisionParams` ``transfer_seconds`` /
``transfer_dollars``). It is either given flat or derived from the checkpoint's size:

* money: the restore reads the checkpoint out of the store's region and the attempt's saves write it back
  into it, each an inter-region transfer billed per GiB. At least one save is made by every attempt that
  makes progress (at the segment's end or in the notice), so a GiB of checkpoint costs two GiB of transfer;
  further periodic saves of a long attempt are not counted.
* time: only the restore delays the start; saves upload while training goes on.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = float(1 << 30)
#: inter-region transfers per attempt for each byte of checkpoint: the restore and one save back
TRANSFERS_PER_ATTEMPT = 2


@dataclass(frozen=True)
class TransferCost:
    """The price of one attempt outside the store's region."""

    seconds: float = 0.0
    dollars: float = 0.0


def transfer_cost(checkpoint_bytes: float | None, *, seconds: float = 0.0, dollars: float = 0.0,
                  seconds_per_gib: float = 0.0, dollars_per_gib: float = 0.0) -> TransferCost:
    """The flat part (``seconds``, ``dollars``: what any move costs whatever its size) plus the part that grows
    with the checkpoint: ``seconds_per_gib`` of restore and ``dollars_per_gib`` of transfer (e.g. AWS's
    inter-region rate) for each GiB, two transfers a GiB. No checkpoint yet (None) means nothing to restore:
    only the flat part, until the first save tells the size.

    :raises ValueError: on a negative or non-number input, naming it.
    """
    values = {"seconds": seconds, "dollars": dollars, "seconds_per_gib": seconds_per_gib,
              "dollars_per_gib": dollars_per_gib, "checkpoint_bytes": checkpoint_bytes or 0.0}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"transfer cost: {name} must be a number >= 0, got {value!r}")
    gib = (checkpoint_bytes or 0.0) / GIB
    return TransferCost(seconds=seconds + gib * seconds_per_gib,
                        dollars=dollars + TRANSFERS_PER_ATTEMPT * gib * dollars_per_gib)


__all__ = ["GIB", "TRANSFERS_PER_ATTEMPT", "TransferCost", "transfer_cost"]
