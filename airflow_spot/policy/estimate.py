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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from airflow_spot.policy.offer_ranking import DEFAULT_OVERHEAD_SECONDS
from airflow_spot.policy.offers import Offer
# the job's measured paces and overheads live in pace.py; re-exported for existing imports
from airflow_spot.policy.pace import (  # noqa: F401
    WARMUP_STEPS,
    DEFAULT_RESTART_OVERHEAD_SECONDS,
    DEFAULT_NEW_INSTANCE_SHARE,
    MIN_PACE_WINDOW_STEPS,
    BEAT_AGE_CAP_SECONDS,
    AttemptPace,
    JobOverheads,
    PRIOR_FIELDS,
    warmup_excess,
    steady_step_seconds,
    robust_step_seconds,
    measure_overheads,
)


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
    #: the current attempt's own start-up still to come (or a new attempt's, between attempts)
    current_seconds: float = 0.0
    #: expected seconds one preemption adds (its tail, lost work, and the restart with its own failures)
    per_preemption_seconds: float = 0.0
    overheads: dict | None = None
    #: the spread the pool's luck alone gives the remaining time: preemptions come as a Poisson count, so
    #: about ``sqrt(expected) x per_preemption_seconds`` either side (one standard deviation)
    spread_seconds: float = 0.0
    #: the pool's mean time between preemptions the estimate used (None: on demand)
    mtbf_seconds: float | None = None

    def to_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def start_seconds(startup: float, gap: float, tail: float, mtbf: float | None) -> tuple[float, float]:
    """Expected seconds to get a fresh instance to its first training step, and the preemptions on the way.

    The pool preempts at rate ``1/M`` from the instance's launch (its start-up is exposed too): a start
    survives with probability ``p = exp(-s/M)``; each failed one costs its expected life ``E[L | L < s] =
    M - s p / (1 - p)``, its tail and a gap, and the number of failures before a success is geometric,
    ``(1 - p) / p`` on average. On demand (``M`` None): ``gap + s``.
    """
    if not mtbf:
        return gap + startup, 0.0
    p = math.exp(-startup / mtbf)
    if p >= 1.0:
        return gap + startup, 0.0
    failures = (1 - p) / p
    life = mtbf - startup * p / (1 - p)
    return gap + startup + failures * (life + tail + gap), failures


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
    idle_seconds: float = 0.0,
    notice_window_seconds: float = 0.0,
    beat_age_seconds: float = 0.0,
    prior: Mapping[str, float] | None = None,
) -> RemainingEstimate:
    """Remaining time and cost of a running job, from the job's own measured overheads.

    ``remaining = W + n x (lost + tail + start) + boundaries + the current attempt's start-up still due``:

    * ``W`` = steps left x robust step time (warm-up excluded) x (1 + save stall);
    * ``n = W / (M - lost)`` preemptions while training (rate ``1/M``, the lost work is redone, exposed);
    * ``start`` = the expected time to the first step of a fresh instance, start-ups that are themselves
      preempted included (:func:`start_seconds`);
    * each segment boundary left costs the job's measured finish of an attempt (final save, status) and
      its warm boundary, or a fresh start for the share of boundaries that moved to a new instance; the
      last attempt's finish is added once more;
    * a running attempt that has not trained yet still owes ``s - elapsed`` of its start-up (and, if the
      pool strikes before, a restart); one that has trained but is still in its warm-up (no steady pace of
      its own yet) owes what its start-up and warm-up have not spent yet: ``s + steps x step - elapsed``;
      with no attempt running (``idle_seconds`` since the last one ended), a whole start is due, less the
      gap already waited;
    * a running attempt whose process was told to go (``notice_seconds``) is a preemption under way, not
      one the pool may send: the rest of its tail and a restart are due (in ``current_seconds``, not in
      the expected count);
    * the steps trained since the running attempt's last heartbeat (``beat_age_seconds`` ago, counted up
      to :data:`BEAT_AGE_CAP_SECONDS`) are done: a beat comes every 2 s, and reading it as the present
      overstated every reading by half that on average.

    Preemptions are a renewal count over the time the job is exposed to the pool while it makes progress:
    its training (``W``, the lost work redone) and its fresh start-ups; the overheads the preemptions
    themselves add (tails, restarts) are not time over which more of them are counted, except the
    start-ups, whose own failures :func:`start_seconds` counts.

    All overheads come from :func:`measure_overheads` over ``paces``; ``mtbf_seconds`` is the current
    pool's (None: on demand, no preemption).

    :param paces: the job's attempts, oldest first (the running one last, ``finished=False``).
    :param done_steps: steps done so far (the running attempt's current step).
    :param segments_left: segment boundaries still to cross (each a new attempt).
    :param price_per_hour: price of the current (or next) offer; None leaves the cost unknown.
    :param idle_seconds: seconds since the last attempt ended, when none is running.
    :param notice_window_seconds: the pool's notice window: the tail of a preemption in a start-up before
        the job has seen one, and the most a training attempt's can be (before the job has seen one, that is
        its emergency save: the newest attempt's save cost).
    :param beat_age_seconds: seconds since the running attempt's last heartbeat (the one ``done_steps``
        comes from).
    :param prior: overheads the deployment's earlier jobs measured (:func:`measure_overheads`), used for
        what this job has not met yet (its first segment boundary, its last process's exit, ...).
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
    # before the job has seen a training attempt preempted, its tail is the save it makes on the notice (the
    # newest checkpoint's write time) within the notice window: the process leaves after it, and a window
    # is only what the pool allows (EC2's is 120 s), not what a save takes; its exit is not known yet (a
    # lower bound). One preempted in its start-up may run the window out: its prior is the window
    saves = [p.save_seconds for p in paces if p.save_seconds is not None]
    tail_prior = notice_window_seconds
    if saves:
        tail_prior = min(notice_window_seconds, saves[-1]) if notice_window_seconds > 0 else saves[-1]
    o = measure_overheads(paces, step, default_restart_seconds, default_tail=tail_prior,
                          default_start_tail=notice_window_seconds, prior=prior)
    mtbf = mtbf_seconds or None
    save = [p.save_fraction for p in paces if p.save_fraction > 0][-3:]
    compute = remaining_steps * step * (1 + (sum(save) / len(save) if save else 0.0))
    running = paces[-1] if paces and not paces[-1].finished else None
    if running is not None and running.steps > 0 and beat_age_seconds > 0 and running.notice_seconds is None:
        compute = max(0.0, compute - min(beat_age_seconds, BEAT_AGE_CAP_SECONDS))
    start_p, fails_p = start_seconds(o.startup, o.gap_after_preemption, o.start_tail, mtbf)
    start_b, fails_b = start_seconds(o.startup, o.gap_after_boundary, o.start_tail, mtbf)
    # a segment boundary: the attempt's finish, then the same warm instance or (the job's measured share) a
    # fresh one; the job's last attempt finishes too
    share = o.new_instance_share
    boundaries = (segments_left * ((1 - share) * o.warm_boundary + share * start_b + o.finish)
                  + o.last_finish)
    preemptions = segments_left * share * fails_b
    if mtbf:
        # preemptions while training; the lost work is trained again (and exposed again)
        lost = min(o.lost_per_preemption, mtbf / 2)
        training_hits = compute / (mtbf - lost)
    else:
        training_hits = 0.0
    per_hit = lost + o.tail + start_p if mtbf else 0.0
    # the attempt now under way (or the one about to be launched) may still owe its start-up
    current = current_plain = 0.0
    notice_due = 0.0
    own_startup = o.startup
    if running is not None and running.startup_seconds is not None:
        own_startup = running.startup_seconds + (warmup_excess(paces, True) or 0.0)
    if running is not None and running.notice_seconds is not None:
        # told to go: a preemption under way, no longer the pool's luck: the rest of its tail, then a restart
        tail = o.tail if running.trained_at_notice else o.start_tail
        notice_due = max(0.0, tail - (running.seconds - running.notice_seconds)) + (start_p if mtbf else
                                                                                       o.gap_after_preemption + o.startup)
        current = current_plain = notice_due
    elif running is not None and running.steps == 0 and running.new_instance:
        left = current_plain = max(0.0, o.startup - running.seconds)
        if mtbf and left > 0:
            q = 1 - math.exp(-left / mtbf)  # the pool strikes before the first step
            current = mtbf * q + q * (o.start_tail + start_p)
            preemptions += q * (1 + fails_p)
        else:
            current = left
    elif running is not None and running.new_instance and running.steady_seconds is None:
        # trained, but still in its warm-up: what its start-up and warm-up have not spent yet
        current = current_plain = max(0.0, own_startup + running.steps * step - running.seconds)
    elif running is None and paces:
        last = paces[-1]
        gap_waited = max(0.0, idle_seconds)
        start, fails = (start_p, fails_p) if last.preempted else (start_b, fails_b)
        gap = o.gap_after_preemption if last.preempted else o.gap_after_boundary
        if last.preempted or share > 0:
            current = max(0.0, start - gap_waited)
            current_plain = max(0.0, gap + o.startup - gap_waited)
            preemptions += fails
    preemption_seconds = training_hits * per_hit
    expected = training_hits * (1 + fails_p) + preemptions
    total = compute + boundaries + preemption_seconds + current
    cost = total / 3600.0 * price_per_hour if price_per_hour is not None else None
    basis = (
        f"{remaining_steps} steps x {step:.4f} s/step (steady pace past {warmup_steps} warm-up steps)"
        f" + {segments_left} boundaries and the end ({boundaries:.1f} s, finish {o.finish:.1f} s each)"
        + (f" + {training_hits:.2f} preemptions while training x {per_hit:.1f} s (lost {lost:.1f} + tail "
           f"{o.tail:.1f} + restart {start_p:.1f} s: start-up {o.startup:.1f} s survives the MTBF of "
           f"{mtbf:.0f} s with p={math.exp(-o.startup / mtbf):.2f})" if mtbf
           else " (on-demand: no preemptions expected)")
        + (f" + {notice_due:.1f} s for the preemption under way (notice seen)" if notice_due
           else f" + {current:.1f} s of start-up still due" if current else "")
    )
    borrowed = [k for k in PRIOR_FIELDS if k in (prior or {}) and k not in o.measured]
    if borrowed:
        basis += f"; not met yet, from the deployment's earlier jobs: {', '.join(borrowed)}"
    # what the preemptions add on top of the same work on an instance that is never preempted
    plain = (compute + segments_left * ((1 - share) * o.warm_boundary + share * (o.gap_after_boundary + o.startup)
                                        + o.finish) + o.last_finish)
    per_preemption = (total - plain - current_plain) / expected if expected > 0 else 0.0
    return RemainingEstimate(remaining_steps, step, compute, boundaries, preemption_seconds, expected,
                             total, cost, basis, current_seconds=current, per_preemption_seconds=per_preemption,
                             overheads=o.to_dict(), spread_seconds=math.sqrt(expected) * per_preemption,
                             mtbf_seconds=mtbf)


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
