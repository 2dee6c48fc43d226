"""Helpers shared by the local backend tests (imported as ``local_helpers``; tests/backends is on sys.path)."""
from __future__ import annotations

import sys
import time


from airflow_spot.backends.base import InstanceState, LaunchSpec
from airflow_spot.backends.local import LocalBackend
from airflow_spot.backends.local_state import group_alive
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.protocol import SegmentRequest
from airflow_spot.testing.polling import wait_for  # noqa: F401 - re-exported for the backend tests

OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.40, 1.006, "A10G", 1, 24.0)




def leftover_processes(backend: LocalBackend, timeout: float = 3.0) -> list[str]:
    """Processes of terminated instances still alive after ``timeout`` (agent group or supervisor)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for instance_id in backend.state.instance_ids():
            record = backend.state.read(instance_id)
            if not InstanceState(record.info.state).is_terminal():
                continue
            if group_alive(record.pgid):
                left.append(f"{instance_id}: process group {record.pgid}")
            if record.supervisor is not None and record.supervisor.alive():
                left.append(f"{instance_id}: preemption supervisor {record.supervisor.pid}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def spec(job_uri: str, token: str = "tok-1", idle: float = 30.0, **tags) -> LaunchSpec:
    return LaunchSpec(offer=OFFER, job_uri=job_uri, idempotency_token=token,
                      tags={"airflow-spot:dag": "d", **tags}, idle_timeout_seconds=idle)


def request(job_uri: str, attempt_id: str, code: str, **kwargs) -> SegmentRequest:
    """A request whose command is ``python -c code``."""
    kwargs.setdefault("created_at", time.time())
    return SegmentRequest(attempt_id=attempt_id, job_uri=job_uri, segment_index=0, start_step=0, end_step=10,
                          command=[sys.executable, "-c", code], **kwargs)
