"""How often to checkpoint: Young (1974) and Daly (2006) from the save cost and the time between failures.

``interval = sqrt(2 C M)`` (Young) or Daly's higher-order refinement
``sqrt(2 C M) * (1 + sqrt(C / (2 M)) / 3 + C / (18 M)) - C`` for ``C < 2 M`` (else ``M``), where ``C`` is the
cost of one save (what training stalls for) and ``M`` the mean time between preemptions of the pool.
``M`` is estimated from a prior (market data) blended with what this job observed, so the interval
follows the market as it changes.

A periodic save only insures the work a preemption would otherwise lose. When the cloud's notice reaches
the training process and its emergency save commits inside the notice window, the preemption loses
nothing, so ``M`` above is the mean time between preemptions that *lose work*: the mean time between
preemptions over ``1 - q``, where ``q`` is the chance a notice covers one (:func:`estimate_notice_coverage`:
a prior blended with what the job's own preemptions showed, and 0 when the emergency save does not fit
the window). With ``q = 0`` this is Young/Daly as they stand.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from airflow_spot.policy.registry import PolicyRegistry

checkpoint_interval_policies = PolicyRegistry("checkpoint-interval")


def young_interval(save_cost: float, mtbf: float) -> float:
    """Young's first-order optimum ``sqrt(2 C M)`` (same unit as the inputs)."""
    _check_positive(save_cost=save_cost, mtbf=mtbf)
    return math.sqrt(2.0 * save_cost * mtbf)


def daly_interval(save_cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum (Daly 2006, eq. 37); falls back to ``M`` when ``C >= 2M``."""
    _check_positive(save_cost=save_cost, mtbf=mtbf)
    c, m = save_cost, mtbf
    if c >= 2.0 * m:
        return m
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(c / (2.0 * m)) / 3.0 + c / (18.0 * m)) - c


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")


def estimate_mtbf(
    prior_mtbf: float, observed_preemptions: int, observed_seconds: float, prior_weight: float = 1.0
) -> float:
    """Mean time between preemptions: a Gamma-prior estimate of the preemption rate.

    The prior counts as ``prior_weight`` preemptions seen over ``prior_weight * prior_mtbf`` seconds, so a
    job with no history uses the market's figure and one that keeps being preempted moves towards what it
    sees: ``M = (w * M0 + T) / (w + n)``.
    """
    _check_positive(prior_mtbf=prior_mtbf, prior_weight=prior_weight)
    if observed_preemptions < 0 or observed_seconds < 0:
        raise ValueError("observed preemptions and seconds must be >= 0")
    return (prior_weight * prior_mtbf + observed_seconds) / (prior_weight + observed_preemptions)


#: chance that a preemption's notice reaches the training process and its emergency save commits inside
#: the window, before the job has seen its own preemptions: AWS sends its two-minute notice before a spot
#: interruption and documents interruptions without one as rare
PRIOR_NOTICE_COVERAGE = 0.99
#: the prior counts as this many preemptions: one miss among a job's first preemptions takes it to 0.83
PRIOR_NOTICE_WEIGHT = 5.0
#: coverage is never taken as certain: a notice can always be missed (the instance fails, the host dies)
MAX_NOTICE_COVERAGE = 0.999


def estimate_notice_coverage(covered: int, missed: int, *, fits: bool = True,
                             prior: float = PRIOR_NOTICE_COVERAGE, weight: float = PRIOR_NOTICE_WEIGHT) -> float:
    """Chance that the next preemption's notice saves all the work: ``(w q0 + covered) / (w + covered +
    missed)`` (a Beta prior worth ``w`` preemptions), or 0 when the emergency save does not ``fit`` the
    notice window (it cannot commit in time, so every preemption loses what the periodic saves left).

    ``covered``: the job's preemptions whose notice reached the process and lost no step; ``missed``:
    those that lost steps or came without a notice (see :func:`airflow_spot.policy.ledger.notice_evidence`).
    """
    if covered < 0 or missed < 0:
        raise ValueError(f"covered and missed must be >= 0, got {covered!r}, {missed!r}")
    if not 0 <= prior <= 1 or weight < 0:
        raise ValueError(f"need 0 <= prior <= 1 and weight >= 0, got {prior!r}, {weight!r}")
    if not fits:
        return 0.0
    seen = weight + covered + missed
    return (weight * prior + covered) / seen if seen else prior


@dataclass(frozen=True)
class IntervalInputs:
    save_cost_seconds: float
    mtbf_seconds: float
    min_interval_seconds: float = 10.0
    max_interval_seconds: float = 3600.0
    #: the last background write took this long; saving more often than that only queues writes
    write_seconds: float = 0.0
    #: chance a preemption's notice lets the emergency save keep all the work (:func:`estimate_notice_coverage`)
    notice_coverage: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.notice_coverage <= 1:
            raise ValueError(f"notice_coverage must be in [0, 1], got {self.notice_coverage!r}")

    @property
    def loss_mtbf_seconds(self) -> float:
        """Mean time between preemptions that lose work: those the notice does not cover."""
        return self.mtbf_seconds / (1.0 - min(self.notice_coverage, MAX_NOTICE_COVERAGE))


def _clamp(value: float, inp: IntervalInputs) -> float:
    lo = max(inp.min_interval_seconds, inp.write_seconds)
    return min(max(value, lo), max(inp.max_interval_seconds, lo))


@checkpoint_interval_policies.register("daly", default=True)
def daly_policy(inp: IntervalInputs) -> float:
    """Daly's interval, clamped to [floor, ceiling] and never shorter than one background write."""
    if inp.save_cost_seconds <= 0:
        return _clamp(inp.min_interval_seconds, inp)
    return _clamp(daly_interval(inp.save_cost_seconds, inp.loss_mtbf_seconds), inp)


@checkpoint_interval_policies.register("young")
def young_policy(inp: IntervalInputs) -> float:
    if inp.save_cost_seconds <= 0:
        return _clamp(inp.min_interval_seconds, inp)
    return _clamp(young_interval(inp.save_cost_seconds, inp.loss_mtbf_seconds), inp)


@checkpoint_interval_policies.register("fixed")
def fixed_policy(inp: IntervalInputs) -> float:
    """Always the floor: a constant interval, the baseline the others are compared with."""
    return inp.min_interval_seconds


def checkpoint_interval(inp: IntervalInputs, policy: str | None = None) -> float:
    return checkpoint_interval_policies.get(policy)(inp)
