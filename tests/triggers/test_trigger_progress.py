"""The segment trigger writes a progress line (%, steps/s, ETA, cost so far) to the task log at a bounded rate."""
from __future__ import annotations

import asyncio
import json
import logging
import time

from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import Heartbeat, JobLayout
from airflow_spot.triggers.segment import PROGRESS_READS, SegmentTrigger

OFFER = {
    "instance_type": "g4dn.xlarge", "region": "us-east-1", "zone": "us-east-1a", "market": "spot",
    "price_per_hour": 0.36, "on_demand_price_per_hour": 0.526, "gpu_name": "T4", "gpu_count": 1,
    "gpu_memory_gib": 16.0, "relative_throughput": 0.4, "preemption_rate_per_hour": 0.1,
}


def test_progress_line_at_a_bounded_rate(tmp_path, capsys, caplog, monkeypatch):
    from airflow_spot.storage.object_store import LocalStore

    monkeypatch.setattr(LocalStore, "RACY_SECONDS", 0.0)  # files written just now count as settled
    store = open_store(f"file://{tmp_path}")
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": time.time() - 100, "total_steps": 400}).encode())
    AttemptLaunch("seg0.try1", 0, 0, 400, "i-1", OFFER, time.time() - 100, time.time() - 100, False, 1, "seg0",
                  resume_step=0).write(store)
    JobLayout(store).write_heartbeat(Heartbeat("seg0.try1", step=100, time=time.time(), step_time_ewma=0.5))
    trigger = SegmentTrigger(job_uri=store.uri, attempt_id="seg0.try1", instance_id="i-1",
                             requested_at=time.time() - 100, poll_interval=0.5)
    assert trigger._progress_every() == 5.0
    assert SegmentTrigger(job_uri="x", attempt_id="a", instance_id="i", requested_at=0,
                          poll_interval=30)._progress_every() == 60.0

    seen: list[str] = []

    def lines() -> list[str]:  # Airflow's logging goes to stdout (structlog; stderr once a command of
        # airflow-spot ran in this process: airflow_lookups.logs_to_stderr) or to the logging records
        captured = capsys.readouterr()
        seen.extend(line for line in (captured.out + captured.err).splitlines() if "progress:" in line)
        seen.extend(r.getMessage() for r in caplog.records if "progress:" in r.getMessage())
        caplog.clear()
        return seen

    with caplog.at_level(logging.INFO):
        asyncio.run(trigger._log_progress(store))  # the first call only starts the clock
        assert lines() == []
        trigger._progress_logged_at -= 6.0  # one interval later
        asyncio.run(trigger._log_progress(store))
        asyncio.run(trigger._log_progress(store))  # too soon after the last line: nothing
    assert len(lines()) == 1
    line = lines()[0]
    assert "step 100 of 400 (25.0 %)" in line and "2.00 steps/s" in line
    assert "ETA " in line and "ETA ?" not in line
    assert "cost so far $0.01" in line  # 100 s at $0.36/h

    # the attempt beats on: the next line reads the new heartbeat (the records read for the last line and
    # not written since come from the triggerer's cache)
    JobLayout(store).write_heartbeat(Heartbeat("seg0.try1", step=200, time=time.time() + 1, step_time_ewma=0.5))
    hits = PROGRESS_READS.hits
    with caplog.at_level(logging.INFO):
        trigger._progress_logged_at -= 6.0
        asyncio.run(trigger._log_progress(store))
    assert len(lines()) == 2 and "step 200 of 400 (50.0 %)" in lines()[1]
    assert PROGRESS_READS.hits > hits  # the launch, read for the first line, was not read again
