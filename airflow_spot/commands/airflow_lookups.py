"""What the commands read from Airflow: cloud clients of an AWS connection, and DAG-run states."""
from __future__ import annotations

from airflow_spot.backends.base import Clients


def clients_for(aws_conn_id: str | None) -> Clients:
    """Clients of the Amazon provider's hooks on ``aws_conn_id`` (as the operators get them)."""
    from airflow_spot.hooks.spot import SpotHook

    return SpotHook(aws_conn_id=aws_conn_id).clients


def dag_run_states(keys: list[tuple[str, str]]) -> dict[tuple[str, str], str | None]:
    """``{(dag_id, run_id): state}`` from Airflow's metadata database; ``None`` for a run that does not exist."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    out: dict[tuple[str, str], str | None] = {}
    with create_session() as session:
        for dag_id, run_id in keys:
            state = session.scalar(select(DagRun.state).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
            out[(dag_id, run_id)] = None if state is None else str(getattr(state, "value", state))
    return out
