"""Airflow fixtures for tests that run DAGs with ``dag.test()``: a migrated sqlite metadata DB.

Use: ``from airflow_fixtures import airflow_db, run_dag  # noqa: F401`` (tests/ is on sys.path through its conftest).
"""
from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def airflow_db():
    """A fresh metadata DB in this session's AIRFLOW_HOME (about 3 s)."""
    home = os.environ["AIRFLOW_HOME"]
    os.makedirs(os.path.join(home, "dags"), exist_ok=True)
    from airflow.utils import db

    db.resetdb()
    yield home
    if f"airflow-spot-tests-{os.getpid()}" in home:  # only the home conftest made for us
        shutil.rmtree(home, ignore_errors=True)


def run_dag(dag, **kwargs):
    """Serialise a DAG built in a test into the DB (NOTES.md) and run it with ``dag.test()``."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(dag_folder=os.devnull)
    bag.bag_dag(dag)
    sync_bag_to_db(bag, "dags-folder", None)
    return dag.test(**kwargs)
