"""Segment benchmarks under a real Airflow: PostgreSQL, CeleryExecutor on Redis, separate triggerer.

Starts the same production-like stack as the end-to-end tests (``tests/e2e/airflow_stack.py``), runs
spot training DAGs on the ``local`` backend and measures, from per-step wall-clock stamps written by the
training process itself (this script's ``train`` mode, a small torch MLP driven by ``SpotSession``):

(i)   segment boundary on a warm instance: end of the last step of segment k -> start of the first step
      of segment k+1 (same instance; no preemption).                                     target <= 3 s
(ii)  recovery after a preemption: the injector's SIGKILL (notice window 0, no simulated boot, retry
      delay 2 s) -> start of the first step of the next try on a fresh instance.          target <= 10 s
(iii) goodput of a demo-scale job (3 segments, like ``dags/spot_training_demo.py``, but 3 minutes of
      steps) under an injected Poisson preemption rate: useful step time (the steps of the final weights'
      lineage) / wall time of the DAG run, and / the training span (first step to last step). target >= 0.9
      The earlier small configuration (600 steps x 0.05 s in 4 segments, MTBF 90 s) is kept as a second line.

Under the table the script prints where the time of (i) and (ii) goes, from the attempt records in the
store (launch request time, the agent's command start/end) and the step stamps: a boundary is the end
checkpoint and the "segment done" report of segment k's process (the agent then writes ``completed``),
Airflow's hand-off (trigger poll, triggerer -> scheduler -> worker for ``execute_complete``, scheduling and
starting segment k+1's ``execute``), the agent's pick-up and hand-over, and the warm process's first step
(``training/handoff.py``: the process is kept, no interpreter start, torch import or restore). The same
job with ``warm_process=False`` (a new process per segment, as before) is measured on the same stack for
comparison. Figures depend on the machine's load; the load average is printed.

Run: ``python benchmarks/bench_segments.py`` (about 9-10 minutes on 2 cores); the table is printed and
written to ``benchmarks/results/segments.txt``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
E2E = REPO / "tests" / "e2e"
RESULTS = REPO / "benchmarks" / "results" / "segments.txt"

STEP_SECONDS = 0.05
BOUNDARY = dict(dag_id="bench_boundary", total_steps=200, steps_per_segment=40)
BOUNDARY_COLD = dict(dag_id="bench_boundary_cold", total_steps=200, steps_per_segment=40)
# The second instance lives longer than an attempt's start-up (python + torch import + restore), so
# each kill is followed by a try that really resumes (a kill before the first step would hide in the next).
RECOVERY = dict(dag_id="bench_recovery", total_steps=400, steps_per_segment=400, preempt_after=[8.0, 16.0, None])
# Demo scale: 3 segments like the demo DAG, 3 minutes of steps. The rate: one pool preempting every 30
# minutes on average (pessimistic: the bundled AWS traces give 3-4.3 h); seed 1 preempts the first
# instance 85 s after it starts, so the run includes one recovery. Notice window 5 s as in the demo.
GOODPUT_MTBF_SECONDS = 1800.0
GOODPUT = dict(dag_id="bench_goodput", total_steps=3600, steps_per_segment=1200, mtbf=GOODPUT_MTBF_SECONDS, seed=1,
               notice=5.0)
# the earlier small configuration: 30 s of steps in 4 segments, MTBF 90 s
GOODPUT_SMALL = dict(dag_id="bench_goodput_small", total_steps=600, steps_per_segment=150, mtbf=90.0, seed=3,
                     notice=2.0)


# ------------------------------------------------------------------------------------ instance side
def train(total_steps: int, step_seconds: float) -> int:
    """A small deterministic torch job that stamps every step into ``<job dir>/steps.log``."""
    import torch
    from torch import nn

    from airflow_spot.training import SpotSession
    from airflow_spot.training import env as E

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    job_dir = Path(os.environ[E.JOB_URI].removeprefix("file://"))
    with SpotSession.from_env(total_steps=total_steps) as spot, open(job_dir / "steps.log", "a", buffering=1) as stamps:
        spot.track(model=model, optimizer=opt)
        for step in spot.steps():
            started = time.time()
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            spot.report(loss=loss.item())
            time.sleep(max(0.0, step_seconds - (time.time() - started)))
            # spot.attempt_id: a warm process runs several attempts
            stamps.write(f"{spot.attempt_id} {step} {started:.6f} {time.time():.6f}\n")
    return 0


# ------------------------------------------------------------------------------------ Airflow side
DAG_FILE = '''"""Benchmark DAGs of benchmarks/bench_segments.py (generated; see there)."""
# Airflow's safe-mode discovery only parses files that mention both "airflow" and "dag".
import sys
sys.path.insert(0, {dags!r})
from e2e_spot_dags import spot_dag

def command(total_steps):
    return [sys.executable, {script!r}, "train", "--total-steps", str(total_steps), "--step-seconds", "{step}"]

boundary = spot_dag("{b[dag_id]}", {b[total_steps]}, {b[steps_per_segment]}, 0.0, command=command({b[total_steps]}))
boundary_cold = spot_dag("{bc[dag_id]}", {bc[total_steps]}, {bc[steps_per_segment]}, 0.0,
                         command=command({bc[total_steps]}), warm_process=False)
recovery = spot_dag("{r[dag_id]}", {r[total_steps]}, {r[steps_per_segment]}, 0.0, command=command({r[total_steps]}),
                    preemption={{"mode": "schedule", "after_seconds": {r[preempt_after]!r}}}, notice_window_seconds=0.0)
goodput = spot_dag("{g[dag_id]}", {g[total_steps]}, {g[steps_per_segment]}, 0.0, command=command({g[total_steps]}),
                   preemption={{"mode": "rate", "mtbf_seconds": {g[mtbf]}, "seed": {g[seed]}}},
                   notice_window_seconds={g[notice]}, max_preemptions=20)
goodput_small = spot_dag("{gs[dag_id]}", {gs[total_steps]}, {gs[steps_per_segment]}, 0.0,
                         command=command({gs[total_steps]}),
                         preemption={{"mode": "rate", "mtbf_seconds": {gs[mtbf]}, "seed": {gs[seed]}}},
                         notice_window_seconds={gs[notice]}, max_preemptions=20)
'''


def read_stamps(job_dir: Path) -> list[tuple[str, int, float, float]]:
    rows = []
    for line in (job_dir / "steps.log").read_text().splitlines():
        attempt, step, t0, t1 = line.split()
        rows.append((attempt, int(step), float(t0), float(t1)))
    return sorted(rows, key=lambda r: r[2])


def lineage(stamps) -> dict[int, tuple[str, int, float, float]]:
    """The last execution of every step: the steps the final weights descend from."""
    return {s[1]: s for s in stamps}


def run_job(stack, dag_id: str, timeout: float = 600) -> tuple[str, Path, dict]:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    stack.trigger(dag_id, run_id=run_id)
    state = stack.wait_run(dag_id, run_id, timeout=timeout)
    if state != "success":
        raise RuntimeError(f"{dag_id} run {run_id} ended {state}: {stack.task_instances(dag_id, run_id)}")
    return run_id, stack.work_dir / "jobs" / dag_id / run_id, stack.dag_run(dag_id, run_id)


def bench_boundary(stack, spec: dict = BOUNDARY) -> dict:
    """Gaps between segments on the warm instance, split into where the time goes."""
    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    _, job, _ = run_job(stack, spec["dag_id"])
    steps = lineage(read_stamps(job))
    store = open_store(f"file://{job}")
    layout = JobLayout(store)
    per = spec["steps_per_segment"]
    gaps, parts = [], []
    pids = set()
    for k in range(per, spec["total_steps"], per):
        last, first = steps[k - 1], steps[k]
        gaps.append(first[2] - last[3])
        done, nxt = layout.read_status(last[0]), layout.read_status(first[0])
        launch = AttemptLaunch.read(store, first[0])
        if done and nxt and launch:
            parts.append({
                "end save + done report / exit": done.ended_at - last[3],
                "Airflow: status -> next request": launch.requested_at - done.ended_at,
                "agent pick-up (+ hand-over)": nxt.started_at - launch.requested_at,
                "first step (warm) / start + restore": first[2] - nxt.started_at,
            })
        for attempt in (last[0], first[0]):
            hb = layout.read_heartbeat(attempt)
            if hb is not None and hb.pid is not None:
                pids.add(hb.pid)
    attempts = {steps[k][0] for k in range(spec["total_steps"])}
    return {"gaps": gaps, "parts": parts, "segments": len(attempts), "processes": len(pids)}


def bench_recovery(stack) -> dict:
    from airflow_spot.backends.local_state import LocalState

    run_id, job, _ = run_job(stack, RECOVERY["dag_id"])
    stamps = read_stamps(job)
    state = LocalState(stack.local_state_dir)
    kills = sorted(
        r.info.terminated_at for r in (state.read(i) for i in state.instance_ids())
        if r is not None and r.info.job_uri.endswith(f"/{RECOVERY['dag_id']}/{run_id}") and r.info.reason == "preempted"
    )
    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    store = open_store(f"file://{job}")
    layout = JobLayout(store)
    recoveries, lost, direct, parts = [], [], [], []
    for kill in kills:
        after = [s for s in stamps if s[2] > kill]
        before = [s for s in stamps if s[3] <= kill]
        if after:
            recoveries.append(after[0][2] - kill)
            lost.append(before[-1][1] + 1 - after[0][1] if before else 0)
            # False when the next try was itself killed before its first step (then the gap spans two kills)
            direct.append(not any(k2 for k2 in kills if kill < k2 < after[0][2]))
            launch, status = AttemptLaunch.read(store, after[0][0]), layout.read_status(after[0][0])
            if direct[-1] and launch and status:
                parts.append({
                    "kill -> next try's request (incl. 2 s retry delay)": launch.requested_at - kill,
                    "request -> command start (new agent)": status.started_at - launch.requested_at,
                    "command start -> first step": after[0][2] - status.started_at,
                })
    return {"recoveries": recoveries, "steps_redone": lost, "preemptions": len(kills), "direct": direct,
            "parts": parts}


def bench_goodput(stack, spec: dict) -> dict:
    run_id, job, run = run_job(stack, spec["dag_id"])
    stamps = read_stamps(job)
    useful = sum(t1 - t0 for (_, _, t0, t1) in lineage(stamps).values())
    executed = sum(t1 - t0 for (_, _, t0, t1) in stamps)
    from datetime import datetime

    wall = (datetime.fromisoformat(run["end_date"]) - datetime.fromisoformat(run["start_date"])).total_seconds()
    from airflow_spot.storage.ledger_store import LedgerStore
    from airflow_spot.storage.object_store import open_store

    rows = LedgerStore(open_store(f"file://{job}")).rows()
    preemptions = sum(1 for r in rows if r.outcome in ("preempted", "lost"))
    training_wall = max(s[3] for s in stamps) - min(s[2] for s in stamps)
    return {"useful": useful, "executed": executed, "wall": wall, "training_wall": training_wall,
            "preemptions": preemptions, "attempts": len(rows)}


def fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def main_bench(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(E2E))
    from airflow_stack import AirflowStack

    root = Path(args.root or f"/tmp/airflow-spot-bench/run-{time.strftime('%Y%m%d-%H%M%S')}")
    stack = AirflowStack(root=root, dag_files=[E2E / "dags" / "e2e_spot_dags.py"])
    print(f"starting Airflow in {root} ...", flush=True)
    with stack:
        print(f"healthy after {stack.startup_seconds:.1f} s", flush=True)
        write_dags(stack)
        for spec in (BOUNDARY, BOUNDARY_COLD, RECOVERY, GOODPUT, GOODPUT_SMALL):
            stack.wait_dag(spec["dag_id"], timeout=90)
        print("(i) segment boundaries ...", flush=True)
        boundary = bench_boundary(stack)
        boundary_cold = bench_boundary(stack, BOUNDARY_COLD)
        print("(ii) recovery after preemptions ...", flush=True)
        recovery = bench_recovery(stack)
        print("(iii) goodput ...", flush=True)
        goodput = bench_goodput(stack, GOODPUT)
        goodput_small = bench_goodput(stack, GOODPUT_SMALL)
    table = report(boundary, boundary_cold, recovery, goodput, goodput_small)
    if not args.no_tuning:
        print("(i) again, with a faster scheduler loop ...", flush=True)
        table += "\n" + tuned_boundary(root.with_name(root.name + "-tuned"))
    print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(table + "\n")
    print(f"written to {RESULTS}")
    return 0


#: an Airflow setting that shortens the hand-off between segments (default 1 s)
TUNING = {"AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.1"}


def write_dags(stack) -> None:
    (stack.dags_folder / "bench_spot_dags.py").write_text(DAG_FILE.format(
        dags=str(E2E / "dags"), script=str(Path(__file__).resolve()), step=STEP_SECONDS,
        b=BOUNDARY, bc=BOUNDARY_COLD, r=RECOVERY, g=GOODPUT, gs=GOODPUT_SMALL,
    ))


def tuned_boundary(root: Path) -> str:
    """(i) on a second stack with :data:`TUNING`: how much of a boundary is the scheduler's loop."""
    from airflow_stack import AirflowStack

    stack = AirflowStack(root=root, dag_files=[E2E / "dags" / "e2e_spot_dags.py"], extra_env=dict(TUNING))
    with stack:
        write_dags(stack)
        stack.wait_dag(BOUNDARY["dag_id"], timeout=90)
        boundary = bench_boundary(stack)
    settings = ", ".join(f"{k}={v}" for k, v in TUNING.items())
    lines = [f"(i)   with {settings}: {fmt(boundary['gaps'])}"]
    for key in boundary["parts"][0] if boundary["parts"] else ():
        lines.append(f"        {key:<52} {statistics.median(p[key] for p in boundary['parts']):6.2f} s")
    return "\n".join(lines)


def report(boundary: dict, boundary_cold: dict, recovery: dict, goodput: dict, goodput_small: dict) -> str:
    def row(name: str, value: str, target: str, verdict: str) -> str:
        return f"{name:<62} {value:>8}  {target:>8}  {verdict}"

    def seconds(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f} s"

    def ok(value: float | None, target: float, higher: bool = False) -> str:
        if value is None:
            return "n/a"
        return "meets" if (value >= target if higher else value <= target) else "MISSES"

    def breakdown(title: str, parts: list[dict]) -> list[str]:
        if not parts:
            return []
        out = [title]
        for key in parts[0]:
            out.append(f"        {key:<52} {statistics.median(p[key] for p in parts):6.2f} s")
        return out

    b = statistics.median(boundary["gaps"]) if boundary["gaps"] else None
    bc = statistics.median(boundary_cold["gaps"]) if boundary_cold["gaps"] else None
    direct = [v for v, d in zip(recovery["recoveries"], recovery["direct"], strict=True) if d]
    r = statistics.median(direct) if direct else None
    g, gt = goodput["useful"] / goodput["wall"], goodput["useful"] / goodput["training_wall"]
    gs, gst = goodput_small["useful"] / goodput_small["wall"], goodput_small["useful"] / goodput_small["training_wall"]
    demo = (f"{GOODPUT['total_steps']} steps x {STEP_SECONDS} s in "
            f"{GOODPUT['total_steps'] // GOODPUT['steps_per_segment']} segments, MTBF {GOODPUT['mtbf']:.0f} s")
    small = (f"{GOODPUT_SMALL['total_steps']} steps in "
             f"{GOODPUT_SMALL['total_steps'] // GOODPUT_SMALL['steps_per_segment']} segments, "
             f"MTBF {GOODPUT_SMALL['mtbf']:.0f} s")
    lines = [
        f"airflow-spot segment benchmarks, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs; Airflow 3.3.2, PostgreSQL + CeleryExecutor on Redis, separate triggerer; "
        f"local backend; trigger poll 0.5 s; step {STEP_SECONDS} s; warm training process (training/handoff.py) "
        f"unless said otherwise; load average at the end {os.getloadavg()[0]:.1f} (the machine is shared)",
        "",
        f"{'measure':<62} {'value':>8}  {'target':>8}  verdict",
        row("(i) boundary on a warm instance, last step k -> first k+1", seconds(b), "<= 3 s", ok(b, 3)),
        row("      same, warm_process=False (new process per segment)", seconds(bc), "", ok(bc, 3)),
        row("(ii) recovery: SIGKILL -> first resumed step", seconds(r), "<= 10 s", ok(r, 10)),
        row("(iii) goodput at demo scale, useful / DAG run wall", f"{g:.3f}", ">= 0.9", ok(g, 0.9, True)),
        row("      same job, useful / training span", f"{gt:.3f}", ">= 0.9", ok(gt, 0.9, True)),
        row("      small job, useful / DAG run wall", f"{gs:.3f}", "", ok(gs, 0.9, True)),
        row("      small job, useful / training span", f"{gst:.3f}", "", ok(gst, 0.9, True)),
        "",
        f"(i)   {len(boundary['gaps'])} boundaries of a {BOUNDARY['total_steps']}-step job in "
        f"{boundary['segments']} segments, {boundary['processes']} training process(es): {fmt(boundary['gaps'])}",
        f"(i)   warm_process=False: {boundary_cold['segments']} segments, {boundary_cold['processes']} "
        f"processes: {fmt(boundary_cold['gaps'])}",
        f"(ii)  {recovery['preemptions']} preemptions (notice window 0, retry delay 2 s): {fmt(direct)}; "
        f"steps redone {recovery['steps_redone']}"
        + ("" if all(recovery["direct"]) else f"; {recovery['direct'].count(False)} kill(s) followed by another "
           "kill before any step are left out"),
    ]
    lines += breakdown("(ii)  where a recovery's time goes (median over preemptions):", recovery["parts"])
    lines += breakdown("(i)   where a warm boundary's time goes (median over boundaries):", boundary["parts"])
    lines += breakdown("(i)   where a warm_process=False boundary's time goes:", boundary_cold["parts"])
    for name, spec, d in ((f"demo scale ({demo})", GOODPUT, goodput), (f"small ({small})", GOODPUT_SMALL,
                                                                         goodput_small)):
        lines.append(
            f"(iii) {name}: useful {d['useful']:.1f} s, executed {d['executed']:.1f} s, training span "
            f"{d['training_wall']:.1f} s, DAG run wall {d['wall']:.1f} s, {d['preemptions']} preemptions in "
            f"{d['attempts']} attempts (Poisson, MTBF {spec['mtbf']:.0f} s, seed {spec['seed']}, notice window "
            f"{spec['notice']:.0f} s)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode")
    t = sub.add_parser("train", help="(instance side) the stamped training job")
    t.add_argument("--total-steps", type=int, required=True)
    t.add_argument("--step-seconds", type=float, default=STEP_SECONDS)
    p.add_argument("--root", default=None, help="working directory of the Airflow stack")
    p.add_argument("--no-tuning", action="store_true", help="skip (i) on a second stack with a faster scheduler")
    args = p.parse_args(argv)
    if args.mode == "train":
        return train(args.total_steps, args.step_seconds)
    return main_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
