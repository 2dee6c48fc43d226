"""Interrupt a real torch training 20+ times (notices and SIGKILLs) and resume it from the store each
time: the final weights and optimizer state equal those of an uninterrupted run, bit for bit."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import torch

from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import PREEMPTED_EXIT_CODE, JobLayout

TOTAL = 1500
SCRIPT = [sys.executable, "-m", "airflow_spot.examples.train_tiny", "--total-steps", str(TOTAL)]


def run_env(job: str, attempt: str, notice_file: str) -> dict:
    return {
        **os.environ,
        "SPOT_JOB_URI": job,
        "SPOT_ATTEMPT_ID": attempt,
        "SPOT_START_STEP": "0",
        "SPOT_END_STEP": str(TOTAL),
        "SPOT_NOTICE_FILE": notice_file,
        "SPOT_NOTICE_POLL_SECONDS": "0.02",
        "SPOT_CKPT_MIN_INTERVAL": "0.15",
        "SPOT_HEARTBEAT_SECONDS": "0.05",
    }


def heartbeat_step(job: str, attempt: str) -> int | None:
    hb = JobLayout(open_store(job)).read_heartbeat(attempt)
    return hb.step if hb else None


def test_twenty_interruptions_resume_bit_exact(tmp_path):
    ref = tmp_path / "ref.pt"
    subprocess.run(
        SCRIPT + ["--job-uri", str(tmp_path / "ref-job"), "--final-weights", str(ref)],
        check=True, timeout=120, capture_output=True,
    )

    job = f"file://{tmp_path}/job"
    checkpoints = CheckpointStore(open_store(job).child("checkpoints"))
    out = tmp_path / "final.pt"
    notice_file = str(tmp_path / "notice")
    modes = ["sigterm", "file", "sigkill", "sigkill"] * 5  # 10 notices, 10 kills without warning
    rng = random.Random(7)
    record = []
    for attempt, mode in enumerate(modes):
        resume_at = checkpoints.latest_step() or 0
        name = f"try{attempt}"
        proc = subprocess.Popen(
            SCRIPT + ["--final-weights", str(out), "--step-sleep", "0.004"],
            env=run_env(job, name, notice_file), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while (heartbeat_step(job, name) or 0) <= resume_at and proc.poll() is None:
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        if mode == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif mode == "file":
            open(notice_file, "w").write("test notice")
        else:
            proc.kill()
        output = proc.communicate(timeout=60)[0].decode()
        if os.path.exists(notice_file):
            os.unlink(notice_file)
        assert f"resuming at step {resume_at}" in output, output[-2000:]
        committed = checkpoints.latest_step()
        done = heartbeat_step(job, name)
        if mode == "sigkill":
            assert proc.returncode == -signal.SIGKILL
            # only the steps since the last committed save are lost (the next run repeats them)
            assert resume_at <= committed <= done
        else:
            assert proc.returncode == PREEMPTED_EXIT_CODE, output[-2000:]
            assert committed == done, f"notice: committed {committed} but reached {done}: steps lost"
            assert checkpoints.committed()[-1].meta["reason"] == "emergency"
        record.append((mode, resume_at, done, committed))

    assert all(r[1] < r[2] for r in record), f"every attempt made progress: {record}"
    assert max(r[2] for r in record) < TOTAL, "the job finished before the last interruption"
    final = subprocess.run(
        SCRIPT + ["--final-weights", str(out)], env=run_env(job, "final", notice_file),
        capture_output=True, timeout=120,
    )
    assert final.returncode == 0, final.stdout.decode()[-2000:] + final.stderr.decode()[-2000:]
    print(json.dumps(record))

    ref_w, got_w = torch.load(ref), torch.load(out)
    assert ref_w.keys() == got_w.keys()
    for k in ref_w:
        assert torch.equal(ref_w[k], got_w[k]), f"weights differ at {k}"
    ref_o, got_o = torch.load(str(ref) + ".optim"), torch.load(str(out) + ".optim")
    for pid, st in ref_o["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got_o["state"][pid][k]), f"optimizer state {pid}.{k} differs"
