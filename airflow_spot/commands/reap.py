"""``airflow-spot reap``: the backend's leftover instances, with the AWS connection and DAG-run states of Airflow.

Cloud backends (``ec2``) reap, by default, only instances whose DAG run is finished or gone (an instance of a
running DAG run is doing its job); the local backend reaps every live instance unless ``--runs finished``.
See :mod:`airflow_spot.backends.reap` for the other options.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

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


class JobBilling:
    """The reaped instances' time in their jobs' cost, as the finish task bills its own leftovers: the kill of
    each attempt nobody accounted for on a reaped instance is recorded before the termination (so the
    status its agent then writes is no preemption), the attempt is billed ``abandoned`` after it, and a
    live instance's time after its last attempt is billed as idle. Priced by the backend's default market
    (the DAG's ``market_options`` are not known here). Best effort: reaping never fails on it."""

    def __init__(self, hook) -> None:
        self.hook = hook
        self._stores: dict[str, object] = {}
        self._launches: dict[str, list] = {}
        self._runs: dict[str, tuple[str, str]] = {}
        #: ``{(dag_id, run_id, job_uri): summary}``: the summaries brought up to new bills, for their XComs
        self.refreshed: dict[tuple[str, str, str], dict] = {}

    def _by_job(self, instances) -> dict[str, set[str]]:
        jobs: dict[str, set[str]] = {}
        for info in instances:
            if info.job_uri:
                jobs.setdefault(info.job_uri, set()).add(info.instance_id)
                tags = getattr(info, "tags", None) or {}
                if base.TAG_DAG in tags and base.TAG_RUN in tags:
                    self._runs[info.job_uri] = (tags[base.TAG_DAG], tags[base.TAG_RUN])
        return jobs

    def before_terminate(self, instances, at: float) -> None:
        from airflow_spot.operators import accounting

        for uri, ids in self._by_job(instances).items():
            try:
                store = self._stores[uri] = self.hook.get_store(uri)
                self._launches[uri] = accounting.unaccounted_launches(store, lambda launch: launch.instance_id in ids)
                accounting.record_kills(store, self._launches[uri], at)
            except Exception as exc:  # noqa: BLE001 - the termination comes first
                print(f"airflow-spot reap: {uri}: attempts not checked for billing ({type(exc).__name__}: {exc})",
                      file=sys.stderr)

    def after_terminate(self, instances, stopped: set[str], at: float) -> list[str]:
        from airflow_spot.operators import accounting

        lines = []
        for uri, ids in self._by_job(instances).items():
            store = self._stores.get(uri)
            if store is None:
                continue
            try:
                market = accounting.billing_market(self.hook)
                attempts = accounting.bill_abandoned(store, self._launches.get(uri, []), ids - stopped, at, market)
                rows = accounting.read_rows(store)
                idle = accounting.bill_idle(store, sorted(ids - stopped), rows, at, market)
                idle += accounting.bill_unrecorded(store, [i for i in instances if i.job_uri == uri], rows,
                                                   self._launches.get(uri, []), ids - stopped, at, market)
            except Exception as exc:  # noqa: BLE001 - the instances are gone; only the bill is missing
                print(f"airflow-spot reap: {uri}: not billed ({type(exc).__name__}: {exc})", file=sys.stderr)
                continue
            lines += self._billed(store, uri, attempts, idle)
        return lines

    def bill_ended(self, instances) -> list[str]:
        """Attempts nobody accounted for on instances of finished runs that had already ended (their
        statuses or heartbeats say how far they got), and warm instances that idled out after the run's
        last attempt: what the finish task bills, for a run whose finish task never ran."""
        from airflow_spot.operators import accounting

        lines = []
        for uri, ids in self._by_job(instances).items():
            try:
                store = self._stores.get(uri) or self.hook.get_store(uri)
                launches = accounting.unaccounted_launches(store, lambda launch: launch.instance_id in ids)
                market = accounting.billing_market(self.hook)
                attempts = accounting.bill_abandoned(store, launches, set(), time.time(), market)
                rows = accounting.read_rows(store)
                idle = accounting.bill_idle_exits(store, rows, market)
                idle += accounting.bill_unrecorded(store, [i for i in instances if i.job_uri == uri], rows,
                                                   launches, set(), time.time(), market)
            except Exception as exc:  # noqa: BLE001 - reaping goes on; only the bill is missing
                print(f"airflow-spot reap: {uri}: ended instances not billed ({type(exc).__name__}: {exc})",
                      file=sys.stderr)
                continue
            lines += self._billed(store, uri, attempts, idle, ended=True)
        return lines

    def _billed(self, store, uri: str, attempts: int, idle: float, ended: bool = False) -> list[str]:
        """The lines saying what was billed in one job, and its summary brought up to the ledger."""
        from airflow_spot.operators import accounting

        if not (attempts or idle):
            return []
        lines = [f"billed in {uri}: {attempts} attempt(s) nobody accounted for "
                 f"({'on instances that had ended' if ended else 'abandoned'}), "
                 f"${idle:.4f} of idle time (after their instances' last attempts, or with no attempt recorded)"]
        try:  # the job's page reads its summary's totals: they follow the new bills
            summary = accounting.refresh_summary(store, time.time())
            if summary is not None:
                lines.append(f"  the job summary in {uri} now holds them (its cost: the ledger's)")
                if uri in self._runs:
                    self.refreshed[(*self._runs[uri], uri)] = summary
        except Exception as exc:  # noqa: BLE001 - the bills stand; only the summary's totals lag
            print(f"airflow-spot reap: {uri}: job summary not updated ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
        return lines


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

    from airflow_spot.commands.airflow_lookups import logs_to_stderr
    from airflow_spot.hooks.spot import SpotHook

    logs_to_stderr()  # the billing's log lines too: stdout is the list of what was reaped
    hook = SpotHook(backend=args.backend, backend_options=args.backend_options, aws_conn_id=args.aws_conn_id)
    try:
        # only the instances of DAG runs known to be over: a running run's segments account for their own
        # attempts, and a kill recorded under them would fail the segment instead of retrying it
        billing = JobBilling(hook) if run_states is not None else None
        rc = base.run(args, backend=backend, run_states=run_states, billing=billing)
    except (LaunchError, BotoCoreError, ClientError) as exc:  # a missing connection, no permission, no endpoint
        print(f"airflow-spot reap: {exc}", file=sys.stderr)
        return 2
    if billing is not None and billing.refreshed:
        _update_list_rows(billing.refreshed)
    return rc


def _update_list_rows(refreshed: dict[tuple[str, str, str], dict]) -> None:
    """The Spot Training list's row of a finished job is its summary XCom: rewrite it with the summary the
    new bills refreshed, so the list shows what the job's page does. Best effort: the bills stand."""
    from airflow_spot.commands.airflow_lookups import update_summary_xcoms

    try:
        updated = update_summary_xcoms(refreshed)
    except Exception as exc:  # noqa: BLE001 - only the list's row lags; the job's page reads the store
        print(f"airflow-spot reap: the summary XComs not updated, the Spot Training list shows the figures "
              f"before these bills until the runs' finish tasks run again ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return
    for dag_id, run_id in updated:
        print(f"  the Spot Training list's row of {dag_id} / {run_id} now shows them")
