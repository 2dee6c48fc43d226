"""What the commands read from Airflow: cloud clients of an AWS connection, and DAG-run states."""
from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from airflow_spot.backends.base import Clients


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at each write (a test's capture, a redirected stream)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str):  # encoding, fileno, ...: the current stderr's
        return getattr(sys.stderr, name)


@contextlib.contextmanager
def airflow_logs_to_stderr() -> Iterator[None]:
    """While a command asks Airflow (imports it, reads connections, builds clients), what is written to stdout
    goes to stderr, and so do Airflow's log lines after: stdout keeps the command's own output."""
    with contextlib.redirect_stdout(_CurrentStderr()):
        yield
    logs_to_stderr()


def logs_to_stderr() -> None:
    """Send Airflow's log lines (its logging config writes them to stdout) to stderr: a command's stdout is
    its table, which a reader pipes or parses (``airflow-spot offers ... | head``). Call after Airflow is
    imported (which configures the logging)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stdout:
            handler.setStream(_CurrentStderr())
    try:  # Airflow's structlog loggers write to the stdout of when each is made, through this factory
        import structlog

        factory = structlog.get_config().get("logger_factory")
    except Exception:  # noqa: BLE001 - no structlog, or another config: the stdlib handlers above suffice
        return
    if getattr(factory, "io", False) is None:
        factory.io = _CurrentStderr()


def clients_for(aws_conn_id: str | None) -> Clients:
    """Clients of the Amazon provider's hooks on ``aws_conn_id`` (as the operators get them); ``None``: boto3's
    default credential chain.

    :raises ValueError: ``aws_conn_id`` is empty, or names a connection that is not defined (the message says
        how to define it, or to pass ``--aws-conn-id none``).
    """
    from airflow_spot.hooks.spot import SpotHook

    if aws_conn_id is not None and not aws_conn_id.strip():
        raise ValueError("--aws-conn-id must name an Airflow AWS connection, or be 'none' for boto3's default "
                         "credential chain; got an empty string")
    logs_to_stderr()
    hook = SpotHook(aws_conn_id=aws_conn_id)
    if aws_conn_id is not None:
        try:
            hook._check_connection()  # now, to say it in the command line's terms
        except ValueError:
            raise ValueError(
                f"the AWS connection {aws_conn_id!r} is not defined; create it (airflow connections add "
                f"{aws_conn_id} --conn-type aws ..., or the environment variable "
                f"AIRFLOW_CONN_{aws_conn_id.upper()}), or pass --aws-conn-id none to use boto3's default "
                "credential chain") from None
    return hook.clients


def dag_run_states(keys: list[tuple[str, str]]) -> dict[tuple[str, str], str | None]:
    """``{(dag_id, run_id): state}`` from Airflow's metadata database; ``None`` for a run that does not exist."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    logs_to_stderr()
    out: dict[tuple[str, str], str | None] = {}
    with create_session() as session:
        for dag_id, run_id in keys:
            state = session.scalar(select(DagRun.state).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
            out[(dag_id, run_id)] = None if state is None else str(getattr(state, "value", state))
    return out


def update_summary_xcoms(refreshed: dict[tuple[str, str, str], dict]) -> list[tuple[str, str]]:
    """Rewrite the finish task's summary XCom of each ``(dag_id, run_id, job_uri)`` with ``summary`` (the
    Spot Training list's row of a finished job is that XCom). Only an XCom that is that job's summary is
    rewritten (its ``job_uri`` the same): a run whose finish task never ran has none, and its row is read
    from the store anyway. Returns the runs rewritten."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from airflow_spot.ui.jobs import SUMMARY_XCOM_KEY

    logs_to_stderr()
    updated = []
    with create_session() as session:
        for (dag_id, run_id, job_uri), summary in refreshed.items():
            rows = session.scalars(select(XComModel).where(
                XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.key == SUMMARY_XCOM_KEY))
            for row in rows:
                try:
                    value = XComModel.deserialize_value(row)
                except Exception:  # noqa: BLE001 - a value this code cannot decode is not this job's summary
                    continue
                if isinstance(value, dict) and value.get("job_uri") == job_uri:
                    row.value = XComModel.serialize_value({**value, **summary})
                    updated.append((dag_id, run_id))
    return updated
