"""``airflow-spot reap``: find instances left running (a crashed worker, a deleted DAG run) and terminate them.

Examples::

    airflow-spot reap --dry-run                                   # list live local instances
    airflow-spot reap --older-than 3600 --tag airflow-spot:dag=spot_training_demo
    airflow-spot reap --backend local --backend-options '{"state_dir": "~/spot-state"}'
    airflow-spot reap --purge-older-than 86400                    # also forget day-old terminated instances
    airflow-spot reap --backend ec2 --dry-run                     # EC2 instances whose DAG run is over or gone

Stopped instances (EC2: ``stopped``/``stopping``) serve nothing, so backends report them terminated and nothing
reuses them, but their disks are still billed: reap terminates them as well, through the backend's optional
``stopped_instances(tags)``.

This module holds the part that needs no Airflow; :mod:`airflow_spot.commands.reap` adds the AWS connection
and the DAG-run states from Airflow's metadata database.
"""
from __future__ import annotations

import argparse
import sys
import time

from collections.abc import Callable
from typing import Protocol

from airflow_spot.backends.base import (
    DEPLOYMENT_ENV,
    TAG_DEPLOYMENT,
    Backend,
    InstanceInfo,
    InstanceState,
    backend_names,
    deployment_id,
    get_backend,
)
from airflow_spot.cli_types import json_object

#: instance tags naming the DAG run that launched an instance (set by the operators)
TAG_DAG = "airflow-spot:dag"
TAG_RUN = "airflow-spot:run"
#: DAG-run states after which no instance of the run is needed
FINISHED_RUN_STATES = frozenset({"success", "failed"})

#: ``[(dag_id, run_id)] -> {(dag_id, run_id): state or None when the run does not exist}``
RunStates = Callable[[list[tuple[str, str]]], dict[tuple[str, str], "str | None"]]


def _tag(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--tag wants KEY=VALUE, got {text!r}")
    return key, value


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration(flag: str) -> Callable[[str], float]:
    """An argparse type for ``flag``: seconds, or a number with a unit (``90s``, ``30m``, ``2h``, ``1d``)."""

    def parse(text: str) -> float:
        number, unit = (text[:-1], text[-1].lower()) if text[-1:].lower() in _UNITS else (text, "s")
        try:
            value = float(number) * _UNITS[unit]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} wants a duration in seconds or with a unit (e.g. 3600, 90s, 30m, 2h, 1d), got {text!r}"
            ) from None
        if value < 0 or value != value:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 0 (a duration), got {text!r}")
        return value

    return parse


def backend_options_problem(name: str, options: dict, exc: Exception) -> str:
    """What is wrong with ``--backend``/``--backend-options``, naming the options the backend takes."""
    import inspect

    from airflow_spot.backends.base import backend_class

    try:
        params = inspect.signature(backend_class(name).__init__).parameters
    except Exception:  # noqa: BLE001 - the plain error is still useful
        return str(exc)
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    valid = sorted(p for p, v in params.items() if p not in ("self", "clients") and v.kind in named)
    unknown = sorted(set(options) - set(params))
    if unknown:
        return f"backend {name!r} takes no option(s) {unknown}; its options are: {', '.join(valid)}"
    return f"--backend-options for {name!r}: {exc} (its options are: {', '.join(valid)})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="local", help=f"backend to search ({', '.join(backend_names())})")
    parser.add_argument("--backend-options", type=json_object("--backend-options"), default={}, metavar="JSON",
                        help="the backend's kwargs as a JSON object, e.g. '{\"state_dir\": \"/tmp/x\"}'")
    parser.add_argument("--older-than", type=_duration("--older-than"), default=0.0, metavar="SECONDS",
                        help="only instances launched at least this long ago")
    parser.add_argument("--tag", type=_tag, action="append", default=[], metavar="KEY=VALUE",
                        help="only instances carrying this tag (repeatable; all must match)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be terminated, terminate nothing")
    parser.add_argument("--deployment", default=None, metavar="ID",
                        help=f"on a cloud backend, only instances this deployment launched (their {TAG_DEPLOYMENT} "
                             f"tag; default: ${DEPLOYMENT_ENV}, else 'default')")
    parser.add_argument("--any-deployment", action="store_true",
                        help="on a cloud backend, also instances of other deployments of the account and instances "
                             "launched before deployment tags")
    parser.add_argument("--purge-older-than", type=_duration("--purge-older-than"), default=None, metavar="SECONDS",
                        help="also delete the records and logs of instances terminated this long ago "
                             "(backends that keep local records, e.g. local)")


def leftovers(instances: list[InstanceInfo], older_than: float, now: float) -> list[InstanceInfo]:
    """Live instances launched at least ``older_than`` seconds before ``now``."""
    return [
        i for i in instances
        if not InstanceState(i.state).is_terminal() and now - (i.launched_at or now) >= older_than
    ]


def stopped_leftovers(backend: Backend, tags: dict[str, str], older_than: float, now: float) -> list[InstanceInfo]:
    """Stopped instances launched at least ``older_than`` seconds before ``now``, for backends that have them
    (an optional ``stopped_instances(tags)``): not running, yet billed until terminated."""
    stopped = getattr(backend, "stopped_instances", None)
    if stopped is None:
        return []
    return [i for i in stopped(tags) if now - (i.launched_at or now) >= older_than]


def of_finished_runs(instances: list[InstanceInfo], run_states: RunStates,
                     unknown_is_over: bool = True) -> list[InstanceInfo]:
    """The instances whose DAG run is finished or (``unknown_is_over``) no longer exists; instances without
    run tags are not ours to judge and are left alone."""
    keys = sorted({(i.tags[TAG_DAG], i.tags[TAG_RUN]) for i in instances if TAG_DAG in i.tags and TAG_RUN in i.tags})
    states = run_states(keys) if keys else {}
    out = []
    for info in instances:
        key = (info.tags.get(TAG_DAG), info.tags.get(TAG_RUN))
        if None in key:
            continue
        state = states.get(key)
        if (state is None and unknown_is_over) or str(state) in FINISHED_RUN_STATES:
            out.append(info)
    return out


class Billing(Protocol):
    """What reaping bills in the reaped instances' job stores (:mod:`airflow_spot.commands.reap` has one):
    told before the termination (to record the kills of attempts still running there) and after it."""

    def before_terminate(self, instances: list[InstanceInfo], at: float) -> None: ...

    def after_terminate(self, instances: list[InstanceInfo], stopped: set[str], at: float) -> list[str]:
        """Bill; returns lines to print."""

    def bill_ended(self, instances: list[InstanceInfo]) -> list[str]:
        """Bill the attempts nobody accounted for on instances that ended before the reap (a run marked
        failed skips its finish task, then the market reclaims the instance); returns lines to print."""


def run(args: argparse.Namespace, backend: Backend | None = None, run_states: RunStates | None = None,
        billing: Billing | None = None) -> int:
    """Reap. ``backend`` (built from the arguments when absent), ``run_states`` (given: only instances
    of finished or deleted DAG runs are reaped) and ``billing`` (the reaped instances' time in their jobs'
    cost) come from :mod:`airflow_spot.commands.reap` under Airflow."""
    if backend is None:
        try:
            backend = get_backend(args.backend, **args.backend_options)
        except ValueError as exc:
            print(f"airflow-spot reap: {exc}", file=sys.stderr)
            return 2
        except TypeError as exc:
            problem = backend_options_problem(args.backend, args.backend_options, exc)
            print(f"airflow-spot reap: {problem}", file=sys.stderr)
            return 2
    now = time.time()
    # several deployments may share a cloud account (and a DAG file: then their runs' ids are alike too)
    mine: str | None = None
    if backend.reaps_by_run_state and not getattr(args, "any_deployment", False):
        try:
            mine = deployment_id(getattr(args, "deployment", None))
        except ValueError as exc:
            print(f"airflow-spot reap: {exc}", file=sys.stderr)
            return 2

    every = backend.list_instances(dict(args.tag))
    # launched before deployment tags: this deployment's only when this database knows their run as finished
    # (another deployment's run is merely missing here)
    untagged = [i for i in every if TAG_DEPLOYMENT not in i.tags]
    known_over = {i.instance_id for i in of_finished_runs(untagged, run_states, unknown_is_over=False)} \
        if mine is not None and run_states is not None and untagged else set()

    def ours(instances: list[InstanceInfo]) -> list[InstanceInfo]:
        return instances if mine is None else [i for i in instances if i.tags.get(TAG_DEPLOYMENT) == mine
                                               or i.instance_id in known_over]

    listed = ours(every)
    if len(listed) < len(every):
        print(f"left alone: {len(every) - len(listed)} instance(s) not tagged {TAG_DEPLOYMENT}={mine} (another "
              "deployment's, or launched before deployment tags; --any-deployment includes them)")
    found = leftovers(listed, args.older_than, now)
    live_ids = {i.instance_id for i in found}
    stopped = [i for i in ours(stopped_leftovers(backend, dict(args.tag), args.older_than, now))
               if i.instance_id not in live_ids]
    stopped_ids = {i.instance_id for i in stopped}
    found += stopped
    # instances that ended on their own (a reclaim, an idle timeout) may carry attempts nobody billed
    ended = [i for i in listed if InstanceState(i.state).is_terminal() and i.instance_id not in stopped_ids] \
        if billing is not None else []
    if run_states is not None:
        over = {i.instance_id for i in of_finished_runs(found + ended, run_states)}
        found = [i for i in found if i.instance_id in over]
        ended = [i for i in ended if i.instance_id in over]
    if args.purge_older_than is not None and not args.dry_run:
        purge = getattr(backend, "purge", None)
        if purge is None:
            print(f"airflow-spot reap: backend {args.backend!r} keeps no local records to purge", file=sys.stderr)
            return 2
        print(f"purged {len(purge(args.purge_older_than))} terminated instance record(s)")
    if ended and billing is not None and not args.dry_run:
        for line in billing.bill_ended(ended):
            print(line)
    if not found:
        scope = backend.search_scope()
        print("no live instances match" + (f" in {scope}" if scope else ""))
        return 0
    for info in found:
        age = now - (info.launched_at or now)
        tags = ",".join(f"{k}={v}" for k, v in sorted(info.tags.items()))
        state = "stopped" if info.instance_id in stopped_ids else InstanceState(info.state).value
        print(f"{info.instance_id}\t{state}\tage {age:.0f}s\t{info.offer.instance_type}"
              f"@{info.offer.zone}\t{tags}")
    if args.dry_run:
        print(f"dry run: {len(found)} instance(s) would be terminated")
        return 0
    at = time.time()  # a status written after this is the termination's
    if billing is not None:
        billing.before_terminate(found, at)
    backend.terminate([i.instance_id for i in found])
    print(f"terminated {len(found)} instance(s)")
    if billing is not None:
        for line in billing.after_terminate(found, stopped_ids, at):
            print(line)
    return 0
