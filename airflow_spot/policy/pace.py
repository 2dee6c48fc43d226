"""A job's pace and overheads as its own attempts measured them: the inputs of
:func:`airflow_spot.policy.estimate.estimate_remaining`.

:class:`AttemptPace` is what one attempt showed (its ledger row or live heartbeat); :func:`robust_step_seconds`
reads the job's step time from them with warm-ups taken out; :func:`measure_overheads` measures start-up,
preemption tails, gaps between attempts and lost work, falling back to the deployment's prior. Pure maths, no I/O.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

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
