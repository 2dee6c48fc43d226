"""Recovery on the ``ec2`` backend, excluding boot: spot interruption notice -> first resumed step on the
new instance (target <= 10 s), split into its parts.

What runs is the product's own path, as in ``airflow-spot demo --backend ec2 --moto``: ``SpotTraining``
under ``dag.test()`` (a real scheduler loop with its triggers inline) ranks the live ``ec2`` market on
moto's server (127.0.0.1), launches through ``RunInstances``, waits in ``SegmentTrigger`` on the shared
poller; the local data plane (:mod:`airflow_spot.testing.ec2_dataplane`) plays each instance: the agent
starts from the instance's user data, learns who it is from a local IMDSv2, and the n-th instance gets
its interruption notice (``spot/instance-action``) ``--reclaim-after`` seconds after its agent started,
then is terminated with ``Server.SpotInstanceTermination`` after the notice window. The store is a local
directory (``file://``), the training command this script's ``train`` mode: a small torch MLP driven by
``SpotSession`` that stamps its process start, its restore and every step.

Parts of each recovery (instance A noticed, the next try on instance B), from the data plane's clock, the
attempt objects in the store and the stamps:

* notice -> seen by the training process: its IMDS poll (``SPOT_NOTICE_POLL_SECONDS``, default 1 s; AWS suggests 5 s)
  and the step in flight (the heartbeat's ``notice_at``);
* seen -> emergency checkpoint committed, process exited (the agent's status ``ended_at``);
* exit -> the worker accounted the attempt (its ledger row written by ``execute_complete``): the trigger's
  poll and the resumption on a worker;
* accounted -> next try's request written: Airflow's retry (a preemption retries at once, see
  ``operators/retry.py``), the market ranking and ``RunInstances``;
* request -> agent started on B: **boot** (here the data plane noticing the instance and starting the
  agent; on AWS the instance's boot, 30-90 s, which this measure excludes);
* agent started -> command started -> restored -> first step: the agent's pick-up, the interpreter and
  torch import, the restore, the first step.

Run: ``python benchmarks/bench_ec2_recovery.py [--reclaims 3] [--notice-poll 1] [--poll-interval 5]``;
the table is printed and appended to ``benchmarks/results/ec2_recovery.txt``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "ec2_recovery.txt"
REGION = "us-east-1"
IMAGE_ID = "ami-12345678"
DAG_ID = "bench_ec2_recovery"
STAMPS = "stamps.log"


# ------------------------------------------------------------------------------------ instance side
def train(total_steps: int, step_seconds: float) -> int:
    """Deterministic torch MLP; stamps ``start``, ``restored`` and every step into ``<job>/stamps.log``."""
    started = time.time()
    import torch
    from torch import nn

    from airflow_spot.training import SpotSession
    from airflow_spot.training import env as E

    job_dir = Path(os.environ[E.JOB_URI].removeprefix("file://"))
    attempt = os.environ.get(E.ATTEMPT_ID, "manual")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    with open(job_dir / STAMPS, "a", buffering=1) as stamps:
        stamps.write(f"start {attempt} {started:.6f}\n")
        with SpotSession.from_env(total_steps=total_steps) as spot:
            restored = spot.track(model=model, optimizer=opt)
            stamps.write(f"restored {spot.attempt_id} {restored} {time.time():.6f}\n")
            for step in spot.steps():
                t0 = time.time()
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                time.sleep(max(0.0, step_seconds - (time.time() - t0)))
                stamps.write(f"step {spot.attempt_id} {step} {t0:.6f} {time.time():.6f}\n")
    return 0


# ------------------------------------------------------------------------------------ Airflow side
def build_dag(root: Path, args: argparse.Namespace):
    from airflow.sdk import DAG

    from airflow_spot.operators.training import SpotTraining
    from airflow_spot.policy.offers import GpuRequest

    job_path = f"{root}/jobs/{{{{ dag.dag_id }}}}/{{{{ run_id }}}}"
    command = [sys.executable, str(Path(__file__).resolve()), "train", "--total-steps", str(args.total_steps),
               "--step-seconds", str(args.step_seconds)]
    with DAG(DAG_ID, schedule=None, start_date=datetime(2024, 1, 1), catchup=False) as dag:
        SpotTraining(
            task_id="train", command=command, total_steps=args.total_steps, steps_per_segment=args.total_steps,
            gpus=GpuRequest(count=1, min_memory_gib=16), checkpoint_uri=f"file://{job_path}", backend="ec2",
            backend_options={"regions": [REGION], "image_id": IMAGE_ID, "python": sys.executable,
                             "term_grace_seconds": args.notice_window},
            market_options={"regions": [REGION], "price_ttl_seconds": 0},
            max_preemptions=args.reclaims + 3, retries=1, retry_delay=timedelta(seconds=1),
            segment_options={"poll_interval": args.poll_interval, "startup_timeout": 180.0,
                             "heartbeat_timeout": 60.0, "checkpoint_min_interval": 2.0,
                             "notice_window_seconds": args.notice_window, "idle_timeout_seconds": 60.0},
        )
    return dag


def read_stamps(job: Path) -> dict:
    starts, restores, steps = {}, {}, []
    for line in (job / STAMPS).read_text().splitlines():
        kind, attempt, *rest = line.split()
        if kind == "start":
            starts.setdefault(attempt, float(rest[0]))
        elif kind == "restored":
            restores.setdefault(attempt, float(rest[1]))
        elif kind == "step":
            steps.append((attempt, int(rest[0]), float(rest[1]), float(rest[2])))
    return {"start": starts, "restored": restores, "steps": steps}


PARTS = (
    "notice -> seen by the training process",
    "seen -> emergency checkpoint committed, exit",
    "exit -> attempt accounted on the worker",
    "accounted -> next try's request (retry, market, launch)",
    "request -> agent started on the new instance (boot)",
    "agent started -> command started",
    "command started -> restored",
    "restored -> first resumed step",
)


def recoveries(job: Path, plane) -> list[dict]:
    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    store = open_store(f"file://{job}")
    layout = JobLayout(store)
    launches = [AttemptLaunch.read(store, k.split("/")[-2]) for k in JobLayout.attempt_keys(store, JobLayout.LAUNCH_NAME)]
    launches = sorted((la for la in launches if la is not None), key=lambda la: la.requested_at)
    stamps = read_stamps(job)
    out = []
    for a, b in zip(launches, launches[1:]):
        played_a, played_b = plane.played.get(a.instance_id), plane.played.get(b.instance_id)
        status_a, hb_a = layout.read_status(a.attempt_id), layout.read_heartbeat(a.attempt_id)
        if played_a is None or played_a.notice_issued_at is None or played_b is None or status_a is None:
            continue  # not a preemption, or not one this script can take apart
        first = [s for s in stamps["steps"] if s[0] == b.attempt_id]
        if not first or b.attempt_id not in stamps["start"] or b.attempt_id not in stamps["restored"]:
            continue  # the next try was itself reclaimed before its first step
        ledger = job / JobLayout.ledger_key(a.attempt_id)
        t = [played_a.notice_issued_at, getattr(hb_a, "notice_at", None) or float("nan"), status_a.ended_at,
             ledger.stat().st_mtime, b.requested_at, played_b.started_at, stamps["start"][b.attempt_id],
             stamps["restored"][b.attempt_id], first[0][2]]
        parts = {name: t[i + 1] - t[i] for i, name in enumerate(PARTS)}
        total = t[-1] - t[0]
        boot = max(0.0, played_b.started_at - b.requested_at)
        out.append({"attempt": a.attempt_id, "outcome": status_a.outcome, "total": total,
                    "excluding_boot": total - boot, "boot": boot, "parts": parts,
                    "kept_step": status_a.last_committed_step, "redone": (hb_a.step if hb_a else 0)
                    - (status_a.last_committed_step or 0)})
    return out


def main_bench(args: argparse.Namespace) -> int:
    from airflow_spot import demo

    out = Path(args.root or tempfile.mkdtemp(prefix="bench-ec2-recovery-"))
    home = out / "airflow"
    home.mkdir(parents=True, exist_ok=True)
    demo._configure_airflow(home)
    from airflow.utils import db

    from airflow_spot.demo_ec2 import catalog_spot_prices
    from airflow_spot.testing.ec2_dataplane import Ec2DataPlane, set_spot_prices
    from airflow_spot.testing.moto_s3 import moto_server

    schedule = [args.reclaim_after] * args.reclaims + [None]
    with moto_server() as endpoint:
        os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = json.dumps({
            "conn_type": "aws", "login": "testing", "password": "testing",
            "extra": {"region_name": REGION, "endpoint_url": endpoint}})
        set_spot_prices(catalog_spot_prices())
        dag = build_dag(out, args)
        plane = Ec2DataPlane(out / "instances", region=REGION, after_seconds=schedule,
                             notice_window_seconds=args.notice_window,
                             env={"SPOT_NOTICE_POLL_SECONDS": str(args.notice_poll)})
        print(f"running {DAG_ID} on moto {endpoint} ({args.reclaims} reclaims; Airflow log in {out}/dag.log) ...",
              flush=True)
        with plane:
            dag_run, wall = demo.run_quietly(dag, out, out / "dag.log", setup=db.resetdb,
                                             plan=f"{args.reclaims} reclaims")
            leftover = plane.running_instances()
        job = demo.job_dir(out, DAG_ID, dag_run.run_id)
        rows = recoveries(job, plane)
    state = str(dag_run.state)
    text = report(args, rows, state, wall, leftover, plane)
    print(text)
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(text + "\n\n")
    return 0 if rows and "success" in state.lower() else 1


def report(args, rows: list[dict], state: str, wall: float, leftover: list[str], plane) -> str:
    def med(values) -> str:
        values = [v for v in values if v == v]
        return f"{statistics.median(values):6.2f} s" if values else "   n/a"

    total = [r["excluding_boot"] for r in rows]
    verdict = "n/a" if not total else ("meets" if statistics.median(total) <= 10 else "MISSES")
    lines = [
        f"bench_ec2_recovery {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; ec2 backend on moto, local data plane, dag.test(); "
        f"trigger poll {args.poll_interval:g} s, IMDS notice poll {args.notice_poll:g} s, notice window "
        f"{args.notice_window:g} s, step {args.step_seconds:g} s; run {state} in {wall:.1f} s, "
        f"{len(plane.notices)} notices, left running: {', '.join(leftover) or 'none'}",
        f"recovery excluding boot (notice -> first resumed step - boot): median "
        f"{med(total).strip()} over {len(rows)} recoveries (each: "
        f"{', '.join(f'{v:.2f}' for v in total)}); target <= 10 s: {verdict}",
        f"with boot (data plane start, not an AWS boot): {med(r['total'] for r in rows).strip()}",
        "where the time goes (median):",
    ]
    for name in PARTS:
        lines.append(f"  {name:<58} {med(r['parts'][name] for r in rows)}")
    lines.append("outcomes of the reclaimed attempts: " + ", ".join(
        f"{r['attempt']}={r['outcome']} (kept step {r['kept_step']}, redone {r['redone']})" for r in rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode")
    t = sub.add_parser("train", help="(instance side) the stamped training job")
    t.add_argument("--total-steps", type=int, required=True)
    t.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--reclaims", type=int, default=3)
    p.add_argument("--reclaim-after", type=float, default=20.0,
                   help="seconds after an instance's agent starts at which it gets its notice")
    p.add_argument("--notice-window", type=float, default=10.0)
    p.add_argument("--notice-poll", type=float, default=1.0, help="SPOT_NOTICE_POLL_SECONDS (IMDS poll; the agent's default)")
    p.add_argument("--poll-interval", type=float, default=5.0, help="the trigger's poll_interval")
    p.add_argument("--total-steps", type=int, default=1400)
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--root", default=None)
    p.add_argument("--out", default=str(RESULTS), help="'-': stdout only")
    args = p.parse_args(argv)
    if args.mode == "train":
        return train(args.total_steps, args.step_seconds)
    return main_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
