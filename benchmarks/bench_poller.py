"""Polling at scale: N concurrent deferred segments in one triggerer-like process against moto's server.

Two ways to watch N spot instances, side by side in one run, each on N fresh moto instances launched with
spot market options:

* ``ours``: N real ``SegmentTrigger.run`` coroutines on the ``ec2`` backend (through ``SpotHook`` and an
  ``aws_default`` connection pointing at moto); they share one poller per region
  (:mod:`airflow_spot.triggers.poller`), so one paginated ``DescribeInstances`` filtered by ids serves all.
* ``provider``: N of the Amazon provider's own ``EC2StateSensorTrigger`` (one ``DescribeInstances`` per
  instance per interval, a new async client each time), waiting for ``terminated``.

Measured per variant: ``DescribeInstances`` calls per poll interval (counted at the client with a
wrapper around botocore's ``_make_api_call``, sync and async), CPU seconds of this process over the same
window (moto's server runs in a child process, so its CPU is not counted), and event latency: K instances
terminated at a known time -> each one's trigger event. The store of each segment is ``file://`` and has
no status yet (the attempts look like they are still starting), which is what a deferred segment reads.

moto is not EC2: it builds each instance of an answer in Python, tens of milliseconds apiece on a loaded
machine, so one DescribeInstances of 1000 instances takes moto tens of seconds (whatever the filter;
printed as ``moto describe N`` before the runs). At 1000 segments a round of ``ours`` is therefore bound
by moto's answer, not by the poller: its latency figures there measure moto, while its calls per
interval and its CPU (parsing one 1000-instance answer per round) are the poller's own. Beyond 200 ids
the ec2 backend filters by its managed tag (EC2 refuses more than 200 filter values), so a round stays
one paginated call.

    python benchmarks/bench_poller.py                    # 1000 segments, 5 s interval, 30 s window
    python benchmarks/bench_poller.py --segments 1000 --window 150 --warmup 300
    python benchmarks/bench_poller.py --segments 200 --window 20 --out -
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REGION = "us-east-1"
IMAGE = "ami-12345678"


class CallCounter:
    """Counts AWS API calls by operation, sync and async clients alike (the counting never changes a call)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.at_start = 0

    def install(self) -> None:
        import botocore.client
        from aiobotocore.client import AioBaseClient

        counter = self
        sync_call = botocore.client.BaseClient._make_api_call
        async_call = AioBaseClient._make_api_call

        def counted_sync(self, operation_name, api_params):
            counter.calls[operation_name] += 1
            return sync_call(self, operation_name, api_params)

        async def counted_async(self, operation_name, api_params):
            counter.calls[operation_name] += 1
            return await async_call(self, operation_name, api_params)

        botocore.client.BaseClient._make_api_call = counted_sync
        AioBaseClient._make_api_call = counted_async


def launch(endpoint: str, n: int, label: str) -> list[str]:
    import boto3

    ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name=REGION)
    ids: list[str] = []
    while len(ids) < n:
        batch = min(500, n - len(ids))
        reply = ec2.run_instances(
            ImageId=IMAGE, InstanceType="g5.xlarge", MinCount=batch, MaxCount=batch,
            InstanceMarketOptions={"MarketType": "spot", "SpotOptions": {"SpotInstanceType": "one-time"}},
            TagSpecifications=[{"ResourceType": "instance", "Tags": [
                {"Key": "airflow-spot:managed", "Value": "true"}, {"Key": "bench", "Value": label}]}],
        )
        ids += [i["InstanceId"] for i in reply["Instances"]]
    return ids


def terminate(endpoint: str, ids: list[str]) -> float:
    import boto3

    ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name=REGION)
    ec2.terminate_instances(InstanceIds=ids)
    return time.time()


def moto_describe_seconds(endpoint: str, ids: list[str], variant: str) -> float:
    """moto's service time for one poll, timed with a plain client: for ``ours`` one paginated
    DescribeInstances as the ec2 backend sends it for ``ids`` (the floor of a round; beyond 200 ids it
    answers every managed instance moto holds, including earlier variants' terminated ones), for
    ``provider`` one DescribeInstances of one id (what each of its triggers sends per interval)."""
    import boto3
    from botocore.config import Config

    from airflow_spot.backends.ec2 import Ec2Backend

    ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name=REGION, config=Config(read_timeout=900))
    started = time.monotonic()
    if variant == "provider":
        ec2.describe_instances(InstanceIds=ids[:1])
    else:
        for _ in ec2.get_paginator("describe_instances").paginate(Filters=Ec2Backend._filters(ids)):
            pass
    return time.monotonic() - started


def our_trigger(instance_id: str, root: Path, interval: float):
    from airflow_spot.triggers.segment import SegmentTrigger

    return SegmentTrigger(
        job_uri=f"file://{root}/jobs/{instance_id}", attempt_id=f"seg.{instance_id}", instance_id=instance_id,
        requested_at=time.time(), backend="ec2", backend_options={"regions": [REGION], "image_id": IMAGE},
        aws_conn_id="aws_default", poll_interval=interval, startup_timeout=3600, heartbeat_timeout=3600,
        max_attempt_seconds=7200,
    )


def provider_trigger(instance_id: str, root: Path, interval: float):
    from airflow.providers.amazon.aws.triggers.ec2 import EC2StateSensorTrigger

    return EC2StateSensorTrigger(instance_id=instance_id, target_state="terminated", aws_conn_id="aws_default",
                                 region_name=REGION, poll_interval=interval)


def warmed(variant: str, n: int, counter: CallCounter) -> bool:
    if variant == "ours":
        from airflow_spot.triggers.poller import active_pollers

        pollers = active_pollers()
        return bool(pollers) and pollers[0].subscriber_count == n and pollers[0].describe_calls >= 2
    return counter.calls["DescribeInstances"] - counter.at_start >= n


async def measure(variant: str, ids: list[str], make, counter: CallCounter, endpoint: str, args) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"bench-poller-{variant}-"))
    counter.at_start = counter.calls["DescribeInstances"]
    events: dict[str, float] = {}

    async def watch(iid: str) -> None:
        async for _ in make(iid, root, args.interval).run():
            events[iid] = time.time()
            return

    started = time.monotonic()
    tasks = [asyncio.create_task(watch(iid)) for iid in ids]
    # Warm-up: every trigger has built its hook and made its first poll (bounded: a slow variant on a
    # loaded machine is measured as it is after args.warmup seconds).
    while time.monotonic() - started < args.warmup and not warmed(variant, len(ids), counter):
        await asyncio.sleep(0.2)
    await asyncio.sleep(args.interval)
    warmup = time.monotonic() - started
    before_calls = counter.calls["DescribeInstances"]
    cpu0, wall0 = time.process_time(), time.monotonic()
    await asyncio.sleep(args.window)
    window = time.monotonic() - wall0
    cpu = time.process_time() - cpu0
    calls = counter.calls["DescribeInstances"] - before_calls
    rounds = []
    if variant == "ours":
        from airflow_spot.triggers.poller import active_pollers

        rounds = [s for p in active_pollers() for s in p.round_seconds]
    victims = ids[: args.terminate]
    t0 = await asyncio.to_thread(terminate, endpoint, victims)
    # the next round that starts after the terminate must finish: up to two rounds (moto-bound at 1000)
    deadline = time.monotonic() + max(6 * args.interval, 30.0, 3 * (max(rounds) if rounds else 0.0) + args.interval)
    while time.monotonic() < deadline and not all(v in events for v in victims):
        await asyncio.sleep(0.05)
    latencies = sorted(events[v] - t0 for v in victims if v in events)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "variant": variant,
        "segments": len(ids),
        "warmup_s": round(warmup, 1),
        "window_s": round(window, 1),
        "describe_calls": calls,
        "describe_calls_per_interval": round(calls / (window / args.interval), 2),
        "cpu_s": round(cpu, 2),
        "cpu_per_interval_s": round(cpu / (window / args.interval), 3),
        "terminated": len(victims),
        "events_seen": len(latencies),
        "latency_median_s": round(statistics.median(latencies), 2) if latencies else None,
        "latency_max_s": round(latencies[-1], 2) if latencies else None,
        "false_events": sum(1 for iid in events if iid not in victims),
        "round_median_s": round(statistics.median(rounds), 2) if rounds else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--segments", type=int, default=1000)
    p.add_argument("--interval", type=float, default=5.0, help="poll interval of both variants (s)")
    p.add_argument("--window", type=float, default=30.0, help="measuring window per variant (s)")
    p.add_argument("--terminate", type=int, default=50, help="instances terminated to time the events")
    p.add_argument("--warmup", type=float, default=90.0, help="at most this long for every trigger's first poll (s)")
    p.add_argument("--variants", default="ours,provider")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "poller.txt"), help="'-': stdout only")
    args = p.parse_args(argv)
    if args.segments < 1 or args.terminate > args.segments or args.interval <= 0 or args.window <= 0:
        p.error("need segments >= 1, terminate <= segments, interval > 0, window > 0")

    # one log line per trigger per poll otherwise (set before Airflow is imported)
    os.environ.setdefault("AIRFLOW__LOGGING__LOGGING_LEVEL", "WARNING")
    from airflow_spot.testing.moto_s3 import fake_aws_env, moto_server_process

    counter = CallCounter()
    counter.install()
    rows = []
    with fake_aws_env(), moto_server_process() as endpoint:
        os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = json.dumps({
            "conn_type": "aws", "login": "testing", "password": "testing",
            "extra": {"region_name": REGION, "endpoint_url": endpoint}})
        makers = {"ours": our_trigger, "provider": provider_trigger}
        for variant in args.variants.split(","):
            ids = launch(endpoint, args.segments, variant)
            moto_s = moto_describe_seconds(endpoint, ids, variant)
            print(f"{variant}: {len(ids)} spot instances launched in moto; moto's answer to one poll: {moto_s:.2f} s; "
                  "measuring ...", flush=True)
            rows.append(asyncio.run(measure(variant, ids, makers[variant], counter, endpoint, args)))
            rows[-1]["moto_poll_s"] = round(moto_s, 2)
            terminate(endpoint, ids)
            print(json.dumps(rows[-1]), flush=True)
    load = os.getloadavg()
    lines = [
        f"bench_poller: {args.segments} deferred segments, poll interval {args.interval:g} s, window "
        f"{args.window:g} s, {args.terminate} terminated; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"({os.cpu_count()} cores); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"{'variant':<9} {'describe/interval':>17} {'cpu s/interval':>14} {'latency median':>14} {'latency max':>11} "
        f"{'events':>7} {'false':>5} {'round s':>7} {'moto poll s':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r['variant']:<9} {r['describe_calls_per_interval']:>17} {r['cpu_per_interval_s']:>14} "
            f"{r['latency_median_s']!s:>14} {r['latency_max_s']!s:>11} {r['events_seen']:>3}/{r['terminated']:<3} "
            f"{r['false_events']:>5} {r['round_median_s']!s:>7} {r['moto_poll_s']!s:>10}"
        )
    lines += [json.dumps(r) for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
