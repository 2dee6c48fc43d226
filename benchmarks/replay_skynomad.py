"""SkyNomad in its own simulator, on this repository's benchmark jobs: the anchor issue 11 names, measured.

SkyNomad (2026; artifact github.com/andylizf/skynomad-artifact, Apache-2.0) is not re-implemented here: this
script runs the artifact's own ``main.py`` (its simulator and its policy, as its V100 panel configures it:
``unified_cost_model_rate_ratio --max-prediction-hours 1e9 --virtual-availability``) and the artifact's RC/CR
(``multi_region_rc_cr_threshold``) on the jobs this repository's benches replay, and divides each job's
cost by this repository's hindsight optimum for the same job (from the bench's JSON), beside ``ours`` and
``rc-cr`` from the same JSON. The two simulators account differently (the artifact bills by the tick and
charges no save stalls), so RC/CR, replayed in both, is the calibration: how far apart the two RC/CR
columns are says how far apart the simulators are. The artifact's own optimum (``multi_region_oracle_dp``)
is not used: on the bundled 32 s traces one 52 h start needs over 17 GB and most of an hour.

    git clone https://github.com/andylizf/skynomad-artifact && cd skynomad-artifact && uv sync && cd -
    python benchmarks/replay_skynomad.py --artifact skynomad-artifact --python skynomad-artifact/.venv/bin/python \\
        --set bundled --every 16 --workers 2          # the bundled four zones (results_simulate.json)
    python benchmarks/replay_skynomad.py --artifact skynomad-artifact --python ... \\
        --set adrs --traces-root DIR                   # the ADRS leaderboard's jobs (bench_adrs.py)

The job is the issue 4 job (48 h, 0.2 h restart, $0.9731 / $3.06 in every zone, no checkpoint transfer
charged: ``--checkpoint-size-gb 0``). The traces are written in
the artifact's layout (1 = preempted, ``price_info``) to a temporary folder.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_adrs import SCENARIOS  # noqa: E402
from bench_simulate import DEFAULT_TRACES, _pools, _traces  # noqa: E402

from airflow_spot.simulate.engine import JobSpec  # noqa: E402
from airflow_spot.simulate.report import offsets_for, run_one  # noqa: E402

SKYNOMAD = ("unified_cost_model_rate_ratio", ("--max-prediction-hours", "1e9", "--virtual-availability"))
RC_CR = ("multi_region_rc_cr_threshold", ())
#: modules the artifact's entry point imports but a simulation never uses (a W&B client, SkyPilot)
_UNUSED_IMPORTS = {"wandb": "run = None\nconfig = {}\ndef init(*a, **k): return None\ndef log(*a, **k): pass\n"
                            "def finish(*a, **k): pass\n", "sky": ""}


def _stubs(python: str, folder: Path) -> str:
    """A PYTHONPATH entry standing in for the imports the interpreter lacks and a replay never calls."""
    for name, body in _UNUSED_IMPORTS.items():
        if subprocess.run([python, "-c", f"import {name}"], capture_output=True).returncode:
            (folder / name).mkdir(parents=True, exist_ok=True)
            (folder / name / "__init__.py").write_text(body)
    return str(folder)


def _write(metadata: dict, preempted: list[int], zone_pool: str, dest: Path) -> None:
    """A trace in the artifact's layout (1 = preempted), priced as the bench prices every zone."""
    meta = {**metadata, "price_info": {"price": 0.9731, "on_demand_price": 3.06, "zone": zone_pool.rsplit("_", 2)[0]}}
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"metadata": meta, "data": preempted}))


class Artifact:
    def __init__(self, root: str, python: str, scratch: Path) -> None:
        self.root, self.python, self.scratch = root, python, scratch
        self.pythonpath = _stubs(python, scratch / "stubs")

    def cost(self, arm: tuple[str, tuple[str, ...]], files: list[str], start_hours: float, deadline: float) -> float:
        """One job's cost in the artifact's simulator, its probes included."""
        out = tempfile.mkdtemp(dir=self.scratch)
        cmd = [self.python, "main.py", f"--strategy={arm[0]}", "--env=multi_trace", "--trace-files", *files,
               "--task-duration-hours", "48", "--deadline-hours", str(deadline), "--restart-overhead-hours", "0.2",
               "--env-start-hours", str(start_hours), "--output-dir", out, "--no-history",
               # the bench's job moves no checkpoint between regions at a cost; the artifact's default is 50 GB
               "--checkpoint-size-gb", "0", *arm[1]]
        env = {**os.environ, "PYTHONPATH": self.pythonpath}
        done = subprocess.run(cmd, cwd=self.root, env=env, capture_output=True, text=True)
        found = glob.glob(os.path.join(out, "*.json"))
        if not found:
            raise SystemExit(f"the artifact's simulator wrote no result for {arm[0]} at {start_hours:g} h:\n"
                             f"{done.stderr[-2000:]}")
        result = json.loads(Path(found[0]).read_text())
        return result["costs"][0] + result["probe_costs"][0]


def _bundled(args, art: Artifact, scratch: Path) -> None:
    traces = _traces(DEFAULT_TRACES)
    files = []
    for path in sorted(Path(DEFAULT_TRACES).glob("*.json")):
        dest = scratch / "bundled" / path.stem / "full.json"
        raw = json.loads(path.read_text())  # spot-traces: 1 = up
        _write(raw["metadata"], [1 - int(v) for v in raw["data"]], path.stem, dest)
        files.append(str(dest))
    figures = json.loads(Path(args.json).read_text())
    gap = traces[0].gap_seconds
    pools, od = _pools(traces, 1)
    for deadline in (int(d) for d in args.deadlines.split(",")):
        spec = JobSpec(48, deadline, restart_overhead_hours=0.2)
        offsets = offsets_for(spec, traces)
        base = run_one(spec, pools, od, "on-demand", offsets[0]).cost  # the JSON's ratios are multiples of it
        picked = list(range(0, len(offsets), args.every))
        with ThreadPoolExecutor(args.workers) as ex:
            runs = {(arm[0], i): ex.submit(art.cost, arm, files, offsets[i] * gap / 3600, deadline)
                    for i in picked for arm in (SKYNOMAD, RC_CR)}
            cost = {k: f.result() for k, f in runs.items()}
        bench = figures[f"four zones offsets {deadline}h"]
        hindsight = {i: bench["hindsight"]["ratios"][i] * base for i in picked}
        sky = {i: cost[(SKYNOMAD[0], i)] / hindsight[i] for i in picked}

        def mean(values):
            return statistics.mean(values)

        print(f"bundled four zones, {deadline} h, {len(picked)} starts (every {args.every}th of {len(offsets)}), "
              f"x this repository's hindsight: SkyNomad {mean(sky.values()):.3f}, the artifact's RC/CR "
              f"{mean(cost[(RC_CR[0], i)] / hindsight[i] for i in picked):.3f} | ours "
              f"{mean(bench['ours']['ratios'][i] * base / hindsight[i] for i in picked):.3f}, rc-cr "
              f"{mean(bench['rc-cr']['ratios'][i] * base / hindsight[i] for i in picked):.3f}")
        print("  per start, SkyNomad / ours: " + ", ".join(
            f"{i}: {sky[i]:.2f} / {bench['ours']['ratios'][i] * base / hindsight[i]:.2f}" for i in picked))


def _adrs(args, art: Artifact, scratch: Path) -> None:
    figures = json.loads(Path(args.adrs_json).read_text())
    jobs = []
    for scen, zones, n in SCENARIOS:
        for w in range(n):
            files = []
            for z in zones:
                raw = json.loads((Path(args.traces_root) / f"{z}_v100_1" / f"{w}.json").read_text())
                dest = scratch / "adrs" / f"{z}_v100_1" / f"{w}.json"
                _write(raw["metadata"], raw["data"], f"{z}_v100_1", dest)  # already 1 = preempted
                files.append(str(dest))
            jobs.append((scen, w, files))
    with ThreadPoolExecutor(args.workers) as ex:
        runs = {(arm[0], s, w): ex.submit(art.cost, arm, files, 0.0, 52) for s, w, files in jobs
                for arm in (SKYNOMAD, RC_CR)}
        cost = {k: f.result() for k, f in runs.items()}
    cols: dict[str, list[float]] = {"sky": [], "rc": [], "ours": [], "rc-cr": []}
    for scen, _, n in SCENARIOS:
        by = figures["scenarios"][scen]
        hs = by["hindsight"]["costs"]
        cols["sky"].append(statistics.mean(cost[(SKYNOMAD[0], scen, w)] / hs[w] for w in range(n)))
        cols["rc"].append(statistics.mean(cost[(RC_CR[0], scen, w)] / hs[w] for w in range(n)))
        cols["ours"].append(by["ours"]["mean_over_hindsight"])
        cols["rc-cr"].append(by["rc-cr"]["mean_over_hindsight"])
        print(f"  {scen:<26} SkyNomad {cols['sky'][-1]:.3f}, the artifact's RC/CR {cols['rc'][-1]:.3f} | ours "
              f"{cols['ours'][-1]:.3f}, rc-cr {cols['rc-cr'][-1]:.3f}")
    means = {k: statistics.mean(v) for k, v in cols.items()}
    print(f"ADRS leaderboard jobs, 52 h, mean of the scenarios, x this repository's hindsight: SkyNomad "
          f"{means['sky']:.3f}, the artifact's RC/CR {means['rc']:.3f} | ours {means['ours']:.3f}, rc-cr {means['rc-cr']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="a checkout of andylizf/skynomad-artifact")
    ap.add_argument("--python", required=True, help="an interpreter with the artifact's dependencies")
    ap.add_argument("--set", choices=("bundled", "adrs"), default="bundled")
    ap.add_argument("--deadlines", default="52,72")
    ap.add_argument("--every", type=int, default=16, help="every Kth hourly start (bundled)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=str(HERE / "results_simulate.json"), help="bench_simulate.py's figures")
    ap.add_argument("--traces-root", help="the ADRS leaderboard's converted_multi_region_aligned (--set adrs)")
    ap.add_argument("--adrs-json", default=str(HERE / "results" / "adrs_leaderboard.json"))
    args = ap.parse_args()
    if not (Path(args.artifact) / "main.py").is_file():
        raise SystemExit(f"error: {args.artifact} has no main.py: pass a checkout of andylizf/skynomad-artifact")
    if args.set == "adrs" and not args.traces_root:
        raise SystemExit("error: --set adrs needs --traces-root (see bench_adrs.py's docstring)")
    with tempfile.TemporaryDirectory() as tmp:
        art = Artifact(str(Path(args.artifact).resolve()), args.python, Path(tmp))
        (_bundled if args.set == "bundled" else _adrs)(args, art, Path(tmp))


if __name__ == "__main__":
    main()
