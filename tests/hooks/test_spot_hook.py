"""SpotHook opens s3:// stores through the Amazon provider's S3Hook (an Airflow AWS connection)."""
from __future__ import annotations

import json

import pytest

from airflow_spot.hooks.spot import SpotHook
from airflow_spot.storage.object_store import LocalStore, S3Store, StoreConfigError
from airflow_spot.testing.moto_s3 import create_bucket, moto_server


@pytest.fixture(scope="module")
def aws_conn():
    with moto_server() as endpoint:
        create_bucket(endpoint, "ckpt")
        conn = {
            "conn_type": "aws",
            "login": "testing",
            "password": "testing",
            "extra": {"region_name": "us-east-1", "endpoint_url": endpoint,
                      "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 7}}},
        }
        mp = pytest.MonkeyPatch()
        mp.setenv("AIRFLOW_CONN_SPOT_TEST", json.dumps(conn))
        # no endpoint in the process environment: the connection alone must lead to the server
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        yield endpoint
        mp.undo()


def test_s3_store_uses_the_connection(aws_conn):
    hook = SpotHook(aws_conn_id="spot_test")
    store = hook.get_store("s3://ckpt/dag/run1")
    assert isinstance(store, S3Store) and store.uri == "s3://ckpt/dag/run1"
    store.check_writable()
    store.child("control").put_bytes("x.json", b"{}")
    assert store.list("control/") == ["control/x.json"]
    # the instance's agent gets the endpoint (no secrets) to reach the same store
    assert hook.instance_env("s3://ckpt/dag/run1") == {"AWS_ENDPOINT_URL_S3": aws_conn,
                                                        "AIRFLOW_SPOT_CHECKPOINT_DIGEST": "block"}


def test_the_s3_client_has_room_for_concurrent_reads_and_keeps_the_connections_config(aws_conn):
    hook = SpotHook(aws_conn_id="spot_test")
    config = hook.get_store("s3://ckpt/a").client.meta.config
    assert config.max_pool_connections == SpotHook.S3_POOL_CONNECTIONS > 10  # botocore's default is 10
    assert config.retries == {"mode": "standard", "total_max_attempts": 7}
    # one client for every store the hook opens (the UI's list opens many)
    assert hook.get_store("s3://ckpt/b").client is hook.get_store("s3://ckpt/a").client


def test_a_connection_that_asks_for_a_larger_pool_keeps_it(aws_conn, monkeypatch):
    conn = {"conn_type": "aws", "login": "testing", "password": "testing",
            "extra": {"region_name": "us-east-1", "endpoint_url": aws_conn,
                      "config_kwargs": {"max_pool_connections": 100}}}
    monkeypatch.setenv("AIRFLOW_CONN_SPOT_BIG_POOL", json.dumps(conn))
    store = SpotHook(aws_conn_id="spot_big_pool").get_store("s3://ckpt/a")
    assert store.client.meta.config.max_pool_connections == 100


def test_missing_bucket_is_a_clear_error(aws_conn):
    store = SpotHook(aws_conn_id="spot_test").get_store("s3://no-such-bucket/x")
    with pytest.raises(StoreConfigError, match="'s3://no-such-bucket/x' is not writable.*NoSuchBucket"):
        store.check_writable()


def test_file_store_needs_no_connection(tmp_path):
    hook = SpotHook(aws_conn_id="does_not_exist")
    store = hook.get_store(f"file://{tmp_path}/job")
    assert isinstance(store, LocalStore)
    assert hook.instance_env(f"file://{tmp_path}/job") == {"AIRFLOW_SPOT_CHECKPOINT_DIGEST": "block"}


def test_unwritable_file_store_is_a_clear_error(tmp_path):
    # (tests run as root here, so permissions cannot make a directory unwritable: a file in the way can)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    store = SpotHook().get_store(f"file://{blocker}/job")
    with pytest.raises(StoreConfigError, match="is not writable.*pass a checkpoint_uri"):
        store.check_writable()


def test_the_workers_checkpoint_digest_setting_reaches_the_instances(tmp_path, monkeypatch):
    # set on the Airflow workers while a deployment is upgraded across block digests, it must reach the
    # training processes, which write the checkpoints
    from airflow_spot.storage.checkpoint import DIGEST_ENV

    hook = SpotHook(aws_conn_id="does_not_exist")
    monkeypatch.setenv(DIGEST_ENV, "sha256")
    assert hook.instance_env(f"file://{tmp_path}/job") == {DIGEST_ENV: "sha256"}
    monkeypatch.delenv(DIGEST_ENV)  # unset: said, so a warm instance launched while it was set follows
    assert hook.instance_env(f"file://{tmp_path}/job") == {DIGEST_ENV: "block"}
    monkeypatch.setenv(DIGEST_ENV, "fast")
    with pytest.raises(ValueError, match="AIRFLOW_SPOT_CHECKPOINT_DIGEST='fast' is not a checkpoint digest"):
        hook.instance_env(f"file://{tmp_path}/job")
