"""Fixtures of the end-to-end tests: one production-like Airflow per pytest session (per worker under
pytest-xdist: each stack claims a PostgreSQL database and a Redis database of its own, so two run side by side).

``airflow_stack`` (session) starts PostgreSQL-backed Airflow with the CeleryExecutor on Redis (see
``airflow_stack.py``) with every DAG file of ``tests/e2e/dags/`` in its dags folder, and stops it at the
end of the session, failures included. A test module may add DAG files of its own by listing them in a
module-level ``E2E_DAG_FILES = {path: [dag_id, ...]}`` and using the ``e2e_dags`` fixture.

When a test fails, the tails of every Airflow process log are attached to its report. The full logs (and
task logs, checkpoints, instance state) stay in ``$TMPDIR/airflow-spot-e2e/session-*`` (printed at the
start); the newest ``KEEP_SESSIONS`` are kept. pytest's own tmp dirs are not used because parallel pytest
sessions rotate them away while a stack still runs.

Without PostgreSQL or Redis on 127.0.0.1 the e2e tests are skipped with the reason; deselect them with
``-m "not e2e"``.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from airflow_stack import AirflowStack, services_available  # noqa: E402

E2E_DAGS_DIR = Path(__file__).parent / "dags"
SESSIONS_DIR = Path(tempfile.gettempdir()) / "airflow-spot-e2e"
KEEP_SESSIONS = 5
_STACK_KEY = pytest.StashKey[AirflowStack]()


def session_root() -> Path:
    """A new directory for this session's stack; older sessions' directories beyond the newest few go."""
    SESSIONS_DIR.mkdir(parents=True, exist_ok=True)
    old = sorted(SESSIONS_DIR.glob("session-*"), key=lambda p: p.stat().st_mtime)
    for path in old[: max(0, len(old) - (KEEP_SESSIONS - 1))]:
        shutil.rmtree(path, ignore_errors=True)
    root = SESSIONS_DIR / f"session-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    root.mkdir()
    return root


@pytest.fixture(scope="session")
def airflow_stack(request):
    reason = services_available()
    if reason:
        pytest.skip(reason)
    root = session_root()
    stack = AirflowStack(root=root, dag_files=sorted(E2E_DAGS_DIR.glob("*.py")))
    print(f"\n[e2e] Airflow stack in {root} (logs in {stack.logs})", file=sys.stderr)
    request.config.stash[_STACK_KEY] = stack
    stack.start()
    print(f"[e2e] healthy after {stack.startup_seconds:.1f} s on {stack.base_url}", file=sys.stderr)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def e2e_dags(airflow_stack, request):
    """Copy the module's ``E2E_DAG_FILES`` into the stack's dags folder and wait until they are parsed."""
    files = getattr(request.module, "E2E_DAG_FILES", {})
    for path, dag_ids in files.items():
        airflow_stack.add_dag_file(Path(path), dag_ids)
    return airflow_stack


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    stack = item.config.stash.get(_STACK_KEY, None)
    if stack is not None and report.failed and "airflow_stack" in getattr(item, "fixturenames", ()):
        report.sections.append(("Airflow process logs (tails)", stack.log_tails(lines=60)))
