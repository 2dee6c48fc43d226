"""What a segment start pays to read the job's own records from S3, one GET after another or several at once.

Every segment start reads the job's ledger (one object per attempt) and the heartbeats of its recent
attempts (the measured step time: ``planning.RECENT_HEARTBEATS`` accounted ones and any running; before
2026-11-26, every attempt's). A job of A attempts is A + 8 small GETs. Side by side, in one run, on moto's S3 server on 127.0.0.1: ``ObjectStore.get_many`` as
every store had it (one after another) against ``S3Store.get_many`` (``GET_CONCURRENCY`` at once).
moto answers on loopback, sharing this machine's cores with the client; S3's latency is not there, so
each run is repeated with a fixed delay added before every request (``--latency-ms``, a botocore
``before-send`` hook): a stand-in for the network, stated as such, not a measurement of S3.

    python benchmarks/bench_job_reads.py [--attempts 50,250] [--latency-ms 0,20] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from airflow_spot.operators import accounting, planning
from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.operators.restart_budget import read_fresh_start_beats
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import ObjectStore, S3Store
from airflow_spot.storage.protocol import Heartbeat, JobLayout
from airflow_spot.testing.moto_s3 import FAKE_CREDENTIALS, create_bucket, moto_server_process


class OneByOne(S3Store):
    """The same store, reading many objects one after another (the base class's ``get_many``)."""

    def get_many(self, keys):
        return ObjectStore.get_many(self, keys)


def fill(store: S3Store, attempts: int) -> None:
    layout, ledger = JobLayout(store), LedgerStore(store)

    def one(i: int) -> None:
        aid = f"train.segment_{i // 2:03d}.try{i % 2 + 1}"
        t = 1.8e9 + i * 900
        layout.write_heartbeat(Heartbeat(attempt_id=aid, step=i * 100, time=t, step_time_ewma=0.5))
        ledger.write(LedgerRow(aid, f"i-{i:08x}", "p3.2xlarge", "us-west-2b", "spot", 0.9731, 3.06, t, t + 800,
                               100, "completed"))

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(one, range(attempts)))


def segment_start_reads(store: S3Store) -> tuple[int, float | None]:
    """What a segment start reads of the job's own records: its ledger, the newest step time and the launch
    record of the attempt that measured it (its instance's throughput), and since 2026-11-27 the heartbeats
    of its recent fresh starts (the measured restart, ``operators/restart_budget.py``)."""
    rows = accounting.read_rows(store)
    beat = planning.measured_step(JobLayout(store), rows)
    AttemptLaunch.read(store, beat.attempt_id)
    read_fresh_start_beats(store, rows)
    return len(rows), beat.step_time_ewma


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attempts", default="50,250")
    ap.add_argument("--latency-ms", default="0,20", help="delays added before every S3 request, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for k, v in FAKE_CREDENTIALS.items():  # moto's
        os.environ.setdefault(k, v)
    print(f"# python benchmarks/bench_job_reads.py --attempts {args.attempts} --latency-ms {args.latency_ms} "
          f"--repeats {args.repeats}  ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs)")
    print(f"{'attempts':>8} {'added ms':>8} {'one by one s':>13} {'at once s':>10} {'x faster':>9}")
    with moto_server_process() as endpoint:
        create_bucket(endpoint, "bench-job-reads")
        for attempts in (int(a) for a in args.attempts.split(",")):
            prefix = f"dag/run-{attempts}"
            fill(S3Store("bench-job-reads", prefix, endpoint_url=endpoint), attempts)
            for ms in (float(m) for m in args.latency_ms.split(",")):
                stores = [cls("bench-job-reads", prefix, endpoint_url=endpoint) for cls in (OneByOne, S3Store)]
                for st in stores:
                    if ms:
                        st.client.meta.events.register("before-send.s3", lambda ms=ms, **_: time.sleep(ms / 1000))
                times: list[list[float]] = [[], []]
                for r in range(args.repeats):
                    order = (0, 1) if r % 2 == 0 else (1, 0)  # who goes first alternates
                    for i in order:
                        t = time.perf_counter()
                        got = segment_start_reads(stores[i])
                        times[i].append(time.perf_counter() - t)
                        assert got == (attempts, 0.5), got
                seq, par = (statistics.median(t) for t in times)
                print(f"{attempts:>8} {ms:>8g} {seq:>13.3f} {par:>10.3f} {seq / par:>9.1f}")


if __name__ == "__main__":
    main()
