"""A segment that finds no capacity anywhere, and whose plan is to wait for spot, waits under real Airflow
(dag.test) on the real local backend without spending tries: it defers on a timer and decides again,
as the simulator's replay of `ours` rechecks a waiting job every minute. Tries are for preemptions and
code failures; an outage longer than a few quick retries used to exhaust them and fail the job."""
from __future__ import annotations

import json

import pytest

from airflow_fixtures import airflow_db, airflow_threads_released, run_dag  # noqa: F401
from airflow_fixtures import (
    FAST_SEGMENT_OPTIONS,
    backend_options,
    build_dag,
    job_store,
    leftover_processes,
    protocol_command,
    ti_states,
)

from airflow_spot.operators.planning import AvailabilityRecorder
from airflow_spot.storage.ledger_store import LedgerStore

pytestmark = pytest.mark.timeout(240)


def _capacity_trace(tmp_path, down_seconds: int, up_seconds: int = 3600):
    path = tmp_path / "us-west-2b_v100_1.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 1}, "data": [0] * down_seconds + [1] * up_seconds + [0] * 10}))
    opts = backend_options(tmp_path)
    opts["preemption"] = {"mode": "trace", "path": str(path), "capacity": True, "start_offset_seconds": 0}
    return opts


@pytest.mark.parametrize("deferrable", [True, False])
def test_a_spot_only_job_waits_out_an_outage_in_one_try(airflow_db, tmp_path, deferrable):  # noqa: F811
    # no deadline: spot only. Every spot pool refuses for the first 6 s of the job; the segment rechecks
    # every second, 6 times or more, within its first try
    dag = build_dag(
        f"capacity_wait_{int(deferrable)}", tmp_path,
        command=protocol_command("--step-seconds", "0.02"), total_steps=20, steps_per_segment=20,
        backend_options=_capacity_trace(tmp_path, down_seconds=6),
        max_preemptions=1, retries=0,
        segment_options={**FAST_SEGMENT_OPTIONS, "capacity_recheck_seconds": 1.0, "deferrable": deferrable},
    )
    dr = run_dag(dag)
    states = ti_states(dr)
    assert states["train.segment_000"] == ("success", 1), states
    store = job_store(tmp_path, dr.run_id)
    kinds = [e.kind for e in AvailabilityRecorder(store, None, "j").job_events()]
    assert kinds.count("refused") >= 6 and kinds[-1] == "launched", kinds
    rows = LedgerStore(store).rows()
    assert [(r.market, r.outcome) for r in rows] == [("spot", "completed")], rows
    assert not leftover_processes(tmp_path)


def test_a_wait_past_max_capacity_wait_fails_naming_the_fix(airflow_db, tmp_path):  # noqa: F811
    dag = build_dag(
        "capacity_wait_cap", tmp_path,
        command=protocol_command("--step-seconds", "0.02"), total_steps=20, steps_per_segment=20,
        backend_options=_capacity_trace(tmp_path, down_seconds=3600),
        max_preemptions=1, retries=0,
        segment_options={**FAST_SEGMENT_OPTIONS, "capacity_recheck_seconds": 1.0, "max_capacity_wait_seconds": 3.0},
    )
    dr = run_dag(dag)
    states = ti_states(dr)
    assert states["train.segment_000"] == ("failed", 1), states
    store = job_store(tmp_path, dr.run_id)
    assert LedgerStore(store).rows() == []
    assert not leftover_processes(tmp_path)


def test_the_failure_says_how_long_it_waited_and_what_to_change(tmp_path):
    import time
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowFailException

    from airflow_spot.operators.segment import NoCapacityNow, SpotSegmentOperator
    from airflow_spot.storage.object_store import open_store

    op = SpotSegmentOperator(task_id="segment_000", command=["true"], checkpoint_uri=f"file://{tmp_path}/job",
                             start_step=0, end_step=10, total_steps=10, backend_options=backend_options(tmp_path),
                             capacity_recheck_seconds=30.0, max_capacity_wait_seconds=600.0)
    context = {"ti": SimpleNamespace(try_number=1, id="0193aaaa-bbbb-7ccc-8ddd-eeeeffff0000")}
    store = open_store(f"file://{tmp_path}/job")
    no_capacity = NoCapacityNow("no offer could be launched now")
    assert op._capacity_wait(context, no_capacity) == 30.0  # the wait starts now
    key = f"control/capacity_wait/{op.attempt_id(context, store)}.json"
    store.put_bytes(key, json.dumps({"since": time.time() - 590}).encode())
    assert 1.0 <= op._capacity_wait(context, no_capacity) <= 10.0  # never sleeps past the cap
    store.put_bytes(key, json.dumps({"since": time.time() - 700}).encode())
    with pytest.raises(AirflowFailException, match=r"no capacity in any of the job's offers for 0\.1\d h .*"
                                                   r"max_capacity_wait_seconds"):
        op._capacity_wait(context, no_capacity)
