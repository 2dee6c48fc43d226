"""``airflow-spot reap`` and its AWS connection: a named one, or none (boto3's default credential chain)."""
from __future__ import annotations

import json

import pytest

from airflow_spot.cli import main
from airflow_spot.testing.moto_s3 import moto_server


def test_an_undefined_connection_names_the_flag_for_the_default_chain(monkeypatch, capsys):
    monkeypatch.delenv("AIRFLOW_CONN_MISSING", raising=False)
    assert main(["reap", "--backend", "ec2", "--aws-conn-id", "missing", "--runs", "any", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "'missing' is not defined" in err and "--aws-conn-id none" in err and "aws_conn_id=None" not in err


def test_aws_conn_id_none_uses_boto3s_default_credential_chain(monkeypatch, capsys):
    monkeypatch.delenv("AIRFLOW_CONN_AWS_DEFAULT", raising=False)  # no connection: the environment leads to moto
    with moto_server() as endpoint:  # which also sets fake credentials and a region in the environment
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        # a tag no other test's instance has: moto's state is the process's, shared by every server in it
        assert main(["reap", "--backend", "ec2", "--aws-conn-id", "None", "--runs", "any", "--dry-run",
                     "--tag", "airflow-spot:dag=reap-credential-chain-test"]) == 0
    assert "no live instances match" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["reap", "--help"])
    assert "'none': no connection, boto3's default credential chain" in " ".join(capsys.readouterr().out.split())


def test_a_state_dir_that_does_not_exist_is_named_and_not_created(tmp_path, monkeypatch, capsys):
    # a mistyped path: before, a dry run created it (and its subfolders) and said only "no live instances match"
    missing = tmp_path / "typo"
    assert main(["reap", "--dry-run", "--backend-options", json.dumps({"state_dir": str(missing)})]) == 0
    out = capsys.readouterr().out
    assert "no live instances match" in out and f"state_dir {missing} does not exist" in out, out
    assert not missing.exists()
    monkeypatch.setenv("AIRFLOW_SPOT_LOCAL_DIR", str(missing))
    assert main(["reap"]) == 0
    assert f"AIRFLOW_SPOT_LOCAL_DIR {missing} does not exist" in capsys.readouterr().out
    assert not missing.exists()
    # an unknown option is still named, whatever the state_dir
    assert main(["reap", "--backend-options", json.dumps({"state_dir": str(missing), "bogus": 1})]) == 2
    assert "takes no option(s) ['bogus']" in capsys.readouterr().err
