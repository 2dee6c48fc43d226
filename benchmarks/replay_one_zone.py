"""Each bundled zone alone: the policies' mean ``cost / hindsight`` over a sample of hourly starts, one
pool per job (a job allowed a single zone). Not a bench row; the figures of ``results_simulate.md``,
"The ADRS leaderboard's problem" (one zone at a time)::

    python benchmarks/replay_one_zone.py --deadline 52 --every 4 --workers 2

Prints per zone each policy's mean over the sampled starts (deadlines met in brackets), then the mean
over every zone and start.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_simulate import DEFAULT_TRACES, _pools, _traces  # noqa: E402

from airflow_spot.simulate.engine import JobSpec  # noqa: E402
from airflow_spot.simulate.report import HINDSIGHT, offsets_for, run_one  # noqa: E402


def _one(job):
    zone, offset, deadline, policies = job
    pools, od = _pools([t for t in _traces(DEFAULT_TRACES) if t.zone == zone], 1)
    spec = JobSpec(48, deadline, restart_overhead_hours=0.2)
    base = run_one(spec, pools, od, "on-demand", offset).cost
    runs = {p: run_one(spec, pools, od, p, offset) for p in (*policies, HINDSIGHT)}
    return zone, {p: (r.cost / base, bool(r.deadline_met)) for p, r in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline", type=int, default=52)
    ap.add_argument("--every", type=int, default=4, help="every Kth hourly start of the four-zone bench")
    ap.add_argument("--policies", default="ours,oracle-age,rc-cr,adrs-gepa,slack-reserve,greedy")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    policies = tuple(p for p in args.policies.split(",") if p)
    traces = _traces(DEFAULT_TRACES)
    offsets = offsets_for(JobSpec(48, args.deadline, restart_overhead_hours=0.2), traces)[::args.every]
    jobs = [(t.zone, o, args.deadline, policies) for t in traces for o in offsets]
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as ex:
            results = list(ex.map(_one, jobs))
    else:
        results = [_one(j) for j in jobs]

    def cells(rows):
        return " ".join(f"{p} {statistics.mean(r[p][0] / r[HINDSIGHT][0] for r in rows):.3f}"
                        f"({sum(r[p][1] for r in rows)}/{len(rows)})" for p in policies)

    print(f"one zone per job, {args.deadline} h, {len(offsets)} starts (every {args.every}th hourly start)")
    for zone in sorted({z for z, _ in results}):
        print(f"{zone:<12} {cells([r for z, r in results if z == zone])}")
    print(f"{'every zone':<12} {cells([r for _, r in results])}")


if __name__ == "__main__":
    main()
