"""``airflow-spot checkpoints``: what a QA pass found rough (a copy to a missing folder, the upgrade warning on
every run, the table's alignment, what ``--quick`` checked, a restore to the newest step, a folder that is no
job store)."""
from __future__ import annotations

import errno
import re
import shutil

import pytest

from airflow_spot.cli import main
from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.testing.manifest_faults import build_store, payload_for


@pytest.fixture
def job(tmp_path):
    """(job root path, its CheckpointStore) with checkpoints at steps 100, 200, 300 and a control/ folder."""
    root = tmp_path / "runs" / "my_dag" / "manual__2026-01-01T00:00:00+00:00"
    store = open_store(str(root))
    store.put_bytes("control/job.json", b"{}")
    ckpts = CheckpointStore(store.child("checkpoints"), writer="seg.try1")
    build_store(ckpts, [100, 200, 300])
    return root, ckpts


def _snapshot(ckpts: CheckpointStore) -> dict[str, bytes]:
    return {k: ckpts.store.get_bytes(k) for k in ckpts.store.list()}


def test_restore_to_a_missing_folder_names_the_target_not_the_checkpoint(job, tmp_path, capsys):
    root, ckpts = job
    before = _snapshot(ckpts)
    target = tmp_path / "nonexistent" / "dir" / "x.pt"
    assert main(["checkpoints", "restore", "--step", "200", "--to", str(target), str(root)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {target}" in err and f"mkdir -p {target.parent}" in err
    assert "file is missing" not in err and "Traceback" not in err
    assert not (tmp_path / "nonexistent").exists() and _snapshot(ckpts) == before
    # with the folder made, the same command copies the verified payload
    target.parent.mkdir(parents=True)
    assert main(["checkpoints", "restore", "--step", "200", "--to", str(target), str(root)]) == 0
    assert target.read_bytes() == payload_for(200)


def test_restore_to_a_target_that_fails_mid_copy_keeps_what_was_there(job, tmp_path, capsys, monkeypatch):
    root, ckpts = job
    target = tmp_path / "weights.pt"
    target.write_bytes(b"an earlier copy")

    def full_disk(src, dst):
        with open(dst, "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    assert main(["checkpoints", "restore", "--step", "100", "--to", str(target), "--force", str(root)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {target}: No space left on device" in err and "file is missing" not in err
    assert target.read_bytes() == b"an earlier copy"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "weights.pt"]  # no partial file left


def test_list_says_the_upgrade_hint_only_when_asked(job, capsys):
    root, _ = job
    assert main(["checkpoints", "list", str(root)]) == 0
    out = capsys.readouterr().out
    assert "block 64 KiB" in out  # the digest column still says which kind each one has
    assert "cannot read" not in out and "AIRFLOW_SPOT_CHECKPOINT_DIGEST" not in out
    assert main(["checkpoints", "list", "--verbose", str(root)]) == 0
    assert "AIRFLOW_SPOT_CHECKPOINT_DIGEST=sha256" in capsys.readouterr().out


def test_list_columns_line_up_whatever_the_writers_length(job, capsys):
    root, ckpts = job
    ckpts.writer = "train.segment_000.try6"  # 22 characters: longer than the column used to be
    ckpts.save(400, lambda f: f.write(payload_for(400)))
    assert main(["checkpoints", "list", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[1], [line for line in lines if "[0000" in line]
    assert len(rows) == 4
    for column, cell in (("WRITER", r"seg\.try1|train\.segment"), ("DIGEST", "block"), ("STATUS", r"ok  \[")):
        starts = {re.search(cell, row).start() for row in rows}
        assert starts == {header.index(column)}, (column, header, rows)


def test_list_quick_says_what_it_checked(job, capsys):
    root, ckpts = job
    m = next(m for m in ckpts.committed() if m.step == 300)
    ckpts.store.put_bytes(f"{m.directory}/state.pt", b"x" + payload_for(300)[1:])  # same size, wrong digest
    assert main(["checkpoints", "list", "--quick", str(root)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "[0000" in line]
    assert all("ok (quick)" in row for row in rows) and rows[-1].startswith("*")
    assert "payload digest not read" in out and "checkpoints verify" in out
    # a payload cut short is seen without reading it
    ckpts.store.put_bytes(f"{m.directory}/state.pt", payload_for(300)[:10])
    assert main(["checkpoints", "list", "--quick", str(root)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "[0000" in line]
    assert "BROKEN" in rows[-1] and "size 10 !=" in rows[-1] and rows[1].startswith("*")
    assert main(["checkpoints", "list", str(root)]) == 0  # without --quick: plain "ok", no legend
    out = capsys.readouterr().out
    assert "(quick)" not in out and " ok " in out


def test_restore_to_the_newest_step_says_nothing_moved(job, capsys):
    root, ckpts = job
    before = _snapshot(ckpts)
    for dry in ([], ["--dry-run"]):
        assert main(["checkpoints", "restore", "--step", "300", *dry, str(root)]) == 0
        out = capsys.readouterr().out
        assert "step 300" in out and "already the newest usable checkpoint" in out and "nothing was moved" in out
        assert "moved 0" not in out and "move them back" not in out
    assert _snapshot(ckpts) == before


def test_a_folder_that_is_no_job_store_is_an_error_with_the_expected_layout(job, tmp_path, capsys):
    root, _ = job
    other = tmp_path / "some" / "folder"
    other.mkdir(parents=True)
    (other / "notes.txt").write_text("not a job")
    for action in (["list"], ["verify"]):
        assert main(["checkpoints", *action, str(other)]) == 2
        err = capsys.readouterr().err
        assert "is not a job store" in err and "<root>/<dag_id>/<run_id>" in err and "checkpoints/" in err
    # the DAG's folder, one above the job store: the hint names the job store
    assert main(["checkpoints", "list", str(root.parent)]) == 2
    assert f"job stores under it: file://{root}" in capsys.readouterr().err
    # a job store that has not saved yet, and an empty checkpoints/ folder, are no error
    fresh = tmp_path / "runs" / "my_dag" / "fresh"
    (fresh / "control").mkdir(parents=True)
    (fresh / "control" / "job.json").write_text("{}")
    (fresh / "checkpoints").mkdir()
    for uri in (fresh, fresh / "checkpoints"):
        assert main(["checkpoints", "list", str(uri)]) == 0
        assert "no checkpoints yet under" in capsys.readouterr().out


def test_restore_to_with_dry_run_writes_nothing(job, tmp_path, capsys):
    root, ckpts = job
    before = _snapshot(ckpts)
    target = tmp_path / "mine.pt"
    target.write_bytes(b"the user's own file")
    assert main(["checkpoints", "restore", "--step", "200", "--to", str(target), "--dry-run", str(root)]) == 0
    out = capsys.readouterr().out
    assert "would copy step 200" in out and str(target) in out and "needs --force to replace it" in out, out
    assert main(["checkpoints", "restore", "--step", "200", "--to", str(target), "--dry-run", "--force",
                 str(root)]) == 0
    assert "replacing the file there" in capsys.readouterr().out
    assert target.read_bytes() == b"the user's own file" and _snapshot(ckpts) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial copy either


def test_restore_to_a_file_already_there_refuses_without_force(job, tmp_path, capsys):
    """QA: `restore --to EXISTING_FILE` replaced the user's file without a word (maybe their only other
    copy of the weights). It refuses, names the file and the flag; `--force` replaces it."""
    root, ckpts = job
    before = _snapshot(ckpts)
    target = tmp_path / "mine.pt"
    target.write_bytes(b"the user's own file")
    assert main(["checkpoints", "restore", "--step", "200", "--to", str(target), str(root)]) == 2
    err = capsys.readouterr().err
    assert f"{target} exists; give --force to replace it" in err and "Traceback" not in err, err
    assert target.read_bytes() == b"the user's own file" and _snapshot(ckpts) == before
    assert main(["checkpoints", "restore", "--step", "200", "--to", str(target), "--force", str(root)]) == 0
    assert target.read_bytes() == payload_for(200)
    # a folder named like the payload inside --to is not replaced either (nor is it a traceback)
    out = tmp_path / "out"
    (out / "state.pt").mkdir(parents=True)
    assert main(["checkpoints", "restore", "--step", "200", "--to", str(out), "--force", str(root)]) == 2
    assert "a folder is there" in capsys.readouterr().err


def test_a_file_given_as_the_store_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "state.pt").write_bytes(b"x")
    assert main(["checkpoints", "list", str(tmp_path / "state.pt")]) == 2
    err = capsys.readouterr().err
    assert "state.pt is a file, not a folder; give the job's checkpoint_uri" in err and "NotADirectoryError" not in err, err


def test_error_lines_name_the_command_as_the_other_subcommands_do(job, tmp_path, capsys):
    # they began with a bare "error:", where offers, simulate, estimate, reap and argparse name the command
    root, _ = job
    assert main(["checkpoints", "restore", "--step", "999", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("airflow-spot checkpoints: error: no verified checkpoint at step 999"), err
    assert main(["checkpoints", "list", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("airflow-spot checkpoints: error: "), err
    assert main(["availability", "show", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("airflow-spot availability: error: ")


def test_a_jobs_control_folder_given_as_the_store_names_the_folder_above(job, capsys):
    """QA: `checkpoints verify <job>/control` said only "not a job store"; it names the job's folder."""
    root, _ = job
    assert main(["checkpoints", "verify", str(root / "control")]) == 2
    err = capsys.readouterr().err
    assert "this is a job's control/ folder: give the folder above it" in err and str(root) in err, err
