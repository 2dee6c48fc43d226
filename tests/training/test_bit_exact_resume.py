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


def run_env(job: str, attempt: str, notice_file: str, total: int = TOTAL) -> dict:
    return {
        **os.environ,
        "SPOT_JOB_URI": job,
        "SPOT_ATTEMPT_ID": attempt,
        "SPOT_START_STEP": "0",
        "SPOT_END_STEP": str(total),
        "SPOT_NOTICE_FILE": notice_file,
        "SPOT_NOTICE_POLL_SECONDS": "0.02",
        "SPOT_CKPT_MIN_INTERVAL": "0.15",
        "SPOT_HEARTBEAT_SECONDS": "0.05",
    }


def heartbeat_step(job: str, attempt: str) -> int | None:
    hb = JobLayout(open_store(job)).read_heartbeat(attempt)
    return hb.step if hb else None


def popen(script: list[str]):
    """Start ``script + args`` in a new interpreter (``spawn`` of :func:`interrupt_and_resume`)."""
    def spawn(args: list[str], env: dict):
        return subprocess.Popen(script + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    return spawn


def interrupt_and_resume(script: list[str], job: str, work_dir, modes: list[str], seed: int, total: int = TOTAL,
                         step_sleep: str = "0.004", spawn=None) -> list[tuple]:
    """Run ``script`` once per mode, interrupting each run at a random moment after it made progress:
    ``sigterm`` and ``file`` are notices (an emergency save, exit 75, nothing lost), ``sigkill`` gives no
    warning (only the steps since the last committed save are lost). Returns (mode, resumed at, reached,
    committed) per run. The kill schedule comes from ``random.Random(seed)``. ``spawn(args, env)`` starts
    the script with extra arguments (default: :func:`popen`; a fork server's is faster)."""
    spawn = spawn or popen(script)
    checkpoints = CheckpointStore(open_store(job).child("checkpoints"))
    out = os.path.join(str(work_dir), "final.pt")
    notice_file = os.path.join(str(work_dir), "notice")
    rng = random.Random(seed)
    record = []
    for attempt, mode in enumerate(modes):
        resume_at = checkpoints.latest_step() or 0
        name = f"try{attempt}"
        proc = spawn(["--final-weights", out, "--step-sleep", step_sleep], run_env(job, name, notice_file, total))
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
            # only the steps since the last committed save are lost (the next run repeats them). The
            # heartbeat is written on a timer, so a kill can land between a commit and the heartbeat that
            # would report its step: a committed step was reached, whatever the last heartbeat says.
            assert resume_at <= (committed or 0), (resume_at, committed)
            done = max(done or 0, committed or 0)
        else:
            assert proc.returncode == PREEMPTED_EXIT_CODE, output[-2000:]
            assert committed == done, f"notice: committed {committed} but reached {done}: steps lost"
            # an emergency save, unless a periodic one had just committed this very step (nothing to add)
            assert checkpoints.committed()[-1].meta["reason"] in ("emergency", "periodic")
        record.append((mode, resume_at, done, committed))
    assert all(r[1] < r[2] for r in record), f"every attempt made progress: {record}"
    assert max(r[2] for r in record) < total, "the job finished before the last interruption"
    return record


def finish(script: list[str], job: str, work_dir, total: int = TOTAL, spawn=None) -> str:
    """Run ``script`` to the end of the job (resuming); returns the path of its final weights."""
    out = os.path.join(str(work_dir), "final.pt")
    final = (spawn or popen(script))(["--final-weights", out],
                                     run_env(job, "final", os.path.join(str(work_dir), "notice"), total))
    output = final.communicate(timeout=300)[0].decode(errors="replace")
    assert final.returncode == 0, output[-3000:]
    return out


def assert_same_training(ref: str, out: str) -> None:
    """Weights and optimizer state (every moment of every parameter) equal, bit for bit."""
    ref_w, got_w = torch.load(ref), torch.load(out)
    assert ref_w.keys() == got_w.keys()
    for k in ref_w:
        assert torch.equal(ref_w[k], got_w[k]), f"weights differ at {k}"
    ref_o, got_o = torch.load(str(ref) + ".optim"), torch.load(str(out) + ".optim")
    assert ref_o["state"].keys() == got_o["state"].keys()
    for pid, st in ref_o["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got_o["state"][pid][k]), f"optimizer state {pid}.{k} differs"


def test_twenty_interruptions_resume_bit_exact(tmp_path):
    # Forked from a server that imported torch once, on one intra-op thread: 22 interpreter starts and
    # two-thread kernels took minutes on a loaded two-core machine (the reference alone hit 120 s).
    from airflow_spot.testing.forkserver import ForkServer

    module, argv = SCRIPT[2], SCRIPT[3:]
    with ForkServer(["torch", "torch._inductor", "numpy", module, "airflow_spot.training.session"]) as forks:
        runs = iter(range(10**6))

        def spawn(args: list[str], env: dict):
            return forks.spawn(module, argv + args, env, str(tmp_path / f"run{next(runs)}.log"))

        ref = tmp_path / "ref.pt"
        reference = spawn(["--job-uri", str(tmp_path / "ref-job"), "--final-weights", str(ref)], dict(os.environ))
        assert reference.wait(timeout=300) == 0, open(reference.output).read()[-3000:]
        job = f"file://{tmp_path}/job"
        modes = ["sigterm", "file", "sigkill", "sigkill"] * 5  # 10 notices, 10 kills without warning
        record = interrupt_and_resume(SCRIPT, job, tmp_path, modes, seed=7, spawn=spawn)
        out = finish(SCRIPT, job, tmp_path, spawn=spawn)
    print(json.dumps(record))
    assert_same_training(str(ref), out)
