"""Replay one policy over a benchmark's start offsets and compare with that benchmark's figures, without
rerunning the rest: the loop every "tried, not taken" entry of ``results_simulate.md`` was measured with.

Change the policy (``airflow_spot/policy/decision.py``, ``deadline.py``, ...), then replay it over the
offsets the constants are chosen on and compare with what ``bench_simulate.py`` wrote to its JSON (each
offset's hindsight cost and the anchors ``greedy`` and ``slack-reserve``)::

    python benchmarks/replay_offsets.py --deadline 52 --offsets even          # 63 replays, a few seconds
    python benchmarks/replay_offsets.py --deadline 52 --offsets 112,114 --rows  # what the job did there

Prints the mean ``cost / hindsight`` and the worst ``cost / min(greedy, slack-reserve)`` over those
offsets, beside the same figures of the policy as the JSON has it (the code that wrote it). ``--traces``,
``--prices``, ``--nodes`` and the transfer options are ``bench_simulate.py``'s; pass the ``--json`` that run
wrote. Offsets are numbered as in the JSON (0 = the first hourly start).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_simulate import DEFAULT_TRACES, _pools, _spec, _traces  # noqa: E402

from airflow_spot.market.traces import TraceError  # noqa: E402
from airflow_spot.simulate.report import offsets_for, run_one  # noqa: E402


def chosen(which: str, n: int) -> list[int]:
    """``even``, ``odd``, ``all``, ``every:K`` or a comma-separated list of offset numbers."""
    if which in ("even", "odd", "all"):
        return list(range(0 if which != "odd" else 1, n, 1 if which == "all" else 2))
    if which.startswith("every:"):
        return list(range(0, n, int(which.split(":", 1)[1])))
    picked = [int(x) for x in which.split(",") if x]
    bad = [i for i in picked if not 0 <= i < n]
    if bad:
        raise SystemExit(f"offsets {bad} out of range: this deadline has offsets 0-{n - 1}")
    return picked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline", type=int, default=52)
    ap.add_argument("--offsets", default="even", help="even, odd, all, every:K, or numbers like 112,114")
    ap.add_argument("--policy", default="ours")
    ap.add_argument("--rows", action="store_true", help="print each listed offset's ledger rows")
    ap.add_argument("--traces", default=DEFAULT_TRACES)
    ap.add_argument("--json", default=str(HERE / "results_simulate.json"), help="the bench_simulate.py output")
    ap.add_argument("--prices", default=None)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--mean-prices", action="store_true", help="per-tick spot prices at their mean")
    ap.add_argument("--transfer-seconds", type=float, default=0.0)
    ap.add_argument("--transfer-dollars", type=float, default=0.0)
    ap.add_argument("--store-region", default=None)
    ap.add_argument("--remote-dollars-per-hour", type=float, default=0.0)
    ap.add_argument("--history-hours", type=float, default=0.0,
                    help="the job's log holds what an earlier job logged in this many hours before its start "
                         "(as bench_simulate.py's --history-hours; the JSON's per-offset figures are then those of a "
                         "cold job, and its history row's even/odd means are printed)")
    args = ap.parse_args()
    try:
        traces = _traces(args.traces)
    except (TraceError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    pools, od = _pools(traces, args.nodes, args.prices, args.mean_prices)
    spec = _spec(args, args.deadline)
    offs = offsets_for(spec, traces)
    every = "four zones" if len(traces) == 4 else f"{len(traces)} zones"
    figures = json.loads(Path(args.json).read_text())
    key = f"{every} offsets {args.deadline}h"
    if key not in figures:
        raise SystemExit(f"{args.json} has no {key!r} (it has {', '.join(figures)}): pass the --json that "
                         "bench_simulate.py wrote for these traces and deadline")
    bench = figures[key]
    hs, greedy, reserve = (bench[p]["ratios"] for p in ("hindsight", "greedy", "slack-reserve"))
    if len(hs) != len(offs):
        raise SystemExit(f"{args.json} has {len(hs)} offsets at {args.deadline} h, these traces {len(offs)}: "
                         "not the same run")
    landed = bench.get(args.policy, {}).get("ratios")
    base = run_one(spec, pools, od, "on-demand", offs[0]).cost
    picked = chosen(args.offsets, len(offs))
    now_hs, now_anchor, then_hs, then_anchor = [], [], [], []
    for i in picked:
        r = run_one(spec, pools, od, args.policy, offs[i], history_hours=args.history_hours)
        x = r.cost / base
        now_hs.append(x / hs[i])
        now_anchor.append(x / min(greedy[i], reserve[i]))
        if landed:
            then_hs.append(landed[i] / hs[i])
            then_anchor.append(landed[i] / min(greedy[i], reserve[i]))
        if args.rows:
            print(f"offset {i}: {x:.4f} x on-demand ({'' if not landed else f'JSON {landed[i]:.4f}, '}"
                  f"hindsight {hs[i]:.4f}, / anchors {now_anchor[-1]:.3f}), on-demand {r.on_demand_hours:.1f} h, "
                  f"spot {r.spot_hours:.1f} h, {r.preemptions} preemptions")
            for row in r.rows:
                print(f"    {row.market:<9} {row.zone:<14} {row.started_at / 3600:7.2f} h - {row.ended_at / 3600:7.2f} h "
                      f"{row.outcome}")
    print(f"{args.policy}, {len(picked)} offsets ({args.offsets}), {args.deadline} h: mean cost / hindsight "
          f"{statistics.mean(now_hs):.4f}, worst / min(greedy, slack-reserve) {max(now_anchor):.3f}")
    warm = bench.get(f"{args.policy} after an earlier job's history")
    if args.history_hours and warm:
        print(f"  the JSON's {args.policy} after {warm['hours']:g} h of history: even {warm['over_hindsight_mean_even']:.4f}, "
              f"odd {warm['over_hindsight_mean_odd']:.4f}, worst (all offsets) {warm['worst_over_anchors']:.3f}")
    if then_hs:
        print(f"  the JSON's {args.policy} over the same offsets: {statistics.mean(then_hs):.4f}, worst "
              f"{max(then_anchor):.3f}")


if __name__ == "__main__":
    main()
