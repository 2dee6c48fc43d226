"""What the Spot Training pages pay to read a deployment's jobs: the list (``/spot/``, ``/spot/api/jobs``)
and a running job's page (``/spot/jobs/{dag}/{run}``, which reloads itself every 5 s).

A deployment that retrains on a schedule piles up finished jobs: the list shows the newest 200 DAG runs.
Before, each row was the job's snapshot read from its store (job record, summary, segment requests,
checkpoint manifests, launches, statuses, heartbeats, ledger rows: a few LISTs and one GET per object),
one job after another, each through a new S3 client, and a job's page read its whole store on every
load. Now (``airflow_spot.ui.jobs``) a finished job's row comes from its summary XCom, which the page has
already read from Airflow's DB; the running jobs' stores are read ``LIST_CONCURRENCY`` at once through
one client per connection; and every read goes through ``PAGE_READS`` (``storage/read_cache.py``): an
object listed with the version an earlier load read is not read again.

On moto's S3 server on 127.0.0.1, the same jobs in the same stores, one after another in one run
(median of ``--repeats``):

* list ``before``: every row a snapshot, in turn, a new client per job; ``now``: ``job_rows`` as the page
  calls it, with an empty cache; ``reload``: the same again, the cache as the previous load left it;
* page ``before``: the running job's snapshot from the store; ``now``: through ``open_view`` with an empty
  cache; ``reload``: after the running attempt wrote one more heartbeat, as it does every few seconds.

The rows and the page read through the cache are asserted equal to those read from the store. Airflow's
DB query is the same for all and not timed. The store is opened with a plain boto3 client instead of the
Amazon provider's hook (no Airflow connection here); the pages' own path through the hook is what
``tests/ui`` and the end-to-end tests run. moto shares this machine's cores; each run is repeated with a
fixed delay added before every S3 request (``--latency-ms``, a botocore ``before-send`` hook): a
stand-in for the network, stated as such, not a measurement of S3.

    python benchmarks/bench_ui_list.py [--finished 100] [--running 8] [--attempts 20] [--page-attempts 200]
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
from botocore.config import Config

from airflow_spot.hooks.spot import SpotHook
from airflow_spot.operators import accounting
from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.operators.segment import newest_usable_step
from airflow_spot.storage.job_view import JobView
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import S3Store
from airflow_spot.storage.protocol import Heartbeat, JobLayout, SegmentRequest
from airflow_spot.storage.read_cache import ReadCache
from airflow_spot.testing.moto_s3 import FAKE_CREDENTIALS, create_bucket, moto_server_process
from airflow_spot.ui import jobs as ui_jobs

BUCKET = "bench-ui-list"
STEPS_PER_ATTEMPT = 100
OFFER = {"instance_type": "g5.xlarge", "region": "us-east-1", "zone": "us-east-1a", "market": "spot",
         "price_per_hour": 0.45, "on_demand_price_per_hour": 1.006, "gpu_name": "A10G", "gpu_count": 1,
         "gpu_memory_gib": 24.0, "relative_throughput": 1.0, "preemption_rate_per_hour": 0.1}


def fill(store: S3Store, attempts: int, finished: bool) -> dict | None:
    """A job of ``attempts`` attempts, one segment each, every other one preempted; the last still running
    unless ``finished`` (then its summary, as the finish task writes and pushes it, is returned)."""
    layout, ledger, t0 = JobLayout(store), LedgerStore(store), 1.8e9
    total = attempts * STEPS_PER_ATTEMPT
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": t0, "total_steps": total, "backend": "ec2"}).encode())
    for i in range(attempts):
        aid, start = f"train.segment_{i:03d}.try1", t0 + i * 3600
        instance = f"i-{i:08x}"
        layout.write_request(instance, SegmentRequest(aid, store.uri, i, i * STEPS_PER_ATTEMPT,
                                                      (i + 1) * STEPS_PER_ATTEMPT, ["python", "train.py"],
                                                      created_at=start, total_steps=total))
        AttemptLaunch(aid, i, i * STEPS_PER_ATTEMPT, (i + 1) * STEPS_PER_ATTEMPT, instance, OFFER, start, start,
                      False, 1, aid.rsplit(".", 1)[0], resume_step=i * STEPS_PER_ATTEMPT).write(store)
        layout.write_heartbeat(Heartbeat(attempt_id=aid, step=(i + 1) * STEPS_PER_ATTEMPT, time=start + 3000,
                                         step_time_ewma=30.0, last_committed_step=(i + 1) * STEPS_PER_ATTEMPT))
        if i < attempts - 1 or finished:
            ledger.write(LedgerRow(aid, instance, "g5.xlarge", "us-east-1a", "spot", 0.45, 1.006, start,
                                   start + 3000, STEPS_PER_ATTEMPT, "preempted" if i % 2 else "completed",
                                   segment_index=i, steps_lost=3 if i % 2 else 0, step_seconds=30.0))
    cps = layout.checkpoint_store(writer="bench")
    for step in (total - 2 * STEPS_PER_ATTEMPT, total - STEPS_PER_ATTEMPT, total):
        cps.save(step, lambda f: f.write(io.BytesIO(b"x" * 4096).getvalue()))
    if not finished:
        return None
    summary = accounting.summarize(store, now=t0 + attempts * 3600)
    summary.update(job_uri=store.uri, total_steps=total, latest_step=newest_usable_step(store),
                   completed=True)
    store.put_bytes(JobLayout.SUMMARY_KEY, json.dumps(summary).encode())
    return summary


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--finished", type=int, default=100)
    ap.add_argument("--running", type=int, default=8)
    ap.add_argument("--attempts", type=int, default=20)
    ap.add_argument("--page-attempts", type=int, default=200, help="attempts of the running job whose page is read")
    ap.add_argument("--latency-ms", default="0,20", help="delays added before every S3 request, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for k, v in FAKE_CREDENTIALS.items():  # moto's
        os.environ.setdefault(k, v)
    print(f"# python benchmarks/bench_ui_list.py --finished {args.finished} --running {args.running} "
          f"--attempts {args.attempts} --page-attempts {args.page_attempts} --latency-ms {args.latency_ms} "
          f"--repeats {args.repeats}  ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs)")
    with moto_server_process() as endpoint:
        create_bucket(endpoint, BUCKET)
        kinds = [True] * args.finished + [False] * args.running

        def one(i: int) -> ui_jobs.JobRef:
            store = S3Store(BUCKET, f"dag/run-{i:04d}", endpoint_url=endpoint)
            summary = fill(store, args.attempts, kinds[i])
            return ui_jobs.JobRef("dag", f"run-{i:04d}", store.uri, None, "success" if kinds[i] else "running",
                                  "ec2", summary)

        with ThreadPoolExecutor(8) as ex:
            refs = list(ex.map(one, range(len(kinds))))
        page_store = S3Store(BUCKET, "dag/page", endpoint_url=endpoint)
        fill(page_store, args.page_attempts, False)
        page_ref = ui_jobs.JobRef("dag", "page", page_store.uri, None, "running", "ec2")
        beat = Heartbeat(attempt_id=f"train.segment_{args.page_attempts - 1:03d}.try1", step=0, time=0.0,
                         step_time_ewma=30.0)
        now = 1.8e9 + max(args.attempts, args.page_attempts) * 3600
        results, beats = [], []
        for ms in (float(m) for m in args.latency_ms.split(",")):
            def client():  # sized as SpotHook sizes the page's client
                c = boto3.client("s3", endpoint_url=endpoint,
                                 config=Config(max_pool_connections=SpotHook.S3_POOL_CONNECTIONS))
                if ms:
                    c.meta.events.register("before-send.s3", lambda **_: time.sleep(ms / 1000))
                return c

            def raw_store(job, shared=None):  # the hook's store, a boto3 client in place of the hook's
                return S3Store(BUCKET, job.job_uri.split("/", 3)[3], client=shared or client())

            def before_rows():  # as the list read every job before: a snapshot each, in turn, a new client each
                return [{**{"dag_id": j.dag_id, "run_id": j.run_id, "job_uri": j.job_uri, "run_state": j.run_state},
                         **{k: v for k, v in JobView(raw_store(j)).snapshot(now, with_estimate=False).items()
                            if k in ui_jobs.ROW_FIELDS}} for j in refs]

            shared = client()
            ui_jobs._open_store = lambda job, hooks: raw_store(job, shared)

            def now_rows(cold: bool):
                if cold:
                    ui_jobs.PAGE_READS = ReadCache()
                return ui_jobs.job_rows(refs, now)

            t_before, rows_before = timed(before_rows, args.repeats)
            t_cold, rows_cold = timed(lambda: now_rows(True), args.repeats)
            t_warm, rows_warm = timed(lambda: now_rows(False), args.repeats)
            # the rows are the same, whichever way they were read
            assert rows_before == rows_cold == rows_warm, next(
                (a, b) for a, b in zip(rows_before, rows_cold) if a != b)

            def page(cold: bool):
                if cold:
                    ui_jobs.PAGE_READS = ReadCache()
                else:  # the running attempt beat since the last load, as it does every few seconds
                    beats.append(len(beats))
                    hb = dataclasses.replace(beat, step=len(beats), time=now - 60 + len(beats))
                    page_store.put_bytes(JobLayout.heartbeat_key(hb.attempt_id), hb.to_json())
                return ui_jobs.open_view(page_ref).snapshot(now)

            p_before, snap_before = timed(lambda: JobView(raw_store(page_ref)).snapshot(now), args.repeats)
            p_cold, _ = timed(lambda: page(True), args.repeats)
            p_warm, snap_warm = timed(lambda: page(False), args.repeats)
            assert snap_warm == JobView(raw_store(page_ref)).snapshot(now)
            results.append((ms, t_before, t_cold, t_warm, p_before, p_cold, p_warm))
        print(f"list: {len(refs)} jobs ({args.finished} finished, {args.running} running), {args.attempts} attempts "
              f"each; page: one running job of {args.page_attempts} attempts")
        print(f"{'added ms':>8} | {'list before s':>13} {'now s':>7} {'reload s':>8} | "
              f"{'page before s':>13} {'now s':>7} {'reload s':>8}")
        for ms, *t in results:
            print(f"{ms:>8g} | {t[0]:>13.3f} {t[1]:>7.3f} {t[2]:>8.3f} | {t[3]:>13.3f} {t[4]:>7.3f} {t[5]:>8.3f}")


if __name__ == "__main__":
    main()
