"""Latencies of the local backend, measured side by side in one run.

* launch -> pickup: from calling ``launch()`` (then writing a request at once) to the agent starting the
  request's command (``AttemptStatus.started_at``), no simulated boot time;
* warm pickup: from writing a request to an idle, warm instance to the agent starting it, for several
  agent poll intervals;
* notice -> kill recorded: from the injector's notice to the instance being recorded as terminated by
  preemption, minus the configured notice window (the injector's own overhead).

Run: ``python benchmarks/bench_local_backend.py [--repeats N]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from airflow_spot.backends.base import LaunchSpec, get_backend
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout, SegmentRequest

OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.40, 1.006, "A10G", 1, 24.0)


def wait_status(layout: JobLayout, attempt_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = layout.read_status(attempt_id)
        if status is not None:
            return status
        time.sleep(0.01)
    raise TimeoutError(f"no status for {attempt_id} within {timeout} s")


def request(job_uri: str, attempt_id: str, command: list[str]) -> SegmentRequest:
    return SegmentRequest(attempt_id=attempt_id, job_uri=job_uri, segment_index=0, start_step=0, end_step=1,
                          command=command, created_at=time.time())


def summary(name: str, values: list[float]) -> float:
    med = statistics.median(values)
    print(f"{name:<44} median {med * 1000:7.1f} ms   min {min(values) * 1000:7.1f}   max {max(values) * 1000:7.1f}"
          f"   (n={len(values)})")
    return med


def bench_launch_pickup(root: str, repeats: int) -> list[float]:
    backend = get_backend("local", state_dir=f"{root}/state-launch")
    out = []
    for i in range(repeats):
        job = f"file://{root}/job-launch-{i}"
        layout = JobLayout(open_store(job))
        t0 = time.time()
        info = backend.launch(LaunchSpec(offer=OFFER, job_uri=job, idempotency_token=f"l{i}", idle_timeout_seconds=30))
        layout.write_request(info.instance_id, request(job, "a", ["true"]))
        out.append(wait_status(layout, "a").started_at - t0)
        backend.terminate([info.instance_id])
    return out


def bench_warm_pickup(root: str, repeats: int, poll: float) -> list[float]:
    backend = get_backend("local", state_dir=f"{root}/state-warm-{poll}", poll_interval_seconds=poll)
    job = f"file://{root}/job-warm-{poll}"
    layout = JobLayout(open_store(job))
    info = backend.launch(LaunchSpec(offer=OFFER, job_uri=job, idempotency_token="w", idle_timeout_seconds=60))
    out = []
    try:
        for i in range(repeats):
            # land at a random phase of the agent's poll loop, as a real request would
            time.sleep(0.3 + (i % 7) * poll / 7)
            req = request(job, f"w{i}", ["true"])
            layout.write_request(info.instance_id, req)
            out.append(wait_status(layout, req.attempt_id).started_at - req.created_at)
    finally:
        backend.terminate([info.instance_id])
    return out


def bench_notice_to_kill(root: str, repeats: int, window: float) -> list[float]:
    backend = get_backend("local", state_dir=f"{root}/state-kill",
                          preemption={"mode": "schedule", "after_seconds": [0.5] * repeats},
                          notice_window_seconds=window)
    job = f"file://{root}/job-kill"
    layout = JobLayout(open_store(job))
    infos = []
    for i in range(repeats):
        info = backend.launch(LaunchSpec(offer=OFFER, job_uri=job, idempotency_token=f"k{i}", idle_timeout_seconds=60))
        sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
        layout.write_request(info.instance_id, request(job, f"k{i}", sleeper))
        infos.append(info)
    out = []
    deadline = time.monotonic() + 60
    pending = {i.instance_id for i in infos}
    while pending and time.monotonic() < deadline:
        for iid, info in backend.describe(sorted(pending)).items():
            if info.state.is_terminal():
                pending.discard(iid)
                out.append(info.terminated_at - info.notice_at - window)
        time.sleep(0.05)
    backend.terminate(sorted(pending))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-local-") as root:
        launch = summary("launch -> command started (no boot time)", bench_launch_pickup(root, args.repeats))
        warm = {}
        for poll in (0.1, 0.2, 0.5):
            warm[poll] = summary(f"warm pickup, agent poll {poll:.1f} s", bench_warm_pickup(root, args.repeats, poll))
        kill = summary("notice -> kill recorded, beyond a 1 s window",
                       bench_notice_to_kill(root, min(args.repeats, 5), 1.0))
    print()
    for poll, med in warm.items():
        print(f"warm pickup / poll interval at {poll:.1f} s: {med / poll:.2f} (0.5 = pure polling delay)")
    print(f"launch pickup / warm pickup (0.2 s poll): {launch / warm[0.2]:.1f}x")
    print(f"injector overhead / notice window: {kill / 1.0:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
