"""Shared test setup, kept light: only environment defaults that must exist before Airflow is imported.

Tests that run DAGs opt in to the Airflow fixtures of ``tests/airflow_fixtures.py``
(``from airflow_fixtures import airflow_db``), so the rest of the suite never pays for a metadata DB.
"""
from __future__ import annotations

import os
import tempfile

# Airflow reads its home and config when first imported; give tests a private home unless the caller
# chose one. Nothing is created here: the directory appears only if a test uses Airflow. Under pytest-xdist
# each worker inherits the controller's environment, so a home this file made for another process is
# replaced: two workers must not reset one metadata DB.
_HOME_OWNER = "AIRFLOW_SPOT_TESTS_HOME_PID"
if "AIRFLOW_HOME" not in os.environ or os.environ.get(_HOME_OWNER, str(os.getpid())) != str(os.getpid()):
    os.environ[_HOME_OWNER] = str(os.getpid())
    os.environ["AIRFLOW_HOME"] = os.path.join(tempfile.gettempdir(), f"airflow-spot-tests-{os.getpid()}")
    os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = os.path.join(os.environ["AIRFLOW_HOME"], "dags")
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _private_overhead_history(monkeypatch, tmp_path_factory):
    """Each test's jobs learn only from that test's jobs. The DAG's history (``_overheads`` beside a job's
    root) of a job at ``tmp_path`` would be the test session's directory, shared by every test, so in this
    process a job's histories are only the deployment's, which is private to the test (and read from the
    environment at each call, so a test may point it elsewhere). Airflow processes a test starts see the
    private deployment history too; their jobs' roots, and so their DAG histories, are in the test's own
    directories."""
    from airflow_spot.storage import overhead_history

    monkeypatch.setenv(overhead_history.ENV_URI, f"file://{tmp_path_factory.mktemp('overhead-history')}")
    monkeypatch.setattr(overhead_history, "history_uris",
                        lambda job_uri, environ=None: [(os.environ if environ is None else environ)[overhead_history.ENV_URI]])
