"""A job told where its checkpoint store is, and what an attempt in another region costs, runs in the store's
region under real Airflow (dag.test, local backend) when the cheaper regions do not pay for the transfer;
the same options given wrong fail at parse time, naming the fix."""
from __future__ import annotations

import pytest

from airflow_fixtures import airflow_db, airflow_threads_released, run_dag  # noqa: F401
from airflow_fixtures import FAST_SEGMENT_OPTIONS, backend_options, build_dag, job_store, protocol_command, ti_states

from airflow_spot.operators.training import SpotTrainingConfigError
from airflow_spot.storage.ledger_store import LedgerStore

pytestmark = pytest.mark.timeout(240)


def _run(tmp_path, name, **options):
    dag = build_dag(name, tmp_path, command=protocol_command("--step-seconds", "0.02"), total_steps=10,
                    steps_per_segment=10, backend_options=backend_options(tmp_path), max_preemptions=1, retries=0,
                    segment_options={**FAST_SEGMENT_OPTIONS, **options})
    dr = run_dag(dag)
    assert ti_states(dr)["train.segment_000"] == ("success", 1)
    return LedgerStore(job_store(tmp_path, dr.run_id)).rows()


def test_the_attempt_runs_in_the_stores_region_when_moving_there_costs_more_than_it_saves(airflow_db, tmp_path):  # noqa: F811
    anywhere = _run(tmp_path / "a", "region_free")
    assert anywhere[0].region != "us-east-1"
    priced = _run(tmp_path / "b", "region_priced", checkpoint_region="us-east-1", transfer_seconds=60.0,
                  transfer_dollars=1.0)
    assert [r.region for r in priced] == ["us-east-1"] and priced[0].transfer_dollars == 0.0
    # a transfer too cheap to keep the job home: it runs elsewhere and its ledger row carries the egress
    cheap = _run(tmp_path / "c", "region_cheap", checkpoint_region="us-east-1", transfer_dollars=0.0001)
    assert cheap[0].region != "us-east-1" and cheap[0].transfer_dollars == 0.0001
    assert cheap[0].cost == pytest.approx(cheap[0].billed_seconds / 3600 * cheap[0].price_per_hour + 0.0001)


@pytest.mark.parametrize("options, message", [
    ({"transfer_dollars": 1.0}, "checkpoint_region"),
    ({"checkpoint_region": "us-east-1", "transfer_seconds": -1}, "must be a number >= 0"),
    ({"checkpoint_region": "", "transfer_dollars": 1.0}, "region name"),
])
def test_transfer_costs_given_wrong_fail_at_parse_time(tmp_path, options, message):
    with pytest.raises(SpotTrainingConfigError, match=message):
        build_dag("region_bad", tmp_path, command=["true"], total_steps=10, steps_per_segment=10,
                  backend_options=backend_options(tmp_path), segment_options=options)
