"""A spot training job whose checkpoints live in S3 (moto's server on 127.0.0.1): the Airflow side reaches
the bucket through an Airflow AWS connection (S3Hook), the instance's agent through the endpoint the hook
hands it; both see the same protocol objects."""
from __future__ import annotations

import json

import pytest

from airflow_fixtures import (  # noqa: F401
    airflow_threads_released,
    airflow_db,
    backend_options,
    build_dag,
    leftover_processes,
    protocol_command,
    run_dag,
    ti_states,
)
from airflow_spot.testing.moto_s3 import create_bucket, moto_server

pytestmark = pytest.mark.timeout(180)


def test_job_with_s3_checkpoints(airflow_db, tmp_path, monkeypatch):  # noqa: F811
    with moto_server() as endpoint:
        create_bucket(endpoint, "spot-ckpt")
        conn = {"conn_type": "aws", "login": "testing", "password": "testing",
                "extra": {"region_name": "us-east-1", "endpoint_url": endpoint}}
        monkeypatch.setenv("AIRFLOW_CONN_SPOT_S3", json.dumps(conn))
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        dag = build_dag(
            "s3_job",
            tmp_path,
            command=protocol_command("--step-seconds", "0.03"),
            total_steps=120,
            steps_per_segment=60,
            checkpoint_uri="s3://spot-ckpt/{{ dag.dag_id }}/{{ run_id }}",
            aws_conn_id="spot_s3",
            backend_options=backend_options(tmp_path, [1.5, None]),
            max_preemptions=2,
        )
        dr = run_dag(dag)
        assert ti_states(dr)["train.finish"][0] == "success", ti_states(dr)

        from airflow_spot.hooks.spot import SpotHook
        from airflow_spot.operators.training import SUMMARY_KEY

        store = SpotHook(aws_conn_id="spot_s3").get_store(f"s3://spot-ckpt/s3_job/{dr.run_id}")
        summary = json.loads(store.get_bytes(SUMMARY_KEY))
        assert summary["completed"] and summary["preemptions"] == 1
        assert any(k.startswith("checkpoints/000000000120-") for k in store.list("checkpoints/"))
    assert not leftover_processes(tmp_path)
