"""Where the gap between ``ours`` and the hindsight optimum sits: ``ours`` with one decision answered
from the traces' future.

A yardstick, never a policy (it reads the future). :class:`ForesightController` is ``ours``
(:class:`~airflow_spot.simulate.observed.ObservedController`: the same decision function, the same
observations, the same segment cadence) except for the decisions switched on, each answered by looking
ahead in the traces:

* ``wait_if_back_within``: an idle job that ``ours`` would start on on-demand because no pool is up
  waits instead when a pool comes back within that many seconds (and the slack pays the wait, the
  restart and the floor);
* ``leave_if_up_for``: a job on on-demand leaves for spot, at a decision point, as soon as a pool will
  stay up that long from now (when the slack pays the restart and the floor), whatever the rule's
  reserve and settle time say; otherwise the rule decides;
* ``pool_by_future``: a launch tries the pools in the order of how long they will stay up;
* ``launch_if_up_for``: an idle job that ``ours`` would start on spot, and whose slack leaves ``ours`` a
  waiting budget (``slack - floor > wait_reserve_per_work x work left``), starts only on a pool that will
  stay up that long from now, trying those first; while none will, it waits.

Each one's gain over ``ours`` is the most that predicting that decision better could buy
(``benchmarks/bench_policy_headroom.py``). Everything else — what the job observes, when it decides,
what a preemption costs — is ``ours``'s, so the differences are the decisions' alone.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from airflow_spot.policy.deadline import WAIT
from airflow_spot.policy.decision import AttemptDecision
from airflow_spot.policy.offers import Market
from airflow_spot.simulate.engine import View
from airflow_spot.simulate.observed import ObservedController


@dataclass
class ForesightController(ObservedController):
    """``ours`` with the decisions named in the module docstring read from the future.

    :param offset_ticks: the trace tick the replay started at (the controller's clock starts at 0 there).
    """

    name: str = "foresight"
    offset_ticks: int = 0
    wait_if_back_within: float | None = None
    leave_if_up_for: float | None = None
    pool_by_future: bool = False
    launch_if_up_for: float | None = None

    def _up_ahead(self, view: View, i: int) -> float:
        """Seconds pool ``i`` stays up from now (0 when it is down now)."""
        values = view.pools[i].trace.up_for(view.spec.nodes)
        gap = view.pools[i].trace.gap_seconds
        idx = self.offset_ticks + int(view.now // gap)
        k = 0
        while idx + k < len(values) and values[idx + k]:
            k += 1
        return k * gap

    def _back_within(self, view: View, seconds: float) -> bool:
        gap = view.pools[0].trace.gap_seconds
        idx = self.offset_ticks + int(view.now // gap)
        ahead = int(seconds // gap)
        for p in view.pools:
            values = p.trace.up_for(view.spec.nodes)
            if any(values[idx:idx + ahead + 1]):
                return True
        return False

    def _slack(self, view: View) -> float:
        assert view.deadline_at is not None
        return view.deadline_at - view.now - (view.work_total - view.work_done)

    def _spot_first(self, view: View) -> tuple:
        spot = [p.offer for p in view.pools]
        index = {p.name: i for i, p in enumerate(view.pools)}
        return tuple(sorted(spot, key=lambda o: -self._up_ahead(view, index[o.pool])))

    def _decide(self, view: View) -> AttemptDecision:
        d = super()._decide(view)
        if view.deadline_at is None or d.state.committed:
            return d
        p = self._params(view).deadline
        r, floor = p.restart_overhead_seconds, p.floor_restarts * p.restart_overhead_seconds
        running = view.running[0] if view.running is not None else None
        if (self.wait_if_back_within is not None and running is None and d.market == Market.ON_DEMAND.value
                and not any(view.up) and self._slack(view) - self.wait_if_back_within - r >= floor
                and self._back_within(view, self.wait_if_back_within)):
            return replace(d, market=WAIT, reason="foresight: a pool comes back soon")
        if (self.leave_if_up_for is not None and running == Market.ON_DEMAND.value and d.market != Market.SPOT.value
                and self._slack(view) - r >= floor
                and any(self._up_ahead(view, i) >= self.leave_if_up_for for i in range(len(view.pools)))):
            return replace(d, market=Market.SPOT.value, reason="foresight: a pool stays up", probe=False,
                           ranked=self._spot_first(view))
        if (self.launch_if_up_for is not None and running is None and d.market == Market.SPOT.value
                and self._slack(view) - floor > p.wait_reserve_per_work * (view.work_total - view.work_done)):
            index = {q.name: i for i, q in enumerate(view.pools)}
            lasting = {o.pool for o in d.ranked if o.is_spot
                       and self._up_ahead(view, index[o.pool]) >= self.launch_if_up_for}
            if not lasting:
                return replace(d, market=WAIT, reason="foresight: no pool stays up long enough yet")
            # the lasting pools first, each group in the rule's order
            return replace(d, ranked=tuple(sorted(d.ranked, key=lambda o: o.pool not in lasting)))
        return d

    def _execute(self, d: AttemptDecision, view: View):
        if d.market == WAIT and d.reason.startswith("foresight"):
            return None  # a wait the future decided idles: trying the pools now is what it decided against
        if self.pool_by_future and d.market == Market.SPOT.value:
            d = replace(d, ranked=self._spot_first(view))
        return super()._execute(d, view)
