"""A job told where its checkpoint store is, and what an attempt in another region costs, runs in the store's
region under real Airflow (dag.test, local backend) when the cheaper regions do not pay for the transfer;
the same options given wrong fail at parse time, naming the fix."""
from __future__ import annotations

import pytest

from airflow_fixtures import airflow_db, airflow_threads_released, run_dag  # noqa: F401
from airflow_fixtures import FAST_SEGMENT_OPTIONS, backend_options, build_dag, job_store, protocol_command, ti_states

from airflow_spot.operators.training import SpotTrainingConfigError
from airflow_spot.policy.transfer import GIB
from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store

pytestmark = pytest.mark.timeout(240)


def _run(tmp_path, name, checkpoint_uri=None, **options):
    extra = {"checkpoint_uri": checkpoint_uri} if checkpoint_uri else {}
    dag = build_dag(name, tmp_path, command=protocol_command("--step-seconds", "0.02"), total_steps=10,
                    steps_per_segment=10, backend_options=backend_options(tmp_path), max_preemptions=1, retries=0,
                    segment_options={**FAST_SEGMENT_OPTIONS, **options}, **extra)
    dr = run_dag(dag)
    assert ti_states(dr)["train.segment_000"] == ("success", 1)
    return LedgerStore(open_store(checkpoint_uri) if checkpoint_uri else job_store(tmp_path, dr.run_id)).rows()


def _seeded(uri: str, size: int) -> int:
    """A job store holding a checkpoint at step 5 of 10 of ``size`` bytes, as an earlier try left it; the size
    the plan prices (the manifest's)."""
    return CheckpointStore(open_store(uri).child("checkpoints"), writer="seed").save(
        5, lambda f: f.write(b"x" * size)).size


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


def test_the_transfer_grows_with_the_newest_checkpoint(airflow_db, tmp_path):  # noqa: F811
    # restoring 1 MiB at $1024 a GiB is $1 a move: as the flat $1 above, the job stays in the store's region
    uri = f"file://{tmp_path}/big/jobs/seeded"
    _seeded(uri, 1 << 20)
    priced = _run(tmp_path / "big", "region_per_gib", checkpoint_uri=uri, checkpoint_region="us-east-1",
                  transfer_dollars_per_gib=1024.0)
    assert [r.region for r in priced] == ["us-east-1"] and priced[0].transfer_dollars == 0.0
    # at $0.02 a GiB it moves, and its row carries the restore of that checkpoint (its saves back are priced
    # by the hour at the measured step time, which this job's first try has not measured yet)
    uri = f"file://{tmp_path}/small/jobs/seeded"
    size = _seeded(uri, 1 << 20)
    cheap = _run(tmp_path / "small", "region_per_gib_cheap", checkpoint_uri=uri, checkpoint_region="us-east-1",
                 transfer_dollars_per_gib=0.02)
    assert cheap[0].region != "us-east-1"
    assert cheap[0].transfer_dollars == pytest.approx(size / GIB * 0.02)


def test_auto_asks_the_bucket_for_its_region(airflow_db, tmp_path, monkeypatch):  # noqa: F811
    import json

    import boto3

    from airflow_spot.testing.moto_s3 import moto_server

    with moto_server() as endpoint:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="ckpt-home")
        monkeypatch.setenv("AIRFLOW_CONN_SPOT_S3", json.dumps({
            "conn_type": "aws", "login": "testing", "password": "testing",
            "extra": {"region_name": "us-east-1", "endpoint_url": endpoint}}))
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        uri = "s3://ckpt-home/job"
        _seeded_s3 = CheckpointStore(open_store(uri, endpoint_url=endpoint).child("checkpoints"), writer="seed")
        _seeded_s3.save(5, lambda f: f.write(b"x" * (1 << 20)))
        dag = build_dag("region_auto", tmp_path, command=protocol_command("--step-seconds", "0.02"),
                        total_steps=10, steps_per_segment=10, backend_options=backend_options(tmp_path),
                        max_preemptions=1, retries=0, checkpoint_uri=uri, aws_conn_id="spot_s3",
                        segment_options={**FAST_SEGMENT_OPTIONS, "checkpoint_region": "auto",
                                         "transfer_dollars_per_gib": 1024.0})
        dr = run_dag(dag)
        assert ti_states(dr)["train.segment_000"] == ("success", 1)
        rows = LedgerStore(open_store(uri, endpoint_url=endpoint)).rows()
    assert [r.region for r in rows] == ["us-east-1"]


def test_auto_on_a_store_without_a_region_prices_nothing(airflow_db, tmp_path):  # noqa: F811
    rows = _run(tmp_path, "region_auto_file", checkpoint_region="auto", transfer_dollars=1.0)
    assert rows[0].region != "us-east-1" and rows[0].transfer_dollars == 0.0


def test_auto_names_the_permission_when_s3_refuses_to_say(tmp_path):
    from airflow.sdk.exceptions import AirflowFailException
    from botocore.exceptions import ClientError

    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.object_store import LocalStore

    class Refusing(LocalStore):  # a role without s3:GetBucketLocation, as S3 answers it
        def region(self):
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "GetBucketLocation")

    op = SpotSegmentOperator(task_id="t", command=["true"], checkpoint_uri=f"file://{tmp_path}", start_step=0,
                             end_step=1, total_steps=1, checkpoint_region="auto")
    with pytest.raises(AirflowFailException, match="allow s3:GetBucketLocation .* or give the region"):
        op._checkpoint_transfer(Refusing(tmp_path), None, None)


@pytest.mark.parametrize("options, message", [
    ({"transfer_dollars": 1.0}, "checkpoint_region"),
    ({"checkpoint_region": "us-east-1", "transfer_seconds": -1}, "must be a number >= 0"),
    ({"checkpoint_region": "", "transfer_dollars": 1.0}, "region name"),
    ({"transfer_dollars_per_gib": 0.02}, "checkpoint_region"),
    ({"checkpoint_region": "auto", "transfer_seconds_per_gib": "5"}, "must be a number >= 0"),
])
def test_transfer_costs_given_wrong_fail_at_parse_time(tmp_path, options, message):
    with pytest.raises(SpotTrainingConfigError, match=message):
        build_dag("region_bad", tmp_path, command=["true"], total_steps=10, steps_per_segment=10,
                  backend_options=backend_options(tmp_path), segment_options=options)
