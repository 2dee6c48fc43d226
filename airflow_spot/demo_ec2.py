"""``airflow-spot demo --backend ec2 --moto [--verify]``: the demo DAG on the ``ec2`` backend, with EC2 played
by moto's server on 127.0.0.1 and the instances by the local data plane.

What runs is the product's own path: ``SpotTraining`` ranks the live ``ec2`` market (instance types from
``DescribeInstanceTypes``, spot prices from ``DescribeSpotPriceHistory``), launches through ``RunInstances``
with spot market options, and waits in ``SegmentTrigger`` on the shared poller's ``DescribeInstances``; the
agent on each "instance" starts from the instance's own user data and learns who it is from IMDSv2
(:mod:`airflow_spot.testing.ec2_dataplane`). moto's fixed spot prices are replaced by the bundled
catalog's us-east-1 prices, and a pool's price triples at an interruption notice (demand there rose), so
each retry has to land on the then-cheapest other offer. The first ``--preempt-after`` instances are
reclaimed on schedule (notice through IMDS, then ``Server.SpotInstanceTermination``).

At the end it checks the final weights against an uninterrupted run (``--verify``) and that moto has no
running instance left.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REGION = "us-east-1"
IMAGE_ID = "ami-12345678"
#: seconds after each played instance's agent starts at which it is reclaimed (the first six instances)
EC2_DEFAULT_SCHEDULE = (8.0, 8.0, 8.0, 8.0, 8.0, 8.0)
#: a noticed pool's spot price is multiplied by this before the retry ranks the market again
RECLAIM_PRICE_FACTOR = 3.0


def catalog_spot_prices(region: str = REGION) -> dict[tuple[str, str], float]:
    """Spot prices per (instance type, zone) of moto's zones in ``region``, from the bundled catalog: the
    catalog's pools carry zone ids, moto names zones ``<region>a..f``; each type's catalog price is spread
    over moto's zones with a small per-zone step so that the zones differ."""
    from airflow_spot.market.catalog import read_catalog

    by_type: dict[str, float] = {}
    for row in read_catalog():
        if row.region == region and row.spot_price:
            by_type[row.instance_type] = min(row.spot_price, by_type.get(row.instance_type, float("inf")))
    zones = [f"{region}{z}" for z in "abcdef"]
    return {(t, z): round(p * (1.0 + 0.03 * i), 5) for t, p in by_type.items() for i, z in enumerate(zones)}


def run_on_moto(args: argparse.Namespace) -> int:
    from airflow_spot import demo

    out = Path(args.out).resolve()
    home = out / "airflow"
    home.mkdir(parents=True, exist_ok=True)
    demo._configure_airflow(home)
    # Without --preempt-after: the local demo's default reclaims 4 s after start, but an ec2 "instance" here
    # first starts torch from its user data (about 10 s on a busy 2-core machine), so reclaim later.
    schedule = list(args.preempt_after) if args.preempt_after is not None else list(EC2_DEFAULT_SCHEDULE)
    started = time.monotonic()
    from airflow.utils import db

    from airflow_spot.testing.ec2_dataplane import Ec2DataPlane, set_spot_prices, spot_prices
    from airflow_spot.testing.moto_s3 import moto_server

    moves: list[str] = []

    def noticed(instance_id: str, instance_type: str, zone: str) -> None:
        prices = spot_prices()
        old = prices.get((instance_type, zone))
        if old is not None:
            prices[(instance_type, zone)] = round(old * RECLAIM_PRICE_FACTOR, 5)
            set_spot_prices(prices)
            moves.append(f"{instance_id} noticed in {instance_type}@{zone}: spot ${old:.4f}/h -> "
                         f"${prices[(instance_type, zone)]:.4f}/h")

    with moto_server() as endpoint:
        os.environ["AIRFLOW_CONN_AWS_DEFAULT"] = json.dumps({
            "conn_type": "aws", "login": "testing", "password": "testing",
            "extra": {"region_name": REGION, "endpoint_url": endpoint}})
        set_spot_prices(catalog_spot_prices())
        dag = demo.build_demo_dag(
            root=out, total_steps=args.total_steps, steps_per_segment=args.steps_per_segment,
            step_sleep=args.step_sleep, max_preemptions=len(schedule) + 3, backend="ec2",
            backend_options={"regions": [REGION], "image_id": IMAGE_ID, "python": sys.executable,
                             "term_grace_seconds": demo.NOTICE_WINDOW_SECONDS},
            market_options={"regions": [REGION], "price_ttl_seconds": 0},
        )
        plane = Ec2DataPlane(out / "instances", region=REGION, after_seconds=schedule,
                             notice_window_seconds=demo.NOTICE_WINDOW_SECONDS, on_notice=noticed,
                             # the session polls IMDS for the notice this often (AWS suggests 5 s for 120 s)
                             env={"SPOT_NOTICE_POLL_SECONDS": "0.5"})
        log_file = out / "demo.log"
        print(f"airflow-spot demo (ec2 on moto {endpoint}): Airflow home {home}; Airflow's log in {log_file}",
              flush=True)
        with plane:
            dag_run, wall = demo.run_quietly(dag, out, log_file, setup=db.resetdb,
                                             plan=f"ec2 on moto, up to {len(schedule)} reclaims scheduled")
            leftover = plane.running_instances()
        summary = demo.read_summary(out, dag.dag_id, dag_run.run_id)
        print(demo.report(dag_run.state, summary, wall, time.monotonic() - started))
        for line in moves:
            print(f"  price move          {line}")
        print(f"  spot notices        {len(plane.notices)} through IMDS; {len(plane.preempted)} instance(s) reached "
              "the end of the notice window and were reclaimed (Server.SpotInstanceTermination), the others "
              "were terminated by the provider first")
        print(f"  instance logs       {out / 'instances'}/<instance>/agent/attempts/<attempt>.log")
        print(f"  left running        {', '.join(leftover) if leftover else 'none'}")
        if plane.errors:
            print(f"  data plane errors   {plane.errors}")
    ok = str(dag_run.state) in ("success", "DagRunState.SUCCESS") and not leftover and not plane.errors
    if args.verify and ok:
        weights = demo.job_dir(out, dag.dag_id, dag_run.run_id) / demo.FINAL_WEIGHTS
        ok = demo.verify_weights(weights, args.total_steps, out / "reference")
    return 0 if ok else 1
