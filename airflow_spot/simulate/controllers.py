"""Controllers the simulator replays: our policy and the baselines, all driven by ``airflow_spot.policy``.

Which observations each uses:

* ``ours`` — what ``SpotSegmentOperator`` runs (:mod:`airflow_spot.simulate.observed`):
  :func:`airflow_spot.policy.decision.decide_attempt` on observed pool events only — its own launches,
  refusals and preemptions, probes while on on-demand (charged), with ``--jobs N`` the other jobs'
  events, and with ``--history-hours H`` what an earlier job of the deployment logged before it started
  (:mod:`airflow_spot.simulate.history`); it learns which pools are up only by trying them.
* ``ours-no-probe`` — ``ours`` on a backend that cannot probe.
* ``oracle-age`` — yardstick, not a policy: ``slack-budget`` seeing every pool's true up-since time and
  which pools are up now (the previous headline ``ours``).
* ``slack-reserve`` — Uniform Progress measured in slack (0.06 s kept per second of work left), leaving
  on-demand only for pools up an hour; sees which pools are up and their ages (trace).
* ``up-any-zone`` — "any zone up, else on-demand when behind the line", no cool-down; sees which pools
  are up (trace).
* ``rc-cr`` — the published multi-region Uniform Progress rule (RC/CR, :mod:`airflow_spot.simulate.rc_cr`),
  the anchor the maintainers compare against; sees which pools are up (trace).
* ``adrs-gepa`` — the Sky ADRS leaderboard's best multi-region policy (GEPA-evolved,
  :mod:`airflow_spot.simulate.adrs`), an anchor beside ``rc-cr``; sees which pools are up (trace).
* ``greedy`` — spot in any zone up until the deadline forces on-demand; sees which pools are up (trace).
* ``fixed-one-zone`` — one zone chosen at the start, checkpoints every ``fixed_interval`` and no
  emergency save, greedy fallback to on-demand; sees whether its zone is up (trace).
* ``on-demand`` — on-demand only.

The baselines choose among the pools up by a stated rule
(:func:`~airflow_spot.simulate.pool_rule.pick_by_rule`: cheapest per unit of work, then up the longest,
then the name), never by the order the zones were listed in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from airflow_spot.policy.deadline import WAIT, DeadlineParams, DeadlineState, Observation, decide
from airflow_spot.policy.offer_ranking import RankingParams, choose_offer, in_cooldown
from airflow_spot.policy.offers import Market
from airflow_spot.policy.pool_age import observed_spot_up_seconds
from airflow_spot.policy.registry import PolicyRegistry
from airflow_spot.simulate.adrs import GepaController
from airflow_spot.simulate.engine import HOUR, View
from airflow_spot.simulate.observed import ObservedController, session_interval
from airflow_spot.simulate.pool_rule import pick_by_rule
from airflow_spot.simulate.rc_cr import RcCrController

controllers = PolicyRegistry("simulated controller")


def _observation(
    view: View, spot_available: bool, spot_up_seconds: float | None = None, no_spot_seconds: float | None = None
) -> Observation:
    running = None
    if view.running is not None:
        running = Market.SPOT if view.running[0] == "spot" else Market.ON_DEMAND
    return Observation(
        started_at=0.0, deadline_at=view.deadline_at, work_done=view.work_done, work_total=view.work_total,
        spot_available=spot_available, running=running, spot_up_seconds=spot_up_seconds,
        no_spot_seconds=no_spot_seconds,
    )


def _up_for(view: View, pools: list[int]) -> float | None:
    """How long the longest-up of ``pools`` has been up (the past only); a pool up since before the
    traces begin counts as up since their first tick."""
    if not pools:
        return None
    return max(view.now - view.up_since[n] if n in view.up_since else math.inf
               for n in (view.pools[i].name for i in pools))


@dataclass
class DeadlineController:
    """A deadline policy + an offer choice + a checkpoint interval.

    :param deadline_policy: registered name in :mod:`airflow_spot.policy.deadline`.
    :param ranking: rank pools with :func:`choose_offer` (else the first zone up).
    :param cooldown_hours: a pool that lost capacity this recently is avoided while others are up.
    :param zones: None: every pool; empty: one pool, picked at the start by :func:`pick_by_rule`;
        else only these pool indexes.
    :param fixed_interval_hours: periodic checkpoints at this interval instead of Daly's.
    """

    name: str
    deadline_policy: str = "uniform-progress"
    ranking: bool = True
    cooldown_hours: float = 0.0
    emergency_save: bool = True
    zones: tuple[int, ...] | None = None
    fixed_interval_hours: float | None = None
    safety_restarts: float = 2.0
    hysteresis_hours: float | None = None
    reserve_per_work: float = 0.06
    prior_mtbf_hours: float = 3.6
    #: leaving on-demand only for pools out of their cool-down is decided here (True) or by the deadline
    #: policy from ``spot_up_seconds`` (False)
    settle_from_on_demand: bool = True
    #: pool ages and the cool-down from the job's own preemptions only (what the operators can know),
    #: instead of the traces' up-since times
    observed_ages: bool = False
    #: with ``observed_ages``: also count capacity errors, modelled as every pool down at a tick when the
    #: job is idle (a real job without an instance tries to launch in each spot pool and is refused)
    observe_capacity_errors: bool = False
    #: pool -> last (modelled) capacity error seen by this job
    refused: dict[str, float] = field(default_factory=dict)
    #: with capacity errors: on on-demand, decide only at segment boundaries this far apart, and there,
    #: when the policy would leave for spot, try the spot pools (the down ones refuse: capacity errors)
    probe_every_seconds: float | None = None
    #: the last segment boundary on on-demand
    boundary_at: float | None = None
    state: DeadlineState = field(default_factory=DeadlineState)
    #: the last time a usable spot pool was seen (for how long an outage has lasted)
    spot_seen_at: float | None = None
    #: the one-zone baseline's zone, picked at the job's start
    zone_chosen: int | None = None

    def reset(self) -> "DeadlineController":
        return replace(self, state=DeadlineState(), spot_seen_at=None, refused={}, boundary_at=None, zone_chosen=None)

    def _failures(self, view: View) -> dict[str, float]:
        """Pool -> when it was last seen to lose capacity: the traces, or only this job's own preemptions
        (and modelled capacity errors)."""
        if not self.observed_ages:
            return view.up_since
        seen = dict(view.our_preemptions)
        for pool, at in self.refused.items():
            seen[pool] = max(at, seen.get(pool, at))
        return seen

    def _probe(self, view: View) -> bool:
        """On on-demand with ``probe_every_seconds``: False between segment boundaries (keep running);
        at a boundary, record the capacity errors of trying spot if the policy would leave for it."""
        if view.running is None or view.running[0] != "on-demand":
            self.boundary_at = view.now
            return True
        if self.boundary_at is not None and view.now - self.boundary_at < self.probe_every_seconds:
            return False
        self.boundary_at = view.now
        # the job cannot tell which pools are up before it tries: ask the policy as if spot were there
        age = observed_spot_up_seconds((p.name for p in view.pools), self._failures(view), view.now, 0.0)
        d = decide(self.state, _observation(view, True, age), view.now, self._params(view), self.deadline_policy)
        if d.market == Market.SPOT.value:
            for i, p in enumerate(view.pools):
                if not view.up[i]:
                    self.refused[p.name] = view.now
        return True

    def _params(self, view: View) -> DeadlineParams:
        r = view.spec.restart_overhead_hours * HOUR
        safety = self.safety_restarts
        if not self.emergency_save and self.fixed_interval_hours and r > 0:
            safety += self.fixed_interval_hours * HOUR / r  # a preemption can also throw away one interval
        return DeadlineParams(restart_overhead_seconds=r, safety_restarts=safety, reserve_per_work=self.reserve_per_work,
                              hysteresis_seconds=None if self.hysteresis_hours is None else self.hysteresis_hours * HOUR)

    def _ranking(self, view: View) -> RankingParams:
        return RankingParams(overhead_seconds=view.spec.restart_overhead_hours * HOUR,
                             cooldown_seconds=self.cooldown_hours * HOUR)

    def _candidates(self, view: View) -> list[int]:
        if self.zones is None:
            allowed: tuple[int, ...] | range = range(len(view.pools))
        elif self.zones:
            allowed = self.zones
        else:
            if self.zone_chosen is None:  # the one zone: chosen once, at the job's start, by the rule
                self.zone_chosen = pick_by_rule(view, range(len(view.pools)))
            allowed = (self.zone_chosen,)
        return [i for i in allowed if view.up[i]]

    def decide(self, view: View) -> tuple[str, int] | None:
        candidates = self._candidates(view)
        rp = self._ranking(view)
        if self.observed_ages and self.observe_capacity_errors:
            if self.probe_every_seconds is not None and not self._probe(view):
                return view.running  # on on-demand between segment boundaries
            if view.running is None:  # an idle job tries every pool; the down ones refuse
                for i, p in enumerate(view.pools):
                    if not view.up[i]:
                        self.refused[p.name] = view.now
        seen = self._failures(view)
        settled = [i for i in candidates if not in_cooldown(view.pools[i].offer, view.now, seen, rp.cooldown_seconds)]
        on_spot = view.running is not None and view.running[0] == "spot"
        # leaving on-demand for a pool that just came back is the costliest mistake: wait until it settles
        if self.settle_from_on_demand and view.running is not None and not on_spot:
            usable = settled
        else:
            usable = candidates
        if usable:
            self.spot_seen_at = view.now
        # an outage seen from the job's start counts from the start (the past before it is not tracked)
        gone = None if usable else view.now - (self.spot_seen_at if self.spot_seen_at is not None else 0.0)
        if self.observed_ages:  # the job started at 0 on the simulated clock
            age = observed_spot_up_seconds((view.pools[i].name for i in usable), seen, view.now, 0.0)
        else:
            age = _up_for(view, usable)
        obs = _observation(view, bool(usable), age, gone)
        d = decide(self.state, obs, view.now, self._params(view), self.deadline_policy)
        self.state = d.state
        if d.market == WAIT:
            return None
        if d.market == Market.ON_DEMAND.value:
            return ("on-demand", 0)
        if on_spot and view.up[view.running[1]]:
            return view.running
        if not self.ranking:
            return ("spot", pick_by_rule(view, usable))
        best = choose_offer([view.pools[i].offer for i in usable], now=view.now,
                            recent_preemptions=seen, params=rp)
        return ("spot", next(i for i in usable if view.pools[i].offer is best))

    def checkpoint_interval(self, view: View) -> float:
        if self.fixed_interval_hours is not None:
            return self.fixed_interval_hours * HOUR
        return session_interval(view, self.prior_mtbf_hours, self.emergency_save)


@controllers.register("ours", default=True)
def ours() -> ObservedController:
    # what SpotSegmentOperator runs: policy.decision.decide_attempt on observed events only
    return ObservedController("ours")


@controllers.register("ours-no-probe")
def ours_no_probe() -> ObservedController:
    # ours on a backend that cannot probe spot capacity while the job runs on on-demand
    return ObservedController("ours-no-probe", probes=False)


@controllers.register("oracle-age")
def oracle_age() -> DeadlineController:
    # a yardstick, not a policy: slack-budget seeing every pool's true up-since time and which pools are
    # up now from the traces (the previous headline `ours`); the cool-down only orders the pools
    return DeadlineController("oracle-age", deadline_policy="slack-budget", cooldown_hours=1.0,
                              settle_from_on_demand=False)


@controllers.register("slack-reserve")
def slack_reserve() -> DeadlineController:
    return DeadlineController("slack-reserve", deadline_policy="slack-reserve", cooldown_hours=1.0,
                              hysteresis_hours=0.0, reserve_per_work=0.06)


@controllers.register("up-any-zone")
def up_any_zone() -> DeadlineController:
    return DeadlineController("up-any-zone", ranking=False)


@controllers.register("rc-cr")
def rc_cr() -> RcCrController:
    return RcCrController()


@controllers.register("adrs-gepa")
def adrs_gepa() -> GepaController:
    return GepaController()


@controllers.register("greedy")
def greedy() -> DeadlineController:
    return DeadlineController("greedy", deadline_policy="greedy", ranking=False)


@controllers.register("fixed-one-zone")
def fixed_one_zone() -> DeadlineController:
    return DeadlineController("fixed-one-zone", deadline_policy="greedy", ranking=False, emergency_save=False,
                              zones=(), fixed_interval_hours=0.5)


@controllers.register("on-demand")
def on_demand() -> DeadlineController:
    return DeadlineController("on-demand", deadline_policy="on-demand", ranking=False)
