"""What a job pays to read the deployment's availability log at a decision, as the log grows.

The operators read the log at every decision (each segment start, and again after probes or capacity
refusals). Side by side, in one run, on moto's S3 server on 127.0.0.1, the same events written in both
layouts (:mod:`airflow_spot.storage.availability`):

* ``first layout``: ``<pool>/<time>-<job>-<nonce>.json``, read as the operators read it before this
  benchmark existed: list the whole log, one GET per entry (``AvailabilityLog.read()`` on such entries);
* ``names, every pool``: the current layout, read as the operators read it now: the events come from
  the names, one body per pool for its exact name (``read()``);
* ``names, offered pools``: only the offered pools' folders listed, no body read (``read(pools=...)``);
* ``names, last 24 h``: the same from a time on (``read(pools=..., since=now - 24 h)``; S3 lists from
  ``StartAfter``).

Events: ``--events`` spread evenly over ``--days`` across 8 pools of which the job is offered 4, written
by 20 jobs. moto answers on loopback in about a millisecond; S3 adds its own latency to every request, so
the GET-per-event reader loses more there.

Then the log of a deployment whose ``--probing-jobs`` jobs each probe the four bundled spot-trace pools
every 15 minutes for ``--probing-hours`` (what the pool's trace says at that moment: ``probe-up`` or
``probe-down``), read before and after :meth:`AvailabilityLog.compact`; the pools' states a decision
concludes from it are checked equal.

    python benchmarks/bench_availability_log.py [--events 1000,5000] [--days 30] [--repeats 3]
        [--probing-jobs 5] [--probing-hours 48]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from airflow_spot.market.traces import PREEMPTION_TRACES_SUBDIR, default_traces_dir, load_traces
from airflow_spot.policy.observations import PoolEvent, pool_views
from airflow_spot.storage.availability import COMPACT_AFTER_HOURS, AvailabilityLog
from airflow_spot.storage.object_store import S3Store
from airflow_spot.storage.protocol import safe_id
from airflow_spot.testing.moto_s3 import FAKE_CREDENTIALS, create_bucket, moto_server_process

OFFERED = [f"p3.2xlarge@us-west-2{z}" for z in "abcd"]
POOLS = OFFERED + [f"g5.xlarge@us-east-1{z}" for z in "abcd"]
KINDS = ["launched", "refused", "preempted", "probe-up", "probe-down"]
NOW = 1_800_000_000.0


def first_layout_key(event: PoolEvent) -> str:
    """The name an entry had before the names carried the event (still read, one GET each)."""
    return f"{safe_id(event.pool)}/{event.at:017.3f}-{safe_id(event.job or 'job')}-{uuid.uuid4().hex[:12]}.json"


def write(store: S3Store, events: list[PoolEvent], first_layout: bool) -> None:
    log = AvailabilityLog(store)

    def one(e: PoolEvent) -> None:
        if first_layout:
            body = {"schema": 1, "pool": e.pool, "kind": e.kind, "at": e.at, "job": e.job}
            store.put_bytes(first_layout_key(e), json.dumps(body).encode())
        else:
            log.append(e)

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(one, events))


def timed(fn, repeats: int) -> tuple[float, int]:
    times, n = [], 0
    for _ in range(repeats):
        t = time.perf_counter()
        n = len(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times), n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", default="1000,5000", help="log sizes, comma-separated")
    ap.add_argument("--days", type=float, default=30.0, help="the events spread over this many days before now")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--probing-jobs", type=int, default=5, help="jobs probing every pool every 15 min (0: skip)")
    ap.add_argument("--probing-hours", type=float, default=48.0)
    args = ap.parse_args()
    for k, v in FAKE_CREDENTIALS.items():  # moto's
        os.environ.setdefault(k, v)
    print(f"# python benchmarks/bench_availability_log.py --events {args.events} --days {args.days:g} "
          f"--repeats {args.repeats} --probing-jobs {args.probing_jobs} --probing-hours {args.probing_hours:g}"
          f"  ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs)")
    print(f"{'events':>7} {'reader':<26} {'seconds':>8} {'read':>6} {'x faster':>9}")
    with moto_server_process() as endpoint:
        create_bucket(endpoint, "bench-availability")
        for n in (int(x) for x in args.events.split(",")):
            rnd = random.Random(n)
            events = [PoolEvent(rnd.choice(POOLS), rnd.choice(KINDS), NOW - rnd.uniform(0, args.days * 86400),
                                f"dag.run-{rnd.randint(1, 20)}") for _ in range(n)]
            old = S3Store("bench-availability", f"{n}/first", endpoint_url=endpoint)
            new = S3Store("bench-availability", f"{n}/names", endpoint_url=endpoint)
            write(old, events, first_layout=True)
            write(new, events, first_layout=False)
            base, got = timed(lambda: AvailabilityLog(old).read(until=NOW), args.repeats)
            print(f"{n:>7} {'first layout (every GET)':<26} {base:>8.3f} {got:>6} {1.0:>9.1f}")
            t, got = timed(lambda: AvailabilityLog(new).read(until=NOW), args.repeats)
            print(f"{n:>7} {'names, every pool':<26} {t:>8.3f} {got:>6} {base / t:>9.1f}")
            t, got = timed(lambda: AvailabilityLog(new).read(until=NOW, pools=OFFERED), args.repeats)
            print(f"{n:>7} {'names, offered pools':<26} {t:>8.3f} {got:>6} {base / t:>9.1f}")
            t, got = timed(lambda: AvailabilityLog(new).read(since=NOW - 86400, until=NOW, pools=OFFERED), args.repeats)
            print(f"{n:>7} {'names, last 24 h':<26} {t:>8.3f} {got:>6} {base / t:>9.1f}")
        if args.probing_jobs > 0:
            compaction(endpoint, args.probing_jobs, args.probing_hours, args.repeats)


def probing_events(jobs: int, hours: float) -> list[PoolEvent]:
    """Each job probes every pool of the bundled traces every 15 minutes (its own phase), from hour 60 of
    the traces on; the probe reads what the trace says then."""
    traces = load_traces(default_traces_dir() / PREEMPTION_TRACES_SUBDIR)
    start, rnd, out = NOW - hours * 3600, random.Random(jobs), []
    for j in range(jobs):
        phase = rnd.uniform(0, 900)
        for k in range(int(hours * 4)):
            at = start + phase + k * 900
            for t in traces:
                up = t.up_at(60 * 3600 + at - start)
                out.append(PoolEvent(f"p3.2xlarge@{t.zone}", "probe-up" if up else "probe-down", at, f"dag.run-{j}"))
    return out


def compaction(endpoint: str, jobs: int, hours: float, repeats: int) -> None:
    events = probing_events(jobs, hours)
    store = S3Store("bench-availability", f"probing-{jobs}", endpoint_url=endpoint)
    write(store, events, first_layout=False)
    log = AvailabilityLog(store)
    pools = sorted({e.pool for e in events})
    before, n_before = timed(lambda: log.read(until=NOW), repeats)
    views = pool_views(log.read(until=NOW), NOW, pools)
    t = time.perf_counter()
    dropped = log.compact(before=NOW - COMPACT_AFTER_HOURS * 3600)
    took = time.perf_counter() - t
    after, n_after = timed(lambda: log.read(until=NOW), repeats)
    assert pool_views(log.read(until=NOW), NOW, pools) == views, "compaction changed what a decision reads"
    print(f"\n{jobs} jobs probing {len(pools)} pools every 15 min for {hours:g} h; the last "
          f"{COMPACT_AFTER_HOURS:g} h kept whole; the pools' states read after compaction equal those before")
    print(f"{'':>7} {'read':<26} {'seconds':>8} {'events':>6} {'x faster':>9}")
    print(f"{'':>7} {'whole log':<26} {before:>8.3f} {n_before:>6} {1.0:>9.1f}")
    print(f"{'':>7} {'compacted':<26} {after:>8.3f} {n_after:>6} {before / after:>9.1f}")
    print(f"compacting it took {took:.3f} s and deleted {dropped} events")


if __name__ == "__main__":
    main()
