"""Step-time estimates: an EWMA of measured step times, and a fit of step time across GPU types.

Online, the operators smooth a job's step times with :class:`StepTimeEwma`, and
:func:`estimate_remaining` gives a running job's remaining time and cost. Offline, ``airflow-spot
estimate`` fits ``log t = a - b * log x`` by least squares over the GPU types a job was measured on
(``x`` = the GPU's relative throughput estimate): ``b = 1`` means the job speeds up exactly as the
estimates say, ``b < 1`` that it is partly bound by something else (input pipeline, host). With one
measurement ``b`` is taken as 1. Pure maths, no I/O.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from airflow_spot.policy.offer_ranking import DEFAULT_OVERHEAD_SECONDS
from airflow_spot.policy.offers import Offer


@dataclass
class StepTimeEwma:
    """Exponentially weighted mean of step times; ``alpha`` is the weight of the newest sample."""

    alpha: float = 0.1
    value: float | None = None
    samples: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")

    def update(self, seconds: float) -> float:
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"step time must be a finite number >= 0, got {seconds!r}")
        self.value = seconds if self.value is None else self.alpha * seconds + (1 - self.alpha) * self.value
        self.samples += 1
        return self.value


@dataclass(frozen=True)
class StepTimeModel:
    """``t(x) = exp(a) * x ** -b`` seconds per step on an instance of relative throughput ``x``."""

    a: float
    b: float

    def step_seconds(self, relative_throughput: float) -> float:
        if relative_throughput <= 0:
            raise ValueError(f"relative_throughput must be > 0, got {relative_throughput!r}")
        return math.exp(self.a) * relative_throughput ** (-self.b)


def fit_step_time(measured: Mapping[float, float]) -> StepTimeModel:
    """Least squares of ``log t`` on ``log x`` over ``{relative throughput: seconds per step}``.

    :raises ValueError: with no measurement, or a non-positive value.
    """
    if not measured:
        raise ValueError("need at least one measured step time (relative throughput -> seconds)")
    pts = []
    for x, t in measured.items():
        if not (x > 0 and t > 0):
            raise ValueError(f"throughput and step time must be positive, got {x!r} -> {t!r}")
        pts.append((math.log(x), math.log(t)))
    xs = [p[0] for p in pts]
    if len(pts) == 1 or max(xs) - min(xs) < 1e-12:
        b = 1.0
    else:
        mx, my = sum(xs) / len(xs), sum(p[1] for p in pts) / len(pts)
        b = -sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
    a = sum(y + b * x for x, y in pts) / len(pts)
    return StepTimeModel(a=a, b=b)


# ---------------------------------------------------------------------------------------- online
#: steps after a (re)start whose times are excluded: restore, allocator and kernel warm-up make them slow
WARMUP_STEPS = 20
#: restart overhead assumed before the job has shown one (boot + restore + warm-up)
DEFAULT_RESTART_OVERHEAD_SECONDS = 60.0


@dataclass(frozen=True)
class AttemptPace:
    """What one attempt of a job showed about its pace (from its ledger row or its live heartbeat).

    :param steps: steps the attempt kept (a finished attempt: its ledger row's ``steps_done``, so the
        steps a preemption lost count as overhead) or has trained so far (the running attempt).
    :param step_seconds: the attempt's step-time EWMA at its last heartbeat (None: no heartbeat).
    :param seconds: wall time of the attempt so far (billed start to end, or to now while running).
    :param preempted: the attempt ended in a preemption or a lost instance.
    :param finished: the attempt has ended (False for the running one).
    :param save_fraction: seconds training stalls for saves per second of training (save cost / interval).
    :param new_instance: the attempt started a fresh instance (False: it continued on a warm one).
    """

    steps: int
    step_seconds: float | None
    seconds: float
    preempted: bool = False
    finished: bool = True
    save_fraction: float = 0.0
    new_instance: bool = True


@dataclass(frozen=True)
class RemainingEstimate:
    """Online estimate of what is left of a job. Times in seconds, cost in dollars."""

    remaining_steps: int
    step_seconds: float | None
    compute_seconds: float | None
    boundary_seconds: float
    preemption_seconds: float
    expected_preemptions: float
    remaining_seconds: float | None
    remaining_cost: float | None
    basis: str

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def robust_step_seconds(paces: list[AttemptPace], warmup_steps: int = WARMUP_STEPS, recent: int = 5) -> float | None:
    """Seconds per training step, robust to the slow steps after a restart.

    An attempt's EWMA only counts once it has run more than ``warmup_steps`` steps (before that the
    warm-up dominates it); of the ``recent`` newest such attempts the median is taken, so one slow or
    fast attempt (a noisy neighbour, a warm cache) does not swing the estimate. Falls back to the newest
    EWMA when no attempt is past its warm-up yet.
    """
    if warmup_steps < 0 or recent < 1:
        raise ValueError(f"warmup_steps must be >= 0 and recent >= 1, got {warmup_steps!r}, {recent!r}")
    known = [p for p in paces if p.step_seconds and p.step_seconds > 0]
    warm = [p.step_seconds for p in known if p.steps > warmup_steps][-recent:]
    if not warm:
        return known[-1].step_seconds if known else None
    warm = sorted(warm)
    mid = len(warm) // 2
    return warm[mid] if len(warm) % 2 else (warm[mid - 1] + warm[mid]) / 2


def _overhead(p: AttemptPace, step_seconds: float) -> float:
    """Wall time of an attempt not spent on its steps: boot, restore, warm-up, saves, lost work, gaps."""
    return max(0.0, p.seconds - p.steps * step_seconds)


def estimate_remaining(
    paces: list[AttemptPace],
    *,
    done_steps: int,
    total_steps: int,
    segments_left: int,
    mtbf_seconds: float | None,
    price_per_hour: float | None,
    warmup_steps: int = WARMUP_STEPS,
    default_restart_seconds: float = DEFAULT_RESTART_OVERHEAD_SECONDS,
) -> RemainingEstimate:
    """Remaining time and cost of a running job.

    ``remaining = steps left x step time x (1 + save stall) + segment boundaries left x the job's measured
    boundary overhead + expected preemptions x the job's measured cost of one preemption``, with
    ``expected preemptions = time left on spot / MTBF`` of the current pool. Overheads are means over the
    job's own finished attempts (a preempted attempt's overhead is its start plus its lost steps and
    notice window); a fresh start costs what the job's new-instance attempts spent outside training (the
    running one's start-up counts once it trains); before any is seen, ``default_restart_seconds``.

    :param paces: the job's attempts, oldest first (the running one last, ``finished=False``).
    :param done_steps: steps done so far (the running attempt's current step).
    :param segments_left: segment boundaries still to cross (each a new attempt).
    :param mtbf_seconds: mean time between preemptions of the current pool; None for on-demand.
    :param price_per_hour: price of the current (or next) offer; None leaves the cost unknown.
    """
    if total_steps <= 0 or done_steps < 0 or segments_left < 0:
        raise ValueError(
            "need total_steps > 0, done_steps >= 0, segments_left >= 0; "
            f"got {total_steps}, {done_steps}, {segments_left}"
        )
    if mtbf_seconds is not None and mtbf_seconds <= 0:
        raise ValueError(f"mtbf_seconds must be positive or None, got {mtbf_seconds!r}")
    remaining_steps = max(0, total_steps - done_steps)
    step = robust_step_seconds(paces, warmup_steps)
    if step is None:
        return RemainingEstimate(remaining_steps, None, None, 0.0, 0.0, 0.0, None, None,
                                 "no step time measured yet")
    if remaining_steps == 0:
        return RemainingEstimate(0, step, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "all steps done")
    save = [p.save_fraction for p in paces if p.save_fraction > 0][-3:]
    compute = remaining_steps * step * (1 + (sum(save) / len(save) if save else 0.0))
    finished = [p for p in paces if p.finished]
    # what a fresh start costs: the overhead of new-instance attempts that were not cut short, or of the
    # running one once it trains (boot, restore and warm-up so far); a preset only before either exists
    starts = [_overhead(p, step) for p in paces if p.new_instance and not p.preempted and (p.finished or p.steps)]
    restart = statistics.median(starts) if starts else default_restart_seconds
    clean = [_overhead(p, step) for p in finished if not p.preempted]
    boundary = sum(clean) / len(clean) if clean else restart
    # a preempted attempt's overhead is its own start plus its lost steps and notice window: in expectation
    # what one preemption adds (the next attempt's start replaces this one's)
    hit = [_overhead(p, step) for p in finished if p.preempted]
    per_preemption = sum(hit) / len(hit) if hit else restart
    boundaries = segments_left * boundary
    expected = 0.0
    if mtbf_seconds:
        # Preemptions also strike the time they add (a geometric series: T / (M - o)). The inflation is
        # capped at 2x: when a preemption costs more than half the MTBF, how uncertain the rate is dominates
        # and the uncapped series (unbounded as o -> M) would swing the estimate by multiples.
        expected = (compute + boundaries) / max(mtbf_seconds - per_preemption, mtbf_seconds / 2)
    total = compute + boundaries + expected * per_preemption
    cost = total / 3600.0 * price_per_hour if price_per_hour is not None else None
    basis = (
        f"{remaining_steps} steps x {step:.4f} s/step (median EWMA past {warmup_steps} warm-up steps)"
        f" + {segments_left} boundaries x {boundary:.1f} s"
        + (f" + {expected:.2f} expected preemptions x {per_preemption:.1f} s (MTBF {mtbf_seconds:.0f} s)"
           if mtbf_seconds else " (on-demand: no preemptions expected)")
    )
    return RemainingEstimate(remaining_steps, step, compute, boundaries, expected * per_preemption, expected,
                             total, cost, basis)


# ---------------------------------------------------------------------------------------- offline
#: relative error of the catalog's throughput priors (market/throughput.py gives ranges of about +-10-25 %
#: around each figure) when a step time measured on one GPU model is scaled to another
PRIOR_RELATIVE_ERROR = 0.25


@dataclass(frozen=True)
class OfferEstimate:
    """Time and cost of ``steps`` steps on one offer, with a relative uncertainty on both."""

    offer: Offer
    step_seconds: float
    hours: float
    expected_cost: float
    uncertainty: float

    def to_dict(self) -> dict:
        return {**self.offer.to_dict(), "step_seconds": round(self.step_seconds, 6), "hours": round(self.hours, 6),
                "expected_cost": round(self.expected_cost, 6), "uncertainty": round(self.uncertainty, 4)}


def rank_offers_for_job(
    offers: Sequence[Offer],
    steps: int,
    model: StepTimeModel,
    measured_throughputs: Sequence[float] = (),
    *,
    overhead_seconds: float = DEFAULT_OVERHEAD_SECONDS,
    profile_error: float = 0.05,
) -> list[OfferEstimate]:
    """Rank offers by the expected cost of ``steps`` steps, cheapest first.

    Time on an offer is ``steps x model.step_seconds(its relative throughput)``; cost is that time at its
    price, inflated by its preemption rate times ``overhead_seconds`` per preemption (as the offer ranking
    does). Uncertainty: ``profile_error`` (the profiling run's own noise) on a GPU model that was measured,
    combined with :data:`PRIOR_RELATIVE_ERROR` on one reached through the catalog's throughput figures.

    :param measured_throughputs: relative throughputs of the GPU models the profile was measured on.
    """
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps!r}")
    if not 0 <= profile_error < 1:
        raise ValueError(f"profile_error must be in [0, 1), got {profile_error!r}")
    measured = list(measured_throughputs)
    out = []
    for o in offers:
        t = model.step_seconds(o.relative_throughput)
        hours = steps * t / 3600.0
        cost = hours * o.price_per_hour * (1 + o.preemption_rate_per_hour * overhead_seconds / 3600.0)
        exact = any(abs(o.relative_throughput - x) < 1e-9 for x in measured)
        err = profile_error if exact else math.hypot(profile_error, PRIOR_RELATIVE_ERROR)
        out.append(OfferEstimate(o, t, hours, cost, err))
    return sorted(out, key=lambda e: (e.expected_cost, e.offer.instance_type, e.offer.zone))
