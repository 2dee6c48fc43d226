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
#: share of segment boundaries assumed to move to a fresh instance before the job has crossed one: the
#: operator keeps the running instance for the next segment while its offer stays within the reuse
#: tolerance (operators/segment.py), so a boundary is a warm one unless the job shows otherwise
DEFAULT_NEW_INSTANCE_SHARE = 0.0
#: steps a running attempt's own pace must span to stand alone; a shorter window is pooled with the job's
#: earlier pace, weighted by steps (on a loaded 2-core machine a 30-step window read 0.063 s against 0.038 s)
MIN_PACE_WINDOW_STEPS = 100
#: a running attempt's heartbeat is at most this old when the training steps since it are counted as done
#: (the training session beats every 2 s; an older beat says the process is stalled or gone)
BEAT_AGE_CAP_SECONDS = 4.0


@dataclass(frozen=True)
class AttemptPace:
    """What one attempt of a job showed about its pace (from its ledger row or its live heartbeat).

    :param steps: steps the attempt kept (a finished attempt: its ledger row's ``steps_done``) or has
        trained so far (the running attempt).
    :param step_seconds: the attempt's step-time EWMA at its last heartbeat (None: no heartbeat).
    :param seconds: wall time of the attempt so far (billed start to end, or to now while running).
    :param preempted: the attempt ended in a preemption or a lost instance.
    :param finished: the attempt has ended (False for the running one).
    :param save_fraction: seconds training stalls for saves per second of training (save cost / interval).
    :param new_instance: the attempt started a fresh instance (False: it continued on a warm one).
    :param notice_seconds: seconds from the attempt's start to its preemption notice (None: no notice).
    :param steps_lost: steps the attempt trained past its last checkpoint and lost.
    :param gap_before: seconds from the previous attempt's end to this one's start (scheduling, retry
        delay, launch); None for the job's first attempt.
    :param end_seconds: a completed attempt's time after its last step: the final save and the attempt's
        end (its last heartbeat to its end, plus its save cost); None when unknown.
    :param startup_seconds: the attempt's start to the end of its first training step, as its heartbeat
        records it (None: not trained yet, or not recorded): its start-up, measured rather than inferred.
    :param exit_seconds: a preempted attempt's last heartbeat (after its emergency save) to its end: what
        a training process's exit costs (None when unknown).
    :param pace_seconds: the attempt's mean wall time per step from its first step to its last heartbeat
        (saves included); None when it has not run past its warm-up since its first step. Its warm-up
        steps are in it: see ``steady_seconds``.
    :param pace_steps: the steps ``pace_seconds`` is the mean of (its first step to its last heartbeat).
    :param steady_seconds: the attempt's wall time per step past its warm-up (saves included): from a mark
        of its own past the warm-up (a checkpoint it committed) to its last heartbeat; None when it has
        no such mark.
    :param warmup_seconds: what the attempt's steps from its first one to that mark took beyond the
        steady pace (allocator, caches, a machine still busy with the start): the warm-up's own cost,
        which every fresh start pays again; None when not measured.
    :param steady_steps: the steps ``steady_seconds`` was measured over.
    :param save_seconds: how long the attempt's newest checkpoint took to write: what a save on a notice
        costs (the training waits for it); None when unknown.
    """

    steps: int
    step_seconds: float | None
    seconds: float
    preempted: bool = False
    finished: bool = True
    save_fraction: float = 0.0
    new_instance: bool = True
    notice_seconds: float | None = None
    steps_lost: int = 0
    gap_before: float | None = None
    end_seconds: float | None = None
    startup_seconds: float | None = None
    exit_seconds: float | None = None
    pace_seconds: float | None = None
    pace_steps: int = 0
    steady_seconds: float | None = None
    warmup_seconds: float | None = None
    save_seconds: float | None = None
    steady_steps: int = 0

    @property
    def trained_at_notice(self) -> bool:
        """The process was training when its notice came (it kept or lost steps, its first step came before
        the notice, or it continued a warm process): it saves and leaves. Else it was still starting up and
        may run the notice window out."""
        return (self.steps > 0 or self.steps_lost > 0 or not self.new_instance
                or (self.startup_seconds is not None and self.notice_seconds is not None
                    and self.startup_seconds <= self.notice_seconds))

    @property
    def seconds_per_step(self) -> float | None:
        """The attempt's pace: its steady pace past the warm-up, else its mean since its first step, else
        its step-time EWMA (see :func:`steady_step_seconds` for the mean with the warm-up taken out)."""
        return self.steady_seconds or self.pace_seconds or self.step_seconds


@dataclass(frozen=True)
class JobOverheads:
    """What the job's own attempts measured, in seconds (see :func:`measure_overheads`)."""

    startup: float  # a fresh instance: launch to its first training step (boot, python, restore, warm-up)
    tail: float  # a training attempt's preemption notice to its end (emergency save, exit)
    gap_after_preemption: float  # an attempt's end to the next one's start after a preemption
    gap_after_boundary: float  # the same after a completed segment
    warm_boundary: float  # a segment boundary on a warm instance: gap plus the next attempt's own overhead
    new_instance_share: float  # fraction of completed boundaries that moved to a fresh instance
    lost_per_preemption: float  # training a preemption threw away (steps past the last checkpoint)
    samples: int  # attempts that gave an exact start-up figure
    finish: float = 0.0  # a completed attempt's last step to its end (final save, status, accounting)
    #: the job's last attempt: its process exits (no warm handoff), as a preempted one's does after its save
    last_finish: float = 0.0
    #: a fresh instance preempted in its start-up, before its process trained: notice to its end (a process
    #: not up yet cannot save and leave early: the instance may run out the notice window)
    start_tail: float = 0.0
    #: the fields the job's own attempts gave (the others are the deployment's prior or a default)
    measured: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else list(v) if isinstance(v, tuple) else v)
                for k, v in self.__dict__.items()}

    def measured_fields(self) -> dict[str, float]:
        """Only what the job measured: what it can teach the jobs after it (:data:`PRIOR_FIELDS`)."""
        return {k: float(getattr(self, k)) for k in self.measured if k in PRIOR_FIELDS}


#: overheads a job can take from the jobs of its deployment before it has met them itself: they come from
#: the deployment's machinery (Airflow's hand-off between tasks, the backend's launch, the image's start-up),
#: not from the job's luck. Lost work and a training attempt's preemption tail (its emergency save) depend on
#: the job's own model and checkpoint interval, so they are not among them.
PRIOR_FIELDS = ("startup", "start_tail", "gap_after_preemption", "gap_after_boundary", "warm_boundary",
                "new_instance_share", "finish", "last_finish")


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


def warmup_excess(paces: list[AttemptPace], fresh: bool = True) -> float | None:
    """The median warm-up cost (``warmup_seconds``) over the job's attempts that measured one, of fresh
    instances (``fresh``) or of warm ones (a segment continued by the same process); None if none did."""
    seen = [p.warmup_seconds for p in paces if p.warmup_seconds is not None and p.new_instance == fresh]
    return statistics.median(seen) if seen else None


def steady_step_seconds(p: AttemptPace, excess: float | None) -> float | None:
    """One attempt's pace past its warm-up: measured (``steady_seconds``), else its mean since its first
    step less the job's measured warm-up cost ``excess`` spread over those steps, else that mean or its EWMA.

    A mean since the first step holds the warm-up: on the bench 70 steps of a fresh attempt averaged
    0.05 s while its steady pace was 0.038 s, and every step left of the job was charged the difference.
    """
    if p.steady_seconds:
        return p.steady_seconds
    if p.pace_seconds and excess and p.pace_steps > 0:
        # never below half the mean: an excess measured elsewhere cannot take most of this attempt's time
        return max(p.pace_seconds * p.pace_steps - excess, 0.5 * p.pace_seconds * p.pace_steps) / p.pace_steps
    return p.pace_seconds or p.step_seconds


def robust_step_seconds(paces: list[AttemptPace], warmup_steps: int = WARMUP_STEPS, recent: int = 5) -> float | None:
    """Seconds per training step past the warm-up, robust to the slow steps after a restart.

    An attempt's pace is its steady pace past its warm-up (:func:`steady_step_seconds`: measured from a
    mark of its own past the warm-up, else its mean since its first step less the job's measured warm-up
    cost); an EWMA of single steps is the last resort (it swings with every save stall: on the bench it
    read 0.106 s for an attempt whose 300 steps took 0.050 s each). An attempt's figure only counts once
    it has run more than ``warmup_steps`` steps; of the ``recent`` newest such attempts the median is
    taken, so one slow or fast attempt (a noisy neighbour, a warm cache) does not swing the estimate.
    Falls back to the newest figure when no attempt is past its warm-up yet. A running attempt past its
    warm-up gives the pace itself once its window spans :data:`MIN_PACE_WINDOW_STEPS` steps: the steps
    left run on that process first, at the machine's present speed (a neighbour's load that slowed it
    since the last attempt is not averaged away); a shorter window is pooled with the older attempts'
    pace, weighted by steps.
    """
    if warmup_steps < 0 or recent < 1:
        raise ValueError(f"warmup_steps must be >= 0 and recent >= 1, got {warmup_steps!r}, {recent!r}")
    excess = {True: warmup_excess(paces, True), False: warmup_excess(paces, False)}
    known = [(p, t) for p in paces if (t := steady_step_seconds(p, excess[p.new_instance])) and t > 0]
    warm = [t for p, t in known if p.steps > warmup_steps][-recent:]
    if known and not known[-1][0].finished and known[-1][0].steps > warmup_steps and known[-1][0] is paces[-1]:
        run, pace = known[-1]
        older = [t for p, t in known[:-1] if p.steps > warmup_steps][-recent:]
        if run.steady_seconds and run.steady_steps:
            n = run.steady_steps
        elif not run.steady_seconds and run.pace_seconds and run.pace_steps:
            n = run.pace_steps
        else:
            n = run.steps
        if n >= MIN_PACE_WINDOW_STEPS or not older:
            return pace
        # a short window is noisy: the job's most recent MIN_PACE_WINDOW_STEPS steps, the rest at the older pace
        return (n * pace + (MIN_PACE_WINDOW_STEPS - n) * statistics.median(older)) / MIN_PACE_WINDOW_STEPS
    if not warm:
        return known[-1][1] if known else None
    return statistics.median(warm)


def _median(values: list[float], default: float) -> float:
    return statistics.median(values) if values else default


def measure_overheads(paces: list[AttemptPace], step: float,
                      default_startup: float = DEFAULT_RESTART_OVERHEAD_SECONDS,
                      default_new_instance_share: float = DEFAULT_NEW_INSTANCE_SHARE,
                      default_tail: float = 0.0, default_start_tail: float | None = None,
                      prior: Mapping[str, float] | None = None) -> JobOverheads:
    """The job's own overheads, from its attempts (oldest first).

    What the job has not met yet comes from ``prior`` (what the deployment's earlier jobs measured,
    :mod:`airflow_spot.storage.overhead_history`; keys of :data:`PRIOR_FIELDS`), else from the defaults
    below; ``measured`` names the fields the job's own attempts gave.

    * start-up: a fresh instance's time to the end of its first step, as its heartbeat records it, plus its
      warm-up's cost beyond the steady pace (its own, else the median the job's fresh attempts measured:
      the steady pace charges the steps left nothing for it, so every fresh start pays it here); for an
      attempt without that record, inferred from an attempt that trained (a completed
      one: its time not spent on kept steps; a preempted one: its notice time less its steps; the running
      one: its time so far less its steps), each attempt's steps at its own measured pace. A preempted attempt that never trained only says start-up took
      longer than its notice time: such lower bounds above the exact median join the median (a machine
      that got slower is not hidden by older, faster start-ups). ``default_startup`` before any figure.
    * tail: notice to end of preempted attempts; gaps: end of one attempt to the start of the next.
    * finish: a completed attempt's last step to its end; the job's last attempt also exits its process,
      which costs what a preempted attempt's exit cost (its last heartbeat to its end);
    * tails, apart for attempts that were training at their notice (the process saves and leaves) and
      fresh ones preempted in their start-up (``start_tail``): ``default_tail`` and ``default_start_tail``
      (else ``default_tail``) before the job has seen one of the kind;
    * a warm boundary: the gap after a completed segment plus the next (warm) attempt's own overhead (its
      first step and the warm-up cost warm attempts measured);
      the share of boundaries that moved to a fresh instance (``default_new_instance_share`` before any).
    """
    exact: list[float] = []
    bounds: list[float] = []
    tails, start_tails, gaps_p, gaps_b, warm, lost, moved = [], [], [], [], [], [], []
    ends = [p.end_seconds for p in paces if p.finished and not p.preempted and p.end_seconds is not None]
    finish = _median(ends, 0.0)
    exits = [p.exit_seconds for p in paces if p.finished and p.preempted and p.exit_seconds is not None]
    excess = {True: warmup_excess(paces, True), False: warmup_excess(paces, False)}
    for i, p in enumerate(paces):
        prev = paces[i - 1] if i else None
        # an attempt's steps at its own steady pace (the machine's speed moves)
        own = steady_step_seconds(p, excess[p.new_instance]) or step
        # what its warm-up cost beyond that pace: its own figure, else what the job's attempts of its kind showed
        warmup = p.warmup_seconds if p.warmup_seconds is not None else (excess[p.new_instance] or 0.0)
        # a completed attempt's time after its last step is its finish, not its start-up
        end = (p.end_seconds if p.end_seconds is not None else finish) if p.finished and not p.preempted else 0.0
        if p.new_instance and p.startup_seconds is not None:
            exact.append(max(0.0, p.startup_seconds) + max(0.0, warmup))
        elif p.new_instance:
            if p.preempted and p.finished:
                if p.steps > 0 and p.notice_seconds is not None:
                    exact.append(max(0.0, p.notice_seconds - p.steps * own))
                elif p.steps == 0:
                    bounds.append(p.notice_seconds if p.notice_seconds is not None else p.seconds)
            elif p.steps > 0:
                exact.append(max(0.0, p.seconds - p.steps * own - end))
        if p.preempted and p.finished:
            if p.notice_seconds is not None:
                (tails if p.trained_at_notice else start_tails).append(max(0.0, p.seconds - p.notice_seconds))
            lost.append(p.steps_lost * step)
        if prev is not None and prev.finished and p.gap_before is not None:
            (gaps_p if prev.preempted else gaps_b).append(max(0.0, p.gap_before))
            if not prev.preempted:
                moved.append(1.0 if p.new_instance else 0.0)
                if not p.new_instance and p.startup_seconds is not None:
                    warm.append(max(0.0, p.gap_before) + max(0.0, p.startup_seconds) + max(0.0, warmup))
                elif not p.new_instance and (p.finished or p.steps > 0):
                    warm.append(max(0.0, p.gap_before) + max(0.0, p.seconds - p.steps * own - end)
                                if p.finished else max(0.0, p.gap_before))
    prior = prior or {}
    measured: list[str] = []

    def own(name: str, samples: list[float], fallback: float) -> float:
        """The job's median, else the deployment's figure, else ``fallback``."""
        if samples:
            measured.append(name)
            return statistics.median(samples)
        return float(prior.get(name, fallback))

    default_startup = float(prior.get("startup", default_startup))
    startup = _median(exact, default_startup)
    later = [b for b in bounds if b > startup]
    if later:
        startup = statistics.median(exact + later) if exact else max(default_startup, statistics.median(later))
    if exact:
        measured.append("startup")
    all_gaps = gaps_p + gaps_b
    # a gap of the other kind is the same Airflow hand-off, a little more or less: it beats no figure at all
    gap_p = own("gap_after_preemption", gaps_p, _median(all_gaps, 0.0))
    gap_b = own("gap_after_boundary", gaps_b, _median(all_gaps, 0.0))
    if ends:
        measured.append("finish")
    else:
        finish = float(prior.get("finish", finish))
    last_exit = own("last_finish", exits, float(prior.get("last_finish", 0.0)))
    if moved:  # a share, so the mean of the job's 0/1 boundaries, not their median
        measured.append("new_instance_share")
        share = sum(moved) / len(moved)
    else:
        share = float(prior.get("new_instance_share", default_new_instance_share))
    return JobOverheads(
        startup=startup, tail=own("tail", tails, default_tail), gap_after_preemption=gap_p,
        gap_after_boundary=gap_b, warm_boundary=own("warm_boundary", warm, gap_b),
        new_instance_share=share,
        lost_per_preemption=(sum(lost) / len(lost)) if lost else 0.0, samples=len(exact), finish=finish,
        last_finish=max(finish, last_exit),
        start_tail=own("start_tail", start_tails, default_tail if default_start_tail is None else default_start_tail),
        measured=tuple(measured),
    )


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
