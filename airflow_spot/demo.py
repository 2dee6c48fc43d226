"""``airflow-spot demo``: train a small torch model through injected preemptions under real Airflow.

The demo needs nothing but this package: it makes an Airflow home in an output directory, migrates a
sqlite metadata DB there, builds the ``spot_training_demo`` DAG (the same one ``dags/`` ships) and runs it
with ``dag.test()`` — a real scheduler loop with its triggers run inline — on the ``local`` backend, whose
instances are process groups of this machine and whose preemption injector preempts the first launches on
a fixed schedule. It then prints what the job did and what it would have cost on the simulated market.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

DEMO_DAG_ID = "spot_training_demo"
#: seconds after each launched instance starts running at which the injector preempts it (null: never).
#: An instance that finishes its segment between its notice and its kill is not preempted (and not
#: reused); that can happen at most once per segment boundary, so five planned give at least three.
DEFAULT_SCHEDULE = (4.0, 4.0, 4.0, 4.0, 4.0, None)
#: time between the injector's notice and its kill (AWS gives 120 s; the demo is time-compressed)
NOTICE_WINDOW_SECONDS = 5.0

#: the demo's segment settings: a fast poll and short windows for a job of minutes
SEGMENT_OPTIONS = {
    "poll_interval": 0.5,
    "startup_timeout": 120.0,
    "heartbeat_timeout": 60.0,
    "checkpoint_min_interval": 2.0,
    "notice_window_seconds": NOTICE_WINDOW_SECONDS,
    "idle_timeout_seconds": 60.0,
}
#: the demo script writes the final model here, inside the job's directory
FINAL_WEIGHTS = "final_weights.pt"


def demo_root() -> Path:
    """Where the demo keeps checkpoints and instance state: ``$AIRFLOW_SPOT_DEMO_DIR`` or the Airflow home."""
    root = os.environ.get("AIRFLOW_SPOT_DEMO_DIR") or os.path.join(
        os.environ.get("AIRFLOW_HOME") or os.path.expanduser("~/airflow"), "spot-demo"
    )
    return Path(root)


def train_command(total_steps: int, step_sleep: float, final_weights: str) -> list[str]:
    return [
        sys.executable, "-m", "airflow_spot.examples.train_tiny",
        "--total-steps", str(total_steps),
        "--step-sleep", str(step_sleep),
        "--final-weights", final_weights,
    ]


def build_demo_dag(
    *,
    dag_id: str = DEMO_DAG_ID,
    root: str | os.PathLike | None = None,
    total_steps: int = 600,
    steps_per_segment: int = 200,
    step_sleep: float = 0.03,
    preemption_schedule: tuple[float | None, ...] | list[float | None] = DEFAULT_SCHEDULE,
    preemption: dict[str, Any] | None = None,
    max_preemptions: int = 8,
    retries: int = 1,
    command: list[str] | None = None,
    checkpoint_uri: str | None = None,
    backend: str = "local",
    backend_options: dict[str, Any] | None = None,
    market_options: dict[str, Any] | None = None,
):
    """The demo DAG: ``SpotTraining`` of ``train_tiny`` on the local backend with scheduled preemptions.

    :param root: directory for checkpoints (``<root>/jobs/<dag>/<run>``) and the local backend's state.
    :param preemption_schedule: the injector's ``after_seconds``: one entry per launched instance.
    :param preemption: a full injector config instead (e.g. ``{"mode": "rate", "mtbf_seconds": 120}``).
    """
    from airflow.sdk import DAG

    from airflow_spot.operators.training import SpotTraining
    from airflow_spot.policy.offers import GpuRequest

    root = Path(root) if root is not None else demo_root()
    job_path = f"{root}/jobs/{{{{ dag.dag_id }}}}/{{{{ run_id }}}}"
    with DAG(
        dag_id,
        schedule=None,
        start_date=datetime(2024, 1, 1),
        catchup=False,
        tags=["airflow-spot", "demo"],
        doc_md=__doc__,
    ) as dag:
        SpotTraining(
            task_id="train",
            command=command or train_command(total_steps, step_sleep, f"{job_path}/{FINAL_WEIGHTS}"),
            total_steps=total_steps,
            steps_per_segment=steps_per_segment,
            gpus=GpuRequest(count=1, min_memory_gib=16),
            checkpoint_uri=checkpoint_uri or f"file://{job_path}",
            backend=backend,
            # another backend (``demo --backend ec2 --moto``, see demo_ec2.py) brings its own options
            backend_options=backend_options if backend != "local" else {
                "state_dir": str(root / "instances"),
                "preemption": preemption or {"mode": "schedule", "after_seconds": list(preemption_schedule)},
                "notice_window_seconds": NOTICE_WINDOW_SECONDS,
            },
            market_options=market_options,
            max_preemptions=max_preemptions,
            retries=retries,
            retry_delay=timedelta(seconds=1),
            segment_options=dict(SEGMENT_OPTIONS),
        )
    return dag


# ---------------------------------------------------------------------------------------- command
#: bounds on the demo's own figures: it is a run of a minute or two, not a training job
MAX_STEP_SLEEP = 10.0
MAX_DEMO_STEPS = 1_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out/demo", help="directory for the Airflow home, checkpoints and logs")
    parser.add_argument("--total-steps", type=int, default=600, help="training steps of the whole job")
    parser.add_argument("--steps-per-segment", type=int, default=200,
                        help="steps per segment (one Airflow task each)")
    parser.add_argument("--step-sleep", type=float, default=0.03, help="seconds per step on top of the compute")
    parser.add_argument(
        "--preempt-after", default=None, type=_seconds_list,
        help="comma-separated seconds after which the 1st, 2nd, ... launched instance is preempted "
             "(default: 4,4,4,4,4)",
    )
    parser.add_argument(
        "--mtbf", type=float, default=None,
        help="instead of the schedule: preempt at random (Poisson, seeded) with this mean time between "
             "preemptions, in seconds",
    )
    parser.add_argument("--verify", action="store_true", help="also train uninterrupted and compare the weights")
    parser.add_argument("--backend", choices=("local", "ec2"), default="local",
                        help="ec2 needs --moto here: EC2 played by moto's server and a local data plane")
    parser.add_argument("--moto", action="store_true", help="with --backend ec2: run against moto on 127.0.0.1")
    parser.add_argument(
        "--log-file", default=None,
        help="where Airflow's own log lines and the expected preemption tracebacks go (default: <out>/demo.log)",
    )
    parser.add_argument("--verbose", action="store_true", help="show Airflow's log lines on the terminal instead")


def _seconds_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated seconds like 6,6,6, got {text!r}") from None
    if any(not (0 <= v < math.inf) for v in values):
        raise argparse.ArgumentTypeError(f"seconds must be finite and >= 0, got {text!r}")
    return values


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the demo's arguments (None when nothing is): checked before anything runs."""
    if args.mtbf is not None and not 0 < args.mtbf < math.inf:
        return (f"--mtbf is the mean seconds between random preemptions and must be > 0 and finite, got "
                f"{args.mtbf:g} (leave --mtbf out for the default schedule, or --preempt-after '' for none)")
    if args.mtbf is not None and args.preempt_after is not None:
        return "--mtbf (random preemptions) and --preempt-after (a schedule) exclude each other; give one"
    if not 0 <= args.step_sleep <= MAX_STEP_SLEEP:
        return (f"--step-sleep is seconds per step and must be between 0 and {MAX_STEP_SLEEP:g} (the demo is a "
                f"short run), got {args.step_sleep:g}")
    for flag, value in (("--total-steps", args.total_steps), ("--steps-per-segment", args.steps_per_segment)):
        if not 0 < value <= MAX_DEMO_STEPS:
            return (f"{flag} must be between 1 and {MAX_DEMO_STEPS} (the demo is a short run; declare a real job "
                    f"with SpotTraining in a DAG), got {value}")
    if args.moto and getattr(args, "backend", "local") != "ec2":
        return "--moto plays EC2 and applies to --backend ec2 only; add --backend ec2 or drop --moto"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _argument_problem(args)
    if problem:
        print(f"airflow-spot demo: {problem}", file=sys.stderr)
        return 2
    if getattr(args, "backend", "local") != "local":
        if not args.moto:
            print("airflow-spot demo: --backend ec2 runs only against moto here; add --moto", file=sys.stderr)
            return 2
        from airflow_spot.demo_ec2 import run_on_moto

        return run_on_moto(args)
    if args.preempt_after is None:
        args.preempt_after = [4.0] * 5
    out = Path(args.out).resolve()
    home = out / "airflow"
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a folder must be, no permission
        print(f"airflow-spot demo: --out {args.out}: cannot create {home} ({exc.strerror or exc}); give a folder "
              "that can be created or written", file=sys.stderr)
        return 2
    _configure_airflow(home)
    schedule = list(args.preempt_after) + [None]
    preemption = {"mode": "rate", "mtbf_seconds": args.mtbf, "seed": 1} if args.mtbf else None
    started = time.monotonic()
    from airflow.utils import db

    from airflow_spot.operators.validation import SpotTrainingConfigError

    try:
        dag = build_demo_dag(
            root=out,
            total_steps=args.total_steps,
            steps_per_segment=args.steps_per_segment,
            step_sleep=args.step_sleep,
            preemption_schedule=schedule,
            preemption=preemption,
            max_preemptions=max(len(schedule) + 2, 8) if preemption is None else 100,
        )
    except (SpotTrainingConfigError, ValueError) as exc:
        print(f"airflow-spot demo: {exc}", file=sys.stderr)
        return 2
    log_file = Path(args.log_file).resolve() if args.log_file else out / "demo.log"
    print(f"airflow-spot demo: Airflow home {home}; migrating a fresh metadata DB ...", flush=True)
    if not args.verbose:
        print(f"  Airflow's log lines and the tracebacks of the expected preemptions go to {log_file}", flush=True)
    plan = (
        f"random preemptions, MTBF {args.mtbf:g} s" if preemption
        else f"up to {len(schedule) - 1} preemptions scheduled"
    )
    if args.verbose:
        db.resetdb()
        print(f"running DAG {dag.dag_id} ({plan}) ...", flush=True)
        run_started = time.monotonic()
        dag_run = run_dag_test(dag)
        wall = time.monotonic() - run_started
    else:
        dag_run, wall = run_quietly(dag, out, log_file, setup=db.resetdb, plan=plan)
    summary = read_summary(out, dag.dag_id, dag_run.run_id)
    weights = job_dir(out, dag.dag_id, dag_run.run_id) / FINAL_WEIGHTS
    print(report(dag_run.state, summary, wall, time.monotonic() - started,
                 logs="on the terminal above" if args.verbose else f"in {log_file}"))
    print(economics_lines())
    print(f"  job store           {job_dir(out, dag.dag_id, dag_run.run_id)}")
    print(f"  instance logs       {out / 'instances' / 'instances'}/<instance>/attempts/<attempt>.log")
    ok = str(dag_run.state) in ("success", "DagRunState.SUCCESS")
    if args.verify and ok:
        ok = verify_weights(weights, args.total_steps, out / "reference") and ok
    return 0 if ok else 1


def _configure_airflow(home: Path) -> None:
    os.environ["AIRFLOW_HOME"] = str(home)
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(home / "dags")
    (home / "dags").mkdir(exist_ok=True)
    if "airflow" in sys.modules:
        raise RuntimeError("airflow was imported before the demo chose its AIRFLOW_HOME; run `airflow-spot demo` fresh")


def run_quietly(dag, out: Path, log_file: Path, setup, plan: str):
    """``setup()`` then ``dag.test()`` with Airflow's output in ``log_file`` and one line per segment attempt on
    the terminal. Returns the DAG run and the wall time of ``dag.test()``."""
    from airflow_spot.demo_console import ProgressPrinter, quiet_output

    with quiet_output(log_file) as console:
        setup()
        print(f"running DAG {dag.dag_id} ({plan}) ...", file=console)
        with ProgressPrinter(out / "jobs" / dag.dag_id, console):
            started = time.monotonic()
            dag_run = run_dag_test(dag)
            return dag_run, time.monotonic() - started


def economics_lines() -> str:
    """What the same policy saves on the 48 h reference job of the bundled spot traces (replayed now)."""
    from airflow_spot.demo_console import simulated_savings

    sim = simulated_savings()
    if "error" in sim:
        return f"  at scale            (the trace replay could not run here: {sim['error']})"
    pad = " " * 22
    return (
        f"  at scale            the same policy ('{sim['policy']}') on the bundled AWS traces "
        f"({len(sim['zones'])} zones),"
        f" a {sim['work_hours']:g} GPU-hour job with a {sim['deadline_hours']:g} h deadline:\n"
        f"{pad}started at each of {sim['starts']} hours, it costs {sim['mean_ratio']:.2f}x the on-demand cost "
        f"on average ({sim['best_ratio']:.2f}x-{sim['worst_ratio']:.2f}x), deadline met {sim['deadlines_met']} "
        f"of {sim['starts']};\n"
        f"{pad}started at hour 0, ${sim['cost']:.2f} against ${sim['on_demand_cost']:.2f} on demand, "
        f"{100 * sim['savings_fraction']:.0f} % saved through {sim['preemptions']} preemptions\n"
        f"{pad}(replayed in {sim['seconds']:.1f} s; `airflow-spot simulate --work-hours 48 --deadline-hours 52 "
        "--offsets` compares every policy)"
    )


def run_dag_test(dag, **kwargs):
    """Serialise a DAG that is not in the DAGs folder into the DB (NOTES.md), then ``dag.test()`` it."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(dag_folder=os.devnull)
    bag.bag_dag(dag)
    sync_bag_to_db(bag, "dags-folder", None)
    return dag.test(**kwargs)


def job_dir(root: Path, dag_id: str, run_id: str) -> Path:
    return Path(root) / "jobs" / dag_id / run_id


def read_summary(root: Path, dag_id: str, run_id: str) -> dict[str, Any]:
    from airflow_spot.operators.training import SUMMARY_KEY
    from airflow_spot.storage.object_store import ObjectNotFound, open_store

    store = open_store(f"file://{job_dir(root, dag_id, run_id)}")
    try:
        return json.loads(store.get_bytes(SUMMARY_KEY))
    except ObjectNotFound:
        return {}


def report(state: Any, s: dict[str, Any], wall: float, total: float, logs: str = "in the task logs") -> str:
    from airflow_spot.operators.training import format_summary
    from airflow_spot.policy.ledger import AWS_MINIMUM_BILLED_SECONDS, LedgerRow, credited_seconds

    state = getattr(state, "value", state)
    lines = [f"\nDAG run: {state}   (wall time {wall:.1f} s; with DB setup {total:.1f} s)"]
    if not s:
        return "\n".join(lines + [f"  no job summary was written: the tasks' errors are {logs}"])
    lines.append(format_summary(s))
    rows = s.get("rows") or []
    same_time_on_demand = sum(r["billed_seconds"] * r["on_demand_price_per_hour"] / 3600.0 for r in rows)
    if same_time_on_demand > 0:
        discount = 1.0 - sum(r["cost"] for r in rows) / same_time_on_demand
        lines.append(f"  spot discount       {100 * discount:.1f} % on the attempts' billed time")
        ledger = [LedgerRow.from_dict(r) for r in rows]
        thrown = sum(row.billed_seconds - credited_seconds(row, ledger) for row in ledger)
        idle = (s.get("probe_dollars") or 0.0) + (s.get("idle_dollars") or 0.0)
        why = ([f"{thrown:.0f} s of paid time that kept no work (preemptions' lost steps and restarts, failed or killed\n"
                   "                      attempts)"] if thrown > 0 else []) + (
            [f"${idle:.4f} of instances that ran no attempt (probes, warm ones idle at the end)"] if idle > 0 else [])
        here = ("Here\n                      " + " and ".join(why) + " earn nothing:\n                      "
                "why savings sit below the spot discount." if why else
                "No attempt\n                      was cut short here: the savings are the spot discount.")
        lines.append(
            "  how savings count   savings = what on-demand pays for the same work, minus what was paid: a\n"
            "                      completed attempt's whole time, only the kept steps of a preempted one and\n"
            f"                      of the attempt that restarted its segment after it. {here}"
        )
        short = sum(row.new_instance and row.duration_seconds < AWS_MINIMUM_BILLED_SECONDS for row in ledger)
        if short:
            lines.append(f"                      {short} of the {len(ledger)} attempts ran shorter than the "
                         f"{AWS_MINIMUM_BILLED_SECONDS:.0f} s AWS bills a new\n"
                         "                      instance at least: a job this short pays that minimum again at "
                         "each preemption.")
    useful = s.get("useful_step_seconds")
    if useful:
        lines.append(f"  goodput             {useful / wall:.2f} (time in kept training steps / wall time)")
    return "\n".join(lines)


def verify_weights(weights: Path, total_steps: int, ref_dir: Path) -> bool:
    """Train the same script uninterrupted and compare the final weights bit for bit."""
    import subprocess

    import torch

    ref_dir.mkdir(parents=True, exist_ok=True)
    ref = ref_dir / "weights.pt"
    cmd = train_command(total_steps, 0.0, str(ref)) + ["--job-uri", str(ref_dir / "job")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_")}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    a, b = torch.load(weights), torch.load(ref)
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"  final weights       {'identical to' if equal else 'DIFFERENT from'} an uninterrupted run")
    return equal
