"""``airflow-spot reap``: find instances left running (a crashed worker, a deleted DAG run) and terminate them.

Examples::

    airflow-spot reap --dry-run                                   # list live local instances
    airflow-spot reap --older-than 3600 --tag airflow-spot:dag=spot_training_demo
    airflow-spot reap --backend local --backend-options '{"state_dir": "/tmp/spot-state"}'
    airflow-spot reap --purge-older-than 86400                    # also forget day-old terminated instances
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from airflow_spot.backends.base import InstanceInfo, InstanceState, backend_names, get_backend


def _tag(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--tag wants KEY=VALUE, got {text!r}")
    return key, value


def _options(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--backend-options must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--backend-options must be a JSON object, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--older-than wants seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"--older-than must be >= 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="local", help=f"backend to search ({', '.join(backend_names())})")
    parser.add_argument("--backend-options", type=_options, default={}, metavar="JSON",
                        help="the backend's kwargs as a JSON object, e.g. '{\"state_dir\": \"/tmp/x\"}'")
    parser.add_argument("--older-than", type=_seconds, default=0.0, metavar="SECONDS",
                        help="only instances launched at least this long ago")
    parser.add_argument("--tag", type=_tag, action="append", default=[], metavar="KEY=VALUE",
                        help="only instances carrying this tag (repeatable; all must match)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be terminated, terminate nothing")
    parser.add_argument("--purge-older-than", type=_seconds, default=None, metavar="SECONDS",
                        help="also delete the records and logs of instances terminated this long ago "
                             "(backends that keep local records, e.g. local)")


def leftovers(instances: list[InstanceInfo], older_than: float, now: float) -> list[InstanceInfo]:
    """Live instances launched at least ``older_than`` seconds before ``now``."""
    return [
        i for i in instances
        if not InstanceState(i.state).is_terminal() and now - (i.launched_at or now) >= older_than
    ]


def run(args: argparse.Namespace) -> int:
    try:
        backend = get_backend(args.backend, **args.backend_options)
    except (ValueError, TypeError) as exc:
        print(f"airflow-spot reap: {exc}", file=sys.stderr)
        return 2
    now = time.time()
    found = leftovers(backend.list_instances(dict(args.tag)), args.older_than, now)
    if args.purge_older_than is not None and not args.dry_run:
        purge = getattr(backend, "purge", None)
        if purge is None:
            print(f"airflow-spot reap: backend {args.backend!r} keeps no local records to purge", file=sys.stderr)
            return 2
        print(f"purged {len(purge(args.purge_older_than))} terminated instance record(s)")
    if not found:
        print("no live instances match")
        return 0
    for info in found:
        age = now - (info.launched_at or now)
        tags = ",".join(f"{k}={v}" for k, v in sorted(info.tags.items()))
        print(f"{info.instance_id}\t{InstanceState(info.state).value}\tage {age:.0f}s\t{info.offer.instance_type}"
              f"@{info.offer.zone}\t{tags}")
    if args.dry_run:
        print(f"dry run: {len(found)} instance(s) would be terminated")
        return 0
    backend.terminate([i.instance_id for i in found])
    print(f"terminated {len(found)} instance(s)")
    return 0
