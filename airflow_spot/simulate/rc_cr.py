"""``rc-cr``: the multi-region Uniform Progress anchor the maintainers replay ``ours`` against.

Wu et al., "Can't Be Late" (NSDI'24), rule RC/CR as its multi-region version is published in the Sky
ADRS / SkyNomad simulator (``multi_region_rc_cr_threshold``): decide as if spot were available; if that
says spot, try every region's spot pool and take the first that launches; if none does, decide again as
an idle job without spot. With ``c0`` the job's work, ``done`` the work done, ``t`` the time since the
start, ``R`` the deadline and ``d`` one restart:

* behind the line (``done < t * c0 / R``): spot if available, else on-demand; ahead: spot if available,
  else nothing (wait);
* on on-demand: stay while no spot is available or ``done <= (t + 2d) * c0 / R`` (ahead by less than two
  restarts' worth of the line);
* idle or on on-demand, when the work left plus two restarts no longer fits before the deadline:
  on-demand;
* when the work left plus one restart no longer fits: on-demand, unless on a spot instance that has
  finished its restart.

Deciding "as if spot were available" first means a job on on-demand two restarts ahead of the line
stops it even when no pool is up, and waits until it falls behind again (the published behaviour, kept:
on the bundled traces deciding with the true availability instead changes the mean cost by under 1 %).
Times are rounded to the traces' tick as the published code rounds to its ``gap_seconds``. One change,
the rule this repository states for every baseline: the spot pool is the cheapest per unit of work up,
then the one up the longest (:func:`~airflow_spot.simulate.pool_rule.pick_by_rule`), not the first
region listed. It reads which pools are up from the traces (a launch attempt in the published simulator
succeeds exactly when the trace says so, at no cost). Progress survives a preemption through the same
emergency save and periodic checkpoints as the other replayed policies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from airflow_spot.simulate.engine import HOUR, View
from airflow_spot.simulate.observed import session_interval
from airflow_spot.simulate.pool_rule import pick_by_rule

SPOT, ON_DEMAND, NONE = "spot", "on-demand", None


def rc_cr_request(
    *, now: float, deadline: float, work_total: float, work_done: float, restart: float, gap: float,
    current: str | None, has_spot: bool, restart_left: float,
) -> str | None:
    """The market RC/CR asks for (``spot``, ``on-demand`` or None: no instance); the module docstring
    states the rule. ``current``: what the job runs on now; ``restart_left``: restart time its instance
    has still to pay."""
    remaining_time = math.floor((deadline - now) / gap) * gap
    work_left = work_total - work_done
    request = SPOT if has_spot else NONE
    if work_done - now * work_total / deadline < 0:  # behind the line
        request = SPOT if has_spot else ON_DEMAND
    if current == ON_DEMAND and (not has_spot or (now + 2 * restart) * work_total / deadline - work_done >= 0):
        request = ON_DEMAND
    if math.ceil((work_left + 2 * restart) / gap) * gap >= remaining_time and current in (NONE, ON_DEMAND):
        request = ON_DEMAND
    if math.ceil((work_left + restart) / gap) * gap >= remaining_time:
        request = SPOT if current == SPOT and restart_left < 1e-3 else ON_DEMAND
        if restart == 0 and has_spot:
            request = SPOT
    return request


@dataclass
class RcCrController:
    """The simulator's ``rc-cr`` controller (see the module docstring)."""

    name: str = "rc-cr"
    emergency_save: bool = True
    prior_mtbf_hours: float = 3.6

    def decide(self, view: View) -> tuple[str, int] | None:
        up = [i for i in range(len(view.pools)) if view.up[i]]
        current = view.running[0] if view.running is not None else NONE
        if view.deadline_at is None:  # no deadline: spot only, as every policy here
            return view.running if current == SPOT else (("spot", pick_by_rule(view, up)) if up else None)
        args = dict(now=view.now, deadline=view.deadline_at, work_total=view.work_total, work_done=view.work_done,
                    restart=view.spec.restart_overhead_hours * HOUR,
                    gap=view.pools[0].trace.gap_seconds if view.pools else 60.0,
                    restart_left=view.pending_seconds if current is not NONE else 0.0)
        request = rc_cr_request(current=current, has_spot=True, **args)
        if current is not NONE and request == current:
            return view.running
        if request == SPOT:
            if up:
                return ("spot", pick_by_rule(view, up))
            request = rc_cr_request(current=NONE, has_spot=False, **args)
        return ("on-demand", 0) if request == ON_DEMAND else None

    def checkpoint_interval(self, view: View) -> float:
        return session_interval(view, self.prior_mtbf_hours, self.emergency_save)
