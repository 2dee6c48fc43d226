"""``airflow-spot reap``: the backend's leftover instances, with the AWS connection and DAG-run states of Airflow.

Cloud backends (``ec2``) reap, by default, only instances whose DAG run is finished or gone (an instance of a
running DAG run is doing its job); the local backend reaps every live instance unless ``--runs finished``.
See :mod:`airflow_spot.backends.reap` for the other options.
"""
from __future__ import annotations

import argparse
import os
import sys

from airflow_spot.backends import reap as base
from airflow_spot.backends.base import LaunchError, backend_class, get_backend
from airflow_spot.cli_types import AWS_CONN_ID_HELP, aws_conn_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    base.add_arguments(parser)
    parser.add_argument("--aws-conn-id", type=aws_conn_id, default="aws_default", help=AWS_CONN_ID_HELP)
    parser.add_argument("--runs", choices=("finished", "any"), default=None,
                        help="'finished': only instances whose DAG run is finished or deleted (default for cloud "
                             "backends); 'any': every live instance (default for local)")


def _missing_state_dir(args: argparse.Namespace) -> str | None:
    """A note when the local backend's state directory, as given, does not exist: no instance was launched
    from it. Opening the backend would create it, and a mistyped path would read as a plain "nothing to reap"."""
    from airflow_spot.backends.local_state import STATE_DIR_ENV

    import inspect

    from airflow_spot.backends.base import backend_class

    if set(args.backend_options) - set(inspect.signature(backend_class("local").__init__).parameters):
        return None  # an unknown option: get_backend names the valid ones
    given = args.backend_options.get("state_dir")
    source = "--backend-options state_dir"
    if not given and os.environ.get(STATE_DIR_ENV):
        given, source = os.environ[STATE_DIR_ENV], STATE_DIR_ENV
    if not isinstance(given, str) or not given or os.path.exists(given):
        return None
    return (f"no live instances match: {source} {given} does not exist, so no instance was launched from it "
            "(nothing was created there); if instances run, give the state_dir of the DAGs' backend_options (or "
            f"{STATE_DIR_ENV}) that launched them")


def run(args: argparse.Namespace) -> int:
    try:
        cls = backend_class(args.backend)
        missing = _missing_state_dir(args) if args.backend == "local" else None
        if missing:
            print(missing)
            return 0
        clients = None
        if getattr(cls, "uses_clients", False):
            from airflow_spot.commands.airflow_lookups import clients_for

            clients = clients_for(args.aws_conn_id)
        backend = get_backend(args.backend, clients=clients, **args.backend_options)
    except ValueError as exc:
        print(f"airflow-spot reap: {exc}", file=sys.stderr)
        return 2
    except TypeError as exc:  # an option the backend does not take: name the ones it does
        print(f"airflow-spot reap: {base.backend_options_problem(args.backend, args.backend_options, exc)}",
              file=sys.stderr)
        return 2
    runs = args.runs or ("finished" if cls.reaps_by_run_state else "any")
    run_states = None
    if runs == "finished":
        from airflow_spot.commands.airflow_lookups import dag_run_states

        run_states = dag_run_states
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return base.run(args, backend=backend, run_states=run_states)
    except (LaunchError, BotoCoreError, ClientError) as exc:  # a missing connection, no permission, no endpoint
        print(f"airflow-spot reap: {exc}", file=sys.stderr)
        return 2
