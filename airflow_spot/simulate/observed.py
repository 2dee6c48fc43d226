"""``ours`` as the operators run it: the decision function fed only by what a real job observes.

:class:`ObservedController` replays what ``SpotSegmentOperator`` does, with the same function
(:func:`airflow_spot.policy.decision.decide_attempt`) and the same observation type
(:class:`~airflow_spot.policy.observations.JobObservation`):

* it decides only where the operators decide: at segment boundaries (every ``JobSpec.segment_seconds``
  of an instance's time), after a preemption, and, while idle, every ``recheck_seconds`` (an Airflow retry);
* it never reads which pools are up: it tries the ranked spot offers in order; a pool that is up accepts
  (event ``launched``), one that is down refuses (``refused``); when all refuse it decides once more
  with those refusals (on-demand or wait) — the operator's ``_get_instance`` loop;
* a preemption of its own instance is an event (``preempted``); its own running instance tells it that
  pool is up;
* on a spot instance that is up, at a segment boundary, it tries the cheaper pools the decision names
  (``AttemptDecision.move_to``) and moves to the first that accepts, else keeps its instance — what the
  operator does with its warm instance; it first probes the cheaper pools not yet seen settled
  (``settle_probe``), as the operator does, and decides again; without probes it tries them as targets;
* on on-demand, when the decision asks for a probe, it places a spot request in every pool and cancels
  it (``probe-up`` / ``probe-down``), charged ``probe_billed_seconds`` at the spot price per accepted
  request (the billing minimum), added to the run's cost; with ``JobSpec.probe_miss`` a probe of a pool
  with capacity reads ``probe-down`` that often (a deterministic draw per pool and time, so a replay is
  reproducible and does not depend on the order of the pools);
* ``shared``: events of other jobs of the deployment (``simulate --jobs N``: N jobs replayed together on
  the same window, :func:`~airflow_spot.simulate.engine.simulate_together`; each sees the others' events
  as soon as they happened, :class:`OtherJobs`).
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from airflow_spot.policy.checkpoint_interval import (
    IntervalInputs, checkpoint_interval, estimate_mtbf, estimate_notice_coverage,
)
from airflow_spot.policy.deadline import WAIT, DeadlineState
from airflow_spot.policy import decision as policy_decision
from airflow_spot.policy.decision import AttemptDecision, DecisionParams, observed_deadline_params
from airflow_spot.policy.observations import LOGGED_KINDS, PROBE_RETRIES, JobObservation, PoolEvent
from airflow_spot.policy.offers import Market
from airflow_spot.simulate.engine import HOUR, View


#: events compaction never drops (:meth:`ObservedController._record`)
KEPT_KINDS = frozenset({"launched", "preempted"})


class OtherJobs:
    """The events of the other jobs of a deployment replayed together, as one job reads them: live (what
    they have recorded so far; ``pool_views`` then ignores anything after the reader's ``now``) and named
    as theirs, since only a job's own events say how long its instances lived; after ``history``, what
    the deployment logged before they started (:mod:`airflow_spot.simulate.history`)."""

    def __init__(self, others: Sequence[tuple[str, "ObservedController"]], history: Sequence[PoolEvent] = ()) -> None:
        self.others = list(others)
        self.history = list(history)

    def __iter__(self) -> Iterator[PoolEvent]:
        yield from self.history
        for name, controller in self.others:
            for e in controller.events:
                if e.kind in LOGGED_KINDS:  # what the deployment's log holds of another job
                    yield replace(e, job=name)


def session_interval(view: View, prior_mtbf_hours: float, emergency_save: bool) -> float:
    """The periodic-checkpoint interval a job's ``SpotSession`` would choose here: Daly's, from the pool's
    MTBF (the prior blended with the job's preemptions in it) and the chance a notice covers a preemption
    (the replay delivers every notice, so each of the job's preemptions was covered when its emergency
    save fits the window, and none was when the job takes no emergency saves)."""
    if view.running is None or view.running[0] != "spot":
        return 3600.0  # on-demand: an insurance save an hour
    pool = view.pools[view.running[1]].name
    mtbf = estimate_mtbf(prior_mtbf_hours * HOUR, view.our_preemption_counts.get(pool, 0), view.now)
    fits = emergency_save and view.spec.save_cost_seconds <= view.spec.notice_seconds
    coverage = estimate_notice_coverage(sum(view.our_preemption_counts.values()), 0, fits=fits)
    return checkpoint_interval(IntervalInputs(save_cost_seconds=view.spec.save_cost_seconds, mtbf_seconds=mtbf,
                                              notice_coverage=coverage))


@dataclass
class ObservedController:
    name: str = "ours"
    emergency_save: bool = True
    recheck_seconds: float = 60.0
    probes: bool = True
    probe_billed_seconds: float = 60.0
    #: a probe that reads "no capacity" is asked again this many times at once before it counts (the
    #: replay draws each try's miss independently)
    probe_retries: int = PROBE_RETRIES
    prior_mtbf_hours: float = 3.6
    #: the decision's constants (DecisionParams fields other than the deadline's and the transfer's)
    probe_every_seconds: float = 900.0
    prior_outage_seconds: float = DecisionParams.prior_outage_seconds
    #: DeadlineParams fields to override (the restart is the job's)
    deadline_overrides: dict = field(default_factory=dict)
    #: the job's own events
    events: list[PoolEvent] = field(default_factory=list)
    #: other jobs' events (the deployment's availability log); read, never written, at every decision, so
    #: a collection or a live view that can be iterated again (:class:`OtherJobs`), never a one-shot iterator
    shared: Iterable[PoolEvent] = field(default_factory=list)
    state: DeadlineState = field(default_factory=DeadlineState)
    probe_cost: float = 0.0
    probes_made: int = 0
    probes_accepted: int = 0
    decisions: int = 0
    _where: tuple[str, int] | None = None
    _next_at: float = 0.0
    #: pool -> (index of its newest event, whether that event continues a run)
    _last: dict = field(default_factory=dict)

    @property
    def next_decision_at(self) -> float:
        """When this controller decides next (the replay asks it then, even inside a trace's tick)."""
        return self._next_at

    def _record(self, event: PoolEvent) -> None:
        """Append an event; of a run of same-direction events of one pool only the first and the newest are
        kept (all that ``pool_views`` reads from a run), so long waits do not slow every decision down. A
        ``launched`` or ``preempted`` event is never dropped: the job's own preemption rate and regional
        losses (``own_pool_losses``) count instances from their launch to their loss, as the operators count
        them from every ledger row."""
        last = self._last.get(event.pool)
        if (last is not None and last[1] and self.events[last[0]].up == event.up
                and event.kind not in KEPT_KINDS and self.events[last[0]].kind not in KEPT_KINDS):
            self.events[last[0]] = event  # replace the run's newest
            return
        run_continues = last is not None and self.events[last[0]].up == event.up
        self.events.append(event)
        self._last[event.pool] = (len(self.events) - 1, run_continues)

    def _params(self, view: View) -> DecisionParams:
        r = view.spec.restart_overhead_hours * HOUR
        return DecisionParams(
            deadline=observed_deadline_params(restart_overhead_seconds=r, **self.deadline_overrides),
            recheck_seconds=self.recheck_seconds, probe_every_seconds=self.probe_every_seconds,
            prior_outage_seconds=self.prior_outage_seconds,
            transfer_seconds=view.spec.transfer_seconds, transfer_dollars=view.spec.transfer_dollars,
            home_region=view.checkpoint_region, remote_dollars_per_hour=view.spec.remote_dollars_per_hour,
        )

    def _observation(self, view: View) -> JobObservation:
        running = running_pool = None
        if view.running is not None:
            running = view.running[0]
            if running == Market.SPOT.value:
                running_pool = view.pools[view.running[1]].name
        # the engine's work is in reference-GPU seconds; the deadline rule counts it, as the operators do
        # (``planning.work_reference``), in seconds of the on-demand instance it falls back to
        pace = view.on_demand.relative_throughput if view.on_demand.relative_throughput > 0 else 1.0
        return JobObservation(
            now=view.now, started_at=0.0, deadline_at=view.deadline_at, work_done=view.work_done / pace,
            work_total=view.work_total / pace, offers=[p.offer for p in view.pools] + [view.on_demand],
            events=[*self.events, *self.shared], running=running, running_pool=running_pool,
        )

    def _decide(self, view: View) -> AttemptDecision:
        self.decisions += 1
        # looked up at call time: the operators' planning calls the very same function
        d = policy_decision.decide_attempt(self._observation(view), self.state, self._params(view))
        self.state = d.state
        return d

    def _probe_reads_up(self, view: View, i: int) -> bool:
        if not view.up[i]:
            return False
        miss = view.spec.probe_miss
        moment = view.window_start + view.now  # the market's moment: offsets that share it share the draw
        for k in range(1 + max(0, self.probe_retries)):
            if miss == 0.0 or random.Random(f"probe:{view.pools[i].name}:{moment!r}:{k}").random() >= miss:
                return True
        return False

    def _probe(self, view: View, pools: set[str] | None = None) -> None:
        """Probe every spot pool, or only ``pools``."""
        for i, p in enumerate(view.pools):
            if pools is not None and p.name not in pools:
                continue
            if self._probe_reads_up(view, i):
                self._record(PoolEvent(p.name, "probe-up", view.now))
                self.probe_cost += p.offer.price_per_hour * self.probe_billed_seconds / HOUR
                self.probes_accepted += 1
            else:
                self._record(PoolEvent(p.name, "probe-down", view.now))
        self.probes_made += 1

    def _launch_first(self, offers, view: View) -> tuple[str, int] | None:
        """Try the spot ``offers`` in order as the operator does: the first up accepts (``launched``), each
        down one refuses (``refused``); None when all refused."""
        index = {p.name: i for i, p in enumerate(view.pools)}
        for offer in offers:
            if not offer.is_spot:
                continue
            i = index[offer.pool]
            if view.up[i]:
                self._record(PoolEvent(offer.pool, "launched", view.now))
                return ("spot", i)
            self._record(PoolEvent(offer.pool, "refused", view.now))
        return None

    def _execute(self, d: AttemptDecision, view: View) -> tuple[str, int] | None | str:
        """Carry the decision out; ``"refused"`` when every spot offer refused. ``wait`` is carried out as
        the operators do (``as_launch_market``): the spot offers are tried, and the job idles only when all
        refuse."""
        if d.market == WAIT:
            return self._launch_first(d.ranked, view) or "refused"
        if d.market == Market.ON_DEMAND.value:
            return ("on-demand", 0)
        if (view.running is not None and view.running[0] == "spot" and view.up[view.running[1]]
                and not d.leave_running):
            # a cheaper pool worth the move is tried first; the running instance is kept if all refuse
            return self._launch_first(d.move_to, view) or view.running
        return self._launch_first(d.ranked, view) or "refused"

    def decide(self, view: View) -> tuple[str, int] | None:
        if self._where is not None and self._where[0] == "spot" and view.running is None:
            self._record(PoolEvent(view.pools[self._where[1]].name, "preempted", view.now))
            self._next_at = view.now  # a preemption is a decision point
        if view.now < self._next_at:
            return view.running
        if view.running is not None and view.running[0] == "spot":
            # the segment that ends here is a ledger row whose end says the pool was up (``ledger_events``)
            self._record(PoolEvent(view.pools[view.running[1]].name, "running", view.now))
        d = self._decide(view)
        if d.probe and self.probes:
            self._probe(view)
            d = self._decide(view)
        if d.settle_probe:
            if self.probes:
                self._probe(view, {o.pool for o in d.settle_probe})
                d = self._decide(view)
            else:  # a backend that cannot probe moves without seeing the target settle
                d = replace(d, move_to=d.move_to + d.settle_probe)
        target = self._execute(d, view)
        if target == "refused":
            d = self._decide(view)
            # with the refusals: on-demand, or wait (retry later: the operators' capacity wait tries no more now)
            target = None if d.market == WAIT else self._execute(d, view)
            if target == "refused":  # cannot happen after refusals, but never launch into a down pool
                target = view.running if view.running and view.running[0] == "on-demand" else None
        self._where = target
        self._next_at = view.now + (self.recheck_seconds if target is None else view.spec.segment_seconds)
        return target

    def checkpoint_interval(self, view: View) -> float:
        return session_interval(view, self.prior_mtbf_hours, self.emergency_save)
