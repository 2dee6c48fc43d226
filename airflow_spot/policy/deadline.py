"""Spot or on-demand under a deadline: Uniform Progress (Wu et al., NSDI'24 "Can't Be Late").

The plan is the straight line from (job start, 0) to (deadline - restart overhead, all work): keeping
progress on or above it finishes in time with one restart to spare. The rule, evaluated whenever
something changes (a preemption, spot capacity coming back, a segment boundary):

* on spot and still running: stay (a running spot instance makes progress at full speed, cheaply);
* spot available and not on spot: take it, unless the job is on on-demand and not yet ``hysteresis``
  ahead of the line (each switch pays a restart, so switching back and forth is worse than either);
* no spot: run on-demand while progress is behind the line (or less than ``hysteresis`` ahead of it
  when already on on-demand); otherwise wait for spot, paying nothing;
* safety net: when the slack left (time to the deadline minus the work left) can absorb no more than
  ``safety_restarts`` restarts, go to on-demand and stay there until the end.

Without a deadline: spot only (wait when no spot is available).

``slack-reserve`` is the same rule measured in slack instead of against the line: keep
``reserve_per_work`` seconds of slack per second of work left (plus the safety net's restarts) and
spend the rest waiting for spot.

``slack-budget`` (the default, see :func:`slack_budget`) prices the two uses of slack separately —
waiting out an outage and paying the restarts of spot runs — stays on on-demand through an outage once
it has paid to start it, and leaves on-demand only for a pool that has been up long enough to be likely
to stay up. On the measured traces it is the cheapest of the three (``benchmarks/results_simulate.md``).
It needs the pool's age to be worth it: :func:`choose_market` uses ``slack-reserve`` when the caller
cannot give one, and the line when it has no measured step time (no absolute work figure).

Work is measured in seconds of training at the job's current speed (``steps * step_seconds``). Pure: the
state, the observation and the time are passed in; the decision carries the next state.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from airflow_spot.policy.offer_ranking import risk_multiplier
from airflow_spot.policy.offers import Market
from airflow_spot.policy.registry import PolicyRegistry

deadline_policies = PolicyRegistry("deadline")

#: "no instance": wait for spot capacity, paying nothing
WAIT = "wait"


@dataclass(frozen=True)
class DeadlineParams:
    """:param restart_overhead_seconds: paid time without progress when an instance (re)starts.
    :param hysteresis_seconds: how far ahead of the line the job must be to leave on-demand.
    :param safety_restarts: restarts the remaining slack must still absorb before the safety net
        commits the job to on-demand.
    :param reserve_per_work: ``slack-reserve`` only: seconds of slack kept per second of work left.
    :param wait_reserve_per_work: ``slack-budget``: slack kept per second of work left before the job
        may wait (idle) for spot instead of starting on-demand.
    :param spot_reserve_per_work: ``slack-budget``: slack kept per second of work left, on top of the
        floor and the switch's own restart, before leaving on-demand for spot (future preemptions' restarts).
    :param floor_restarts: ``slack-budget``: the hard floor in restarts; at or below it the job commits
        to on-demand. Above 1 so a spot instance preempted at the floor can still restart on-demand.
    :param spot_reserve_age_seconds: ``slack-budget``: None (the reserve is ``spot_reserve_per_work``
        whatever the pool), or the reserve scales with the pool's preemption hazard given how long it has
        been up (``spot_up_seconds``, decreasing): ``spot_reserve_per_work * (1 + c / (age + c / 4))`` with
        ``c`` this many seconds (:func:`airflow_spot.policy.offer_ranking.risk_multiplier`): a pool up for
        hours is expected to preempt less, so leaving on-demand for it keeps less slack for restarts.
    :param min_spot_up_seconds: ``slack-budget``: leave on-demand only for a pool that has been up this
        long (a pool that just came back tends to go again soon).
    :param outage_grace_seconds: ``slack-budget``: an idle job without waiting budget still waits this
        long into an outage (``no_spot_seconds``) before paying an on-demand start it would then keep.
    :param last_shot_up_seconds: ``slack-budget``: None, or a job on on-demand whose slack cannot pay the
        reserve for future preemptions still leaves for a pool up this long, when the slack pays the
        switch's restart and the floor (a preemption then sends it back to on-demand at the floor)."""

    restart_overhead_seconds: float = 600.0
    hysteresis_seconds: float | None = None
    safety_restarts: float = 2.0
    reserve_per_work: float = 0.06
    wait_reserve_per_work: float = 0.10
    spot_reserve_per_work: float = 0.03
    spot_reserve_age_seconds: float | None = None
    floor_restarts: float = 1.5
    min_spot_up_seconds: float = 0.75 * 3600.0
    outage_grace_seconds: float = 60.0
    last_shot_up_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.restart_overhead_seconds < 0:
            raise ValueError(f"restart_overhead_seconds must be >= 0, got {self.restart_overhead_seconds!r}")
        if self.hysteresis_seconds is not None and self.hysteresis_seconds < 0:
            raise ValueError(f"hysteresis_seconds must be >= 0, got {self.hysteresis_seconds!r}")
        if self.reserve_per_work < 0:
            raise ValueError(f"reserve_per_work must be >= 0, got {self.reserve_per_work!r}")
        if self.safety_restarts < 0:
            raise ValueError(f"safety_restarts must be >= 0, got {self.safety_restarts!r}")
        if self.last_shot_up_seconds is not None and self.last_shot_up_seconds < 0:
            raise ValueError(f"last_shot_up_seconds must be >= 0 or None, got {self.last_shot_up_seconds!r}")
        if self.spot_reserve_age_seconds is not None and self.spot_reserve_age_seconds <= 0:
            raise ValueError(f"spot_reserve_age_seconds must be > 0 or None, got {self.spot_reserve_age_seconds!r}")
        for name in ("wait_reserve_per_work", "spot_reserve_per_work", "floor_restarts", "min_spot_up_seconds",
                     "outage_grace_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def hysteresis(self) -> float:
        return 2.0 * self.restart_overhead_seconds if self.hysteresis_seconds is None else self.hysteresis_seconds


@dataclass(frozen=True)
class DeadlineState:
    """What the policy remembers between calls. ``committed``: the safety net fired; on-demand to the end."""

    committed: bool = False


@dataclass(frozen=True)
class Observation:
    """:param started_at: when the job started (seconds, the same clock as ``now``).
    :param deadline_at: when the job must be done, or None for no deadline.
    :param work_done: seconds of work done (committed progress).
    :param work_total: seconds of work of the whole job.
    :param spot_available: some suitable spot offer can be launched (or is running) now.
    :param running: what the job runs on now: ``spot``, ``on-demand`` or None.
    :param spot_up_seconds: how long the best available spot pool has been up (capacity seen without
        a loss), or None when unknown (``slack-budget`` then does not wait for a pool to settle).
    :param no_spot_seconds: how long no spot offer has been available, or None when unknown (no grace).
    :param expected_outage_seconds: ``slack-budget``: how long an outage is expected to last (observed,
        :func:`airflow_spot.policy.observations.expected_outage_seconds`), or None (then only the
        fixed waiting reserve decides)."""

    started_at: float
    deadline_at: float | None
    work_done: float
    work_total: float
    spot_available: bool = True
    running: Market | str | None = None
    spot_up_seconds: float | None = None
    no_spot_seconds: float | None = None
    expected_outage_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.work_total <= 0:
            raise ValueError(f"work_total must be positive, got {self.work_total!r}")
        if self.deadline_at is not None and self.deadline_at <= self.started_at:
            raise ValueError("deadline_at must be after started_at")


@dataclass(frozen=True)
class Decision:
    """``market``: ``spot``, ``on-demand`` or ``wait``; ``state``: pass it to the next call."""

    market: str
    reason: str
    state: DeadlineState = DeadlineState()


def planned_progress(obs: Observation, now: float, params: DeadlineParams) -> float:
    """Work the straight line from start to (deadline - one restart) asks for at ``now``."""
    assert obs.deadline_at is not None
    span = obs.deadline_at - params.restart_overhead_seconds - obs.started_at
    if not span > 0:  # the restart alone outlasts the window: all the work is due at once
        return obs.work_total
    frac = (now - obs.started_at) / span
    return obs.work_total * min(max(frac, 0.0), 1.0)


def slack(obs: Observation, now: float) -> float:
    """Time to the deadline minus the work left: what preemptions, restarts and waiting may still use."""
    assert obs.deadline_at is not None
    return (obs.deadline_at - now) - (obs.work_total - obs.work_done)


def _running(obs: Observation) -> Market | None:
    return Market(obs.running) if obs.running else None


@deadline_policies.register("uniform-progress")
def uniform_progress(state: DeadlineState, obs: Observation, now: float, params: DeadlineParams) -> Decision:
    running = _running(obs)
    if obs.deadline_at is None:
        if obs.spot_available:
            return Decision(Market.SPOT.value, "no deadline: spot only", state)
        return Decision(WAIT, "no deadline and no spot capacity: wait", state)
    if state.committed:
        return Decision(Market.ON_DEMAND.value, "safety net: on-demand to the end", state)
    r = params.restart_overhead_seconds
    left = slack(obs, now)
    # leaving the current instance costs a restart; running on-demand already, only the way back costs
    needed = params.safety_restarts * r
    if left <= needed:
        return Decision(
            Market.ON_DEMAND.value,
            f"safety net: slack {left:.0f}s <= {needed:.0f}s ({params.safety_restarts:g} restarts)",
            replace(state, committed=True),
        )
    ahead = obs.work_done - planned_progress(obs, now, params)
    if running is Market.SPOT and obs.spot_available:
        return Decision(Market.SPOT.value, f"on spot, {ahead:+.0f}s against the line", state)
    if obs.spot_available:
        if running is Market.ON_DEMAND and ahead < params.hysteresis:
            return Decision(
                Market.ON_DEMAND.value, f"on-demand until {params.hysteresis:.0f}s ahead of the line ({ahead:+.0f}s)", state
            )
        return Decision(Market.SPOT.value, f"spot available, {ahead:+.0f}s against the line", state)
    threshold = params.hysteresis if running is Market.ON_DEMAND else 0.0
    if ahead < threshold:
        return Decision(Market.ON_DEMAND.value, f"no spot and {ahead:+.0f}s against the line", state)
    return Decision(WAIT, f"no spot, {ahead:+.0f}s ahead of the line: wait for spot", state)


@deadline_policies.register("slack-reserve")
def slack_reserve(state: DeadlineState, obs: Observation, now: float, params: DeadlineParams) -> Decision:
    """Uniform Progress measured in slack: keep ``reserve_per_work`` seconds of slack per second of work
    left (what preemptions and outages will still cost) plus the safety net's restarts; spend the rest
    waiting for spot rather than paying for on-demand."""
    running = _running(obs)
    if obs.deadline_at is None or state.committed:
        return uniform_progress(state, obs, now, params)
    r = params.restart_overhead_seconds
    left = slack(obs, now)
    safety = params.safety_restarts * r
    if left <= safety:
        return Decision(Market.ON_DEMAND.value, f"safety net: slack {left:.0f}s <= {safety:.0f}s",
                        replace(state, committed=True))
    spare = left - safety - params.reserve_per_work * (obs.work_total - obs.work_done)
    if running is Market.SPOT and obs.spot_available:
        return Decision(Market.SPOT.value, f"on spot, {spare:+.0f}s spare slack", state)
    threshold = params.hysteresis if running is Market.ON_DEMAND else 0.0
    if obs.spot_available:
        if running is Market.ON_DEMAND and spare < threshold:
            return Decision(Market.ON_DEMAND.value, f"on-demand until {threshold:.0f}s spare slack ({spare:+.0f}s)", state)
        return Decision(Market.SPOT.value, f"spot available, {spare:+.0f}s spare slack", state)
    if spare < threshold:
        return Decision(Market.ON_DEMAND.value, f"no spot and {spare:+.0f}s spare slack", state)
    return Decision(WAIT, f"no spot, {spare:+.0f}s spare slack: wait for spot", state)


def spot_reserve_per_work(params: DeadlineParams, spot_up_seconds: float | None) -> float:
    """Slack kept per second of work left for the restarts of future preemptions when leaving on-demand
    for a pool up ``spot_up_seconds``: ``spot_reserve_per_work``, scaled with
    ``spot_reserve_age_seconds`` by the pool's hazard relative to its long-run rate (spot capacity that
    has lasted hours tends to last: the traces' up periods have a decreasing hazard)."""
    if params.spot_reserve_age_seconds is None or spot_up_seconds is None:
        return params.spot_reserve_per_work
    return params.spot_reserve_per_work * risk_multiplier(spot_up_seconds, params.spot_reserve_age_seconds)


def switch_spare(obs: Observation, now: float, params: DeadlineParams, spot_up_seconds: float | None) -> float:
    """``slack-budget``'s spare slack for a switch to spot: the slack left after the switch's restart, the
    floor and the reserve for future preemptions (:func:`spot_reserve_per_work`); >= 0 pays for it."""
    work_left = obs.work_total - obs.work_done
    floor = params.floor_restarts * params.restart_overhead_seconds
    return (slack(obs, now) - params.restart_overhead_seconds - floor
            - spot_reserve_per_work(params, spot_up_seconds) * work_left)


@deadline_policies.register("slack-budget", default=True)
def slack_budget(state: DeadlineState, obs: Observation, now: float, params: DeadlineParams) -> Decision:
    """Slack spent where it buys the most spot time; the rule, with ``S`` the slack, ``W`` the work left,
    ``r`` one restart and ``F = floor_restarts * r``:

    * ``S <= F``: on-demand to the end (the floor keeps one restart for a preempted spot instance);
    * on spot and its pool still up: stay (progress at full speed, cheaply);
    * spot available, job idle: take it if ``S - r >= F`` (the start leaves a restart for a preemption),
      else on-demand;
    * spot available, job on on-demand: switch only if ``S - r - F >= spot_reserve_per_work * W`` (the
      switch's restart plus the restarts of future preemptions are paid for; with
      ``spot_reserve_age_seconds`` the reserve falls as the pool's observed up-time grows, see
      :func:`spot_reserve_per_work`) and the pool has been up
      ``min_spot_up_seconds`` (``spot_up_seconds``; a fresh pool is likely to go again before the
      switch's restart pays off); or, with ``last_shot_up_seconds``, if only ``S - r >= F`` holds but
      the pool has been up that long (one more spot run, on-demand again after its preemption);
    * no spot, on on-demand: stay — stopping to idle would pay a second restart when the outage goes on;
    * no spot, idle: wait while ``S - F > wait_reserve_per_work * W``; or, given the expected outage
      length ``E`` (observed) and ``w`` waited so far, while ``w < E`` and
      ``S - F - r - spot_reserve_per_work * W >= E - w`` (waiting out one typical outage leaves enough
      slack to come back and pay future preemptions); else on-demand — after ``outage_grace_seconds``
      into the outage (a blip of capacity is not worth an on-demand start that the job would then keep).

    Waiting is priced higher than spot's restarts (``wait_reserve`` > ``spot_reserve``): an outage
    spends slack hour for hour, a preemption only one restart.
    """
    running = _running(obs)
    if obs.deadline_at is None or state.committed:
        return uniform_progress(state, obs, now, params)
    r = params.restart_overhead_seconds
    left = slack(obs, now)
    work_left = obs.work_total - obs.work_done
    floor = params.floor_restarts * r
    if left <= floor:
        return Decision(Market.ON_DEMAND.value, f"safety net: slack {left:.0f}s <= {floor:.0f}s",
                        replace(state, committed=True))
    if running is Market.SPOT and obs.spot_available:
        return Decision(Market.SPOT.value, f"on spot, slack {left:.0f}s", state)
    if obs.spot_available and running is Market.ON_DEMAND:
        spare = switch_spare(obs, now, params, obs.spot_up_seconds)
        age = obs.spot_up_seconds
        if spare < 0:
            shot = params.last_shot_up_seconds
            if shot is not None and age is not None and age >= shot and left - r >= floor:
                # the reserve is for coming back after later preemptions; a job that cannot keep it would
                # otherwise stay on on-demand to the end however long spot stays up
                return Decision(Market.SPOT.value, f"one more spot run: pool up {age:.0f}s, slack {left:.0f}s "
                                                   "pays its restart and the floor", state)
            return Decision(Market.ON_DEMAND.value, f"on-demand: a switch would leave {spare:+.0f}s spare slack", state)
        if age is not None and age < params.min_spot_up_seconds:
            wanted = params.min_spot_up_seconds
            why = f"on-demand until a pool has been up {wanted:.0f}s (best {age:.0f}s)"
            return Decision(Market.ON_DEMAND.value, why, state)
        return Decision(Market.SPOT.value, f"back to spot: {spare:+.0f}s spare slack, pool up {age}s", state)
    if obs.spot_available:
        if left - r >= floor:
            return Decision(Market.SPOT.value, f"spot available, slack {left:.0f}s", state)
        # waiting cannot make spot affordable again: slack only shrinks
        return Decision(Market.ON_DEMAND.value, f"spot unaffordable: slack {left:.0f}s < floor + restart", state)
    if running is Market.ON_DEMAND:
        return Decision(Market.ON_DEMAND.value, "no spot: stay on on-demand", state)
    spare = left - floor - params.wait_reserve_per_work * work_left
    if spare > 0:
        return Decision(WAIT, f"no spot, {spare:+.0f}s of waiting budget: wait for spot", state)
    gone = obs.no_spot_seconds
    expected = obs.expected_outage_seconds
    if expected is not None:
        # a typical outage is worth waiting out while the slack left after it still pays the restart
        # back and the reserve for future preemptions: an early short outage must not buy on-demand
        waited = gone or 0.0
        budget = left - floor - r - params.spot_reserve_per_work * work_left
        if waited < expected and budget >= expected - waited:
            return Decision(WAIT, f"no spot for {waited:.0f}s of an expected {expected:.0f}s outage; "
                                  f"{budget:.0f}s of slack can wait it out", state)
    if gone is not None and gone < params.outage_grace_seconds and left - r > floor:
        return Decision(WAIT, f"no spot for {gone:.0f}s: within the {params.outage_grace_seconds:.0f}s grace", state)
    return Decision(Market.ON_DEMAND.value, f"no spot and no waiting budget ({spare:+.0f}s)", state)


@deadline_policies.register("greedy")
def greedy(state: DeadlineState, obs: Observation, now: float, params: DeadlineParams) -> Decision:
    """Baseline: spot whenever available, wait otherwise, on-demand to the end once the slack is gone."""
    if obs.deadline_at is None:
        return Decision(Market.SPOT.value if obs.spot_available else WAIT, "no deadline", state)
    if state.committed:
        return Decision(Market.ON_DEMAND.value, "deadline forces on-demand", state)
    left = slack(obs, now)
    if left <= params.safety_restarts * params.restart_overhead_seconds:
        return Decision(Market.ON_DEMAND.value, f"slack {left:.0f}s: deadline forces on-demand", replace(state, committed=True))
    if obs.spot_available:
        return Decision(Market.SPOT.value, "spot available", state)
    return Decision(WAIT, "no spot: wait", state)


@deadline_policies.register("on-demand")
def on_demand_only(state: DeadlineState, obs: Observation, now: float, params: DeadlineParams) -> Decision:
    """Baseline: always on-demand."""
    return Decision(Market.ON_DEMAND.value, "on-demand only", state)


def decide(
    state: DeadlineState, obs: Observation, now: float, params: DeadlineParams | None = None, policy: str | None = None
) -> Decision:
    """Run the registered deadline policy ``policy`` (default ``slack-budget``)."""
    return deadline_policies.get(policy)(state, obs, now, params or DeadlineParams())


def choose_market(
    *,
    now: float,
    started_at: float,
    deadline_seconds: float | None,
    done_steps: int,
    total_steps: int,
    step_seconds: float | None = None,
    running: Market | str | None = None,
    spot_available: bool = True,
    spot_up_seconds: float | None = None,
    params: DeadlineParams | None = None,
    state: DeadlineState | None = None,
    policy: str | None = None,
) -> Decision:
    """The operators' entry point: spot or on-demand for the next attempt, from steps.

    :param deadline_seconds: the deadline as seconds after ``started_at`` (None: spot only).
    :param step_seconds: measured seconds per step; without it the job is assumed to need the whole
        window at its current rate, so only the line (not the safety net's absolute slack) is used.
    :returns: a decision whose ``market`` is ``spot`` or ``on-demand`` (``wait`` becomes ``spot``: the
        operator tries spot offers, which is what waiting for spot means for it).
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps!r}")
    if step_seconds is not None and step_seconds > 0:
        unit = step_seconds
    elif deadline_seconds:
        # unknown speed: scale steps so that the whole job fills the window before the last restart; the
        # absolute slack is then meaningless, so only the line decides (no safety-net restarts)
        p = params or DeadlineParams()
        unit = max(deadline_seconds - p.restart_overhead_seconds, 1.0) / total_steps
        params = replace(p, safety_restarts=0.0)
        policy = policy or "uniform-progress"
    else:
        unit = 1.0
    if policy is None and spot_up_seconds is None:
        # slack-budget's return from on-demand rests on the pool's age; without it slack-reserve is the
        # better rule (simulated, 52 h even offsets: 0.592x against 0.625x), so callers that cannot see
        # capacity history (the operators today) keep it; an age estimated from the job's own ledger
        # (policy/pool_age.py) does not replace it: 0.638x (simulated `ours-observed`, all 52 h offsets)
        policy = "slack-reserve"
    obs = Observation(
        started_at=started_at,
        deadline_at=started_at + deadline_seconds if deadline_seconds else None,
        work_done=min(done_steps, total_steps) * unit,
        work_total=total_steps * unit,
        spot_available=spot_available,
        running=running,
        spot_up_seconds=spot_up_seconds,
    )
    d = decide(state or DeadlineState(), obs, now, params, policy)
    if d.market == WAIT:
        return Decision(Market.SPOT.value, d.reason, d.state)
    return d
