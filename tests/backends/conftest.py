"""Fixtures of the local backend tests: a private state dir, a job store, and a leak check after each test."""
from __future__ import annotations

import pytest
from local_helpers import leftover_processes

from airflow_spot.backends.base import InstanceState, get_backend
from airflow_spot.backends.local import LocalBackend
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout


@pytest.fixture
def make_backend(tmp_path):
    """Build local backends on one private state dir; after the test, everything they launched must be
    gone: instances that ended on their own must have left nothing, the rest is terminated and checked."""
    built: list[LocalBackend] = []

    def make(**kwargs) -> LocalBackend:
        kwargs.setdefault("state_dir", str(tmp_path / "state"))
        kwargs.setdefault("terminate_grace_seconds", 3.0)
        backend = get_backend("local", **kwargs)
        built.append(backend)
        return backend

    yield make
    if built:
        backend = built[0]
        leaked_by_ended = leftover_processes(backend, timeout=3.0)
        live = [i.instance_id for i in backend.list_instances() if not InstanceState(i.state).is_terminal()]
        backend.terminate(live)
        leaked = leftover_processes(backend, timeout=3.0)
        assert not leaked_by_ended, f"instances that ended left processes behind: {leaked_by_ended}"
        assert not leaked, f"processes left after terminate: {leaked}"


@pytest.fixture
def backend(make_backend) -> LocalBackend:
    return make_backend()


@pytest.fixture
def job_uri(tmp_path) -> str:
    return "file://" + str(tmp_path / "job")


@pytest.fixture
def layout(job_uri) -> JobLayout:
    return JobLayout(open_store(job_uri))
