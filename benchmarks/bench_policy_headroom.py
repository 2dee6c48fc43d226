"""Where `ours`'s gap to the hindsight optimum sits: `ours` with one decision answered from the future.

Replays the reference job (48 h of work, 0.2 h restart, $3.06/h on-demand, $0.9731/h spot) at every
hourly offset, as ``bench_simulate.py`` does, with ``ours`` and with
:class:`airflow_spot.simulate.foresight.ForesightController` variants, each answering one of ``ours``'s
decisions from the traces' future (yardsticks, not policies):

* ``wait``: an idle job facing an outage of every pool waits when a pool is back within 20 min;
* ``leave``: a job on on-demand leaves for spot as soon as a pool will stay up 1 h;
* ``pool``: a launch takes the pool that will stay up the longest;
* ``launch``: an idle job whose slack leaves ``ours`` a waiting budget starts only on a pool that will
  stay up 30 min, and waits while none will;
* ``all three`` (wait, leave, pool) and ``all four``.

The gain of a variant over ``ours`` bounds what a better prediction of that decision could buy.

    python benchmarks/bench_policy_headroom.py [--traces DIR|FILE,FILE] [--deadlines 52,72] [--workers 2]
"""
from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from bench_simulate import DEFAULT_TRACES, _pools, _traces

from airflow_spot.simulate.engine import JobSpec, simulate
from airflow_spot.simulate.foresight import ForesightController
from airflow_spot.simulate.hindsight import hindsight_cost
from airflow_spot.simulate.report import offsets_for

#: the variants, as ForesightController arguments (constants stated up front, not searched)
VARIANTS = {
    "ours": {},
    "wait (back within 20 min)": {"wait_if_back_within": 1200.0},
    "leave (pool stays up 1 h)": {"leave_if_up_for": 3600.0},
    "pool (longest up ahead)": {"pool_by_future": True},
    "launch (stays up 30 min)": {"launch_if_up_for": 1800.0},
    "all three": {"wait_if_back_within": 1200.0, "leave_if_up_for": 3600.0, "pool_by_future": True},
    "all four": {"wait_if_back_within": 1200.0, "leave_if_up_for": 3600.0, "pool_by_future": True,
                 "launch_if_up_for": 1800.0},
}


def _one(args):
    traces, deadline, offset = args
    pools, od = _pools(_traces(traces), 1)
    spec = JobSpec(48, deadline, restart_overhead_hours=0.2)
    best = hindsight_cost(spec, pools, od, offset_ticks=offset)
    out = {}
    for name, kw in VARIANTS.items():
        c = ForesightController(name=name, offset_ticks=offset, **kw)
        r = simulate(spec, pools, od, c, offset_ticks=offset)
        out[name] = (r.cost / best, bool(r.deadline_met), r.preemptions, r.on_demand_hours)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default=[DEFAULT_TRACES], nargs="+",
                    help="a directory, or trace files separated by commas or spaces (a shell glob works)")
    ap.add_argument("--deadlines", default="52,72")
    ap.add_argument("--workers", type=int, default=2, help="processes (at most 2 on a shared machine)")
    args = ap.parse_args()
    args.traces = ",".join(args.traces)  # one string: it travels to the worker processes
    t0 = time.time()
    traces = _traces(args.traces)
    for deadline in [int(x) for x in args.deadlines.split(",") if x]:
        offs = offsets_for(JobSpec(48, deadline, restart_overhead_hours=0.2), traces)
        jobs = [(args.traces, deadline, o) for o in offs]
        with ProcessPoolExecutor(max_workers=max(1, min(args.workers, 2))) as ex:
            rows = list(ex.map(_one, jobs))
        print(f"\n== {len(traces)} zones, {len(offs)} hourly offsets, {deadline} h deadline "
              "(/hs = cost / hindsight optimum)")
        print(f"{'variant':<28}{'mean /hs':>10}{'even':>8}{'odd':>8}{'worst':>8}{'met':>9}{'preempt.':>10}{'od h':>7}")
        for name in VARIANTS:
            ratios = [row[name][0] for row in rows]
            met = sum(row[name][1] for row in rows)
            print(f"{name:<28}{statistics.mean(ratios):>10.3f}{statistics.mean(ratios[0::2]):>8.3f}"
                  f"{statistics.mean(ratios[1::2]):>8.3f}{max(ratios):>8.3f}{f'{met}/{len(rows)}':>9}"
                  f"{statistics.mean(row[name][2] for row in rows):>10.1f}"
                  f"{statistics.mean(row[name][3] for row in rows):>7.1f}")
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
