"""``airflow-spot`` itself: --version, --help as plain text, and a reader that closes stdout early."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

from airflow_spot.cli import main


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"airflow-spot {importlib.metadata.version('airflow-spot')}"


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "airflow-spot: demo, simulate, estimate" in out and "``" not in out


@pytest.mark.parametrize("argv", [
    ["estimate", "--steps", "100", "--measured", "V100=1", "--top", "5"],
    ["offers", "--regions", "us-east-1"],
])
def test_a_closed_stdout_ends_the_command_quietly(argv):
    """``airflow-spot ... | head``: the reader is gone before the command writes (deterministically here: the
    pipe's read end is closed before the command starts)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "airflow_spot.cli", *argv], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 141  # 128 + SIGPIPE, as the shell reports a program SIGPIPE ended


def test_a_closed_stdout_is_not_blamed_on_the_store(tmp_path):
    """``airflow-spot checkpoints list JOB | head``: the closed pipe is an OSError, which the command's
    store-error handler must not report as an unreadable store (exit 1, "broken checkpoints")."""
    from airflow_spot.storage.checkpoint import CheckpointStore
    from airflow_spot.storage.object_store import open_store

    store = open_store(f"file://{tmp_path}/job")
    for step in (1, 2, 3):
        CheckpointStore(store.child("checkpoints"), writer="w").save(step, lambda f: f.write(b"state"))
    read, write = os.pipe()
    os.close(read)
    try:
        # unbuffered: the first line written meets the closed pipe inside the command, as a long listing does
        proc = subprocess.run([sys.executable, "-u", "-m", "airflow_spot.cli", "checkpoints", "list",
                               str(tmp_path / "job")], stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert "cannot read" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 141
