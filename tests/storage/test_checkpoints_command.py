"""``airflow-spot checkpoints list|verify|restore`` on file:// and s3:// (moto server on 127.0.0.1)."""
from __future__ import annotations

import pytest

from airflow_spot.cli import main
from airflow_spot.storage.checkpoint import MANIFEST, QUARANTINE, CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.testing.manifest_faults import build_store, payload_for


@pytest.fixture(scope="module")
def s3_endpoint():
    from airflow_spot.testing.moto_s3 import create_bucket, moto_server

    with moto_server() as endpoint:
        create_bucket(endpoint, "cli")
        yield endpoint


@pytest.fixture(params=["file", "s3"])
def job(request, tmp_path, monkeypatch):
    """(job URI, its CheckpointStore) with checkpoints at steps 100, 200, 300."""
    if request.param == "file":
        uri = f"file://{tmp_path}/job"
        store = open_store(uri)
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)  # how a user points the command at MinIO/moto
        uri = f"s3://cli/{tmp_path.name}/job"
        store = open_store(uri, endpoint_url=endpoint)
    ckpts = CheckpointStore(store.child("checkpoints"), writer="seg.try1")
    build_store(ckpts, [100, 200, 300])
    return uri, ckpts


def _read(path: str) -> bytes:
    return open(path, "rb").read()


def _break_payload(ckpts: CheckpointStore, step: int) -> str:
    m = next(m for m in ckpts.committed() if m.step == step)
    ckpts.store.put_bytes(f"{m.directory}/state.pt", b"flipped" + payload_for(step)[7:])
    return m.directory


def test_list_shows_every_checkpoint_and_what_is_wrong(job, capsys):
    uri, ckpts = job
    broken = _break_payload(ckpts, 300)
    assert main(["checkpoints", "list", uri]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "[0000" in line]
    assert [line.split()[1 if line.startswith("*") else 0] for line in lines] == ["100", "200", "300"]
    assert lines[1].startswith("*") and " ok " in lines[1]  # step 200 is what a resume uses
    assert broken in lines[2] and "BROKEN" in lines[2] and "sha256 mismatch" in lines[2]
    assert "seg.try1" in lines[0] and "B " in lines[0]  # writer and size
    assert all("block 64 KiB" in line for line in lines)  # the digest, as build_store saves it
    assert "AIRFLOW_SPOT_CHECKPOINT_DIGEST" not in out  # the upgrade hint only when asked
    assert main(["checkpoints", "list", "--verbose", uri]) == 0
    out = capsys.readouterr().out
    assert "3 checkpoint(s) name a block SHA-256" in out and "AIRFLOW_SPOT_CHECKPOINT_DIGEST=sha256" in out
    ckpts.block_bytes = 0  # what a deployment mid-upgrade saves
    ckpts.save(400, lambda f: f.write(payload_for(400)))
    assert main(["checkpoints", "list", uri]) == 0
    out = capsys.readouterr().out
    assert "sha256 " in [line for line in out.splitlines() if "[000000000400" in line][0]
    assert main(["checkpoints", "list", "--quick", uri]) == 0  # manifests only: the payload damage is not seen
    assert "BROKEN" not in capsys.readouterr().out


def test_verify_exits_non_zero_naming_each_broken_checkpoint(job, capsys):
    uri, ckpts = job
    assert main(["checkpoints", "verify", uri]) == 0
    assert "all 3 checkpoints" in capsys.readouterr().out
    broken_payload = _break_payload(ckpts, 200)
    manifest_key = next(f"{m.directory}/{MANIFEST}" for m in ckpts.committed() if m.step == 300)
    ckpts.store.put_bytes(manifest_key, b"{not json")
    assert main(["checkpoints", "verify", uri]) == 1
    out = capsys.readouterr().out
    assert broken_payload in out and manifest_key.split("/")[0] in out
    assert "2 of 3 checkpoints" in out and "a resume uses step 100" in out


def test_restore_step_quarantines_newer_checkpoints_and_loses_nothing(job, capsys):
    uri, ckpts = job
    before = {k: ckpts.store.get_bytes(k) for k in ckpts.store.list()}
    assert main(["checkpoints", "restore", "--step", "200", "--dry-run", uri]) == 0
    assert "would move step 300" in capsys.readouterr().out and ckpts.latest_step() == 300
    assert main(["checkpoints", "restore", "--step", "200", uri]) == 0
    assert "a resume now starts from step 200" in capsys.readouterr().out
    manifest, data = ckpts.restore_latest(_read)
    assert (manifest.step, data) == (200, payload_for(200))
    after = {k: ckpts.store.get_bytes(k) for k in ckpts.store.list()}
    moved = {k: v for k, v in before.items() if k not in after}
    assert moved and all(k.startswith("000000000300-") for k in moved)
    assert {f"{QUARANTINE}/{k}": v for k, v in moved.items()} == {k: v for k, v in after.items() if k not in before}


def test_restore_recovers_a_job_whose_newest_checkpoints_are_all_broken(job, capsys):
    uri, ckpts = job
    for step in (200, 300):
        key = next(f"{m.directory}/{MANIFEST}" for m in ckpts.committed() if m.step == step)
        ckpts.store.put_bytes(key, b"")
    assert main(["checkpoints", "restore", "--step", "200", uri]) == 2  # step 200 does not verify
    assert "no verified checkpoint at step 200" in capsys.readouterr().err
    assert main(["checkpoints", "restore", "--step", "100", uri]) == 0
    assert main(["checkpoints", "verify", uri]) == 0  # the broken ones are set aside, not deleted
    assert len([k for k in ckpts.store.list() if k.startswith(QUARANTINE + "/")]) == 4


def test_restore_to_path_copies_a_verified_payload_and_leaves_the_store(job, tmp_path, capsys):
    uri, ckpts = job
    before = ckpts.store.list()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert main(["checkpoints", "restore", "--step", "100", "--to", str(out_dir), uri]) == 0
    assert (out_dir / "state.pt").read_bytes() == payload_for(100)
    assert ckpts.store.list() == before


def test_checkpoints_prefix_itself_is_accepted(job, capsys):
    uri, _ = job
    assert main(["checkpoints", "verify", uri.rstrip("/") + "/checkpoints"]) == 0
    assert "all 3 checkpoints" in capsys.readouterr().out


def test_bad_uri_says_what_is_wrong(capsys):
    assert main(["checkpoints", "list", "s3:/bad"]) == 2
    err = capsys.readouterr().err
    assert "has the scheme 's3' but not the '//'" in err and "s3://bad" in err


def test_a_local_path_that_does_not_exist_is_an_error_not_an_empty_store(tmp_path, capsys):
    missing = tmp_path / "jbo-typo"
    for action in (["list"], ["verify"], ["restore", "--step", "3"]):
        assert main(["checkpoints", *action, str(missing)]) == 2
        assert f"{missing} does not exist; give the job's checkpoint_uri" in capsys.readouterr().err
    assert not missing.exists()  # reading creates nothing
    (missing / "control").mkdir(parents=True)  # a job store without checkpoints is an empty store: no error
    (missing / "control" / "job.json").write_text("{}")
    assert main(["checkpoints", "list", str(missing)]) == 0
    assert "no checkpoints yet under" in capsys.readouterr().out
