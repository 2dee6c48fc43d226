"""SIGKILL a checkpoint writer at random moments, hundreds of times: a restore must never load a partial
or corrupt checkpoint and must always find the newest complete one.

Writers are forked so each kill costs milliseconds, not an interpreter start. Forking needs a thread-free
parent, and a pytest process that ran other tests may hold threads (a boto3 pool, a poller), so the kill loop
runs in a fresh interpreter: this file run as a script. The S3 endpoint is moto's threaded server run in a
subprocess for the same reason.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest

from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.testing.moto_s3 import moto_server_process

#: kills that must land inside a save (between its first byte and its commit)
KILLS_IN_SAVE = 200
#: the same on S3 (each writer builds a boto3 client and sends 11 MB multipart uploads to moto: ~5x slower per
#: kill); the chaos suite (tests/chaos/test_chaos_kills.py) sets KILLS_IN_SAVE_S3=200
KILLS_IN_SAVE_S3 = int(os.environ.get("KILLS_IN_SAVE_S3", "60"))
CHUNK = 5 * 1024 * 1024  # S3's smallest multipart part, so big payloads exercise multipart uploads
HEADER = struct.Struct("<QQ")


def payload(step: int, size: int) -> bytes:
    body = hashlib.sha256(str(step).encode()).digest() * (size // 32)
    return HEADER.pack(step, len(body)) + body


def read_payload(path: str) -> int:
    with open(path, "rb") as f:
        step, n = HEADER.unpack(f.read(HEADER.size))
        body = f.read()
    if len(body) != n or body != payload(step, n)[HEADER.size :]:
        raise AssertionError(f"payload of step {step} is not what was written")
    return step


def writer_loop(uri: str, options: dict, log_path: str, seed: int) -> None:
    store_options = {k: v for k, v in options.items() if k != "big"}
    ckpts = CheckpointStore(open_store(uri, **store_options), writer=f"w{seed}")
    rng = random.Random(seed)
    step = (ckpts.latest_step() or 0) + 1
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    while True:
        size = rng.choice([64 * 1024, 700 * 1024, 2 * 1024 * 1024, options.get("big", 3 * 1024 * 1024)])
        data = payload(step, size)
        os.write(log, f"begin {step}\n".encode())

        def write(f, data=data):
            for i in range(0, len(data), 256 * 1024):  # many writes: more moments to be killed in
                f.write(data[i : i + 256 * 1024])

        ckpts.save(step, write)
        os.write(log, f"commit {step}\n".encode())
        ckpts.prune(keep=2)
        step += 1


def read_log(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def torture(uri: str, options: dict, tmp_path, max_delay: float, kills_in_save: int = KILLS_IN_SAVE) -> dict:
    """Kill writers until ``kills_in_save`` kills landed inside a save (at most 3 times as many kills),
    checking after each that the newest complete checkpoint restores."""
    assert threading.active_count() == 1, "fork needs a thread-free parent"
    log_path = str(tmp_path / "writer.log")
    rng = random.Random(1234)
    in_save = 0
    i = 0
    while in_save < kills_in_save and i < 3 * kills_in_save:
        i += 1
        begun = read_log(log_path).count("begin")
        pid = os.fork()
        if pid == 0:  # child: write until killed
            try:
                writer_loop(uri, options, log_path, seed=i)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(3)
        # Time the kill from the writer's first save, not from the fork: starting a writer (a boto3
        # client) takes longer on a loaded machine, and kills before any save would prove nothing.
        started = time.monotonic()
        while read_log(log_path).count("begin") <= begun and time.monotonic() - started < 30:
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, max_delay))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), f"writer exited by itself (status {status}): see {log_path}"

        lines = read_log(log_path)
        commits = [int(s) for k, s in zip(lines[::2], lines[1::2], strict=False) if k == "commit"]
        if len(lines) >= 2 and lines[-2] == "begin":
            in_save += 1
        ckpts = CheckpointStore(open_store(uri, **{k: v for k, v in options.items() if k != "big"}))
        latest = ckpts.latest_step()
        restored = ckpts.restore_latest(read_payload)
        if not commits:
            continue
        assert restored is not None, f"kill {i}: commits {commits[-3:]} but nothing restorable"
        manifest, step = restored
        assert step == manifest.step == latest, f"kill {i}: restored {step}, newest manifest {latest}"
        assert step >= commits[-1], f"kill {i}: restored {step} but {commits[-1]} was committed"
    print(f"{uri}: {i} kills, {in_save} inside a save, newest restored step {commits[-1] if commits else None}")
    return {"kills": i, "in_save": in_save}


def torture_in_fresh_process(uri: str, options: dict, tmp_path, max_delay: float, kills_in_save: int) -> dict:
    """:func:`torture` in a new interpreter (thread-free, whatever ran before in this one)."""
    args = json.dumps({"uri": uri, "options": options, "tmp_path": str(tmp_path), "max_delay": max_delay,
                       "kills_in_save": kills_in_save})
    proc = subprocess.run([sys.executable, __file__, args], capture_output=True, text=True,
                          timeout=max(570, 8 * kills_in_save))
    assert proc.returncode == 0, f"kill loop failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    print(proc.stdout)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sigkill_during_file_saves(tmp_path):
    stats = torture_in_fresh_process(f"file://{tmp_path}/ckpt", {}, tmp_path, max_delay=0.12,
                                     kills_in_save=KILLS_IN_SAVE)
    assert stats["in_save"] >= KILLS_IN_SAVE, stats
    # A writer killed between its commit and its prune leaves old directories until the next prune; after
    # one, only the 2 kept checkpoints and partial saves no older than them may remain (a live writer's).
    ckpts = CheckpointStore(open_store(f"file://{tmp_path}/ckpt"))
    ckpts.prune(keep=2)
    kept = [m.directory for m in ckpts.committed()]
    oldest_kept = min(int(d.split("-")[0]) for d in kept)
    leftovers = sorted(os.listdir(tmp_path / "ckpt"))
    assert len(kept) == 2 and set(kept) <= set(leftovers), (kept, leftovers)
    assert all(d in kept or (d[:12].isdigit() and int(d[:12]) >= oldest_kept) for d in leftovers), (
        f"retention left {leftovers}")


@pytest.fixture(scope="module")
def moto_subprocess():
    with moto_server_process() as endpoint:
        yield endpoint


def test_sigkill_during_s3_saves(tmp_path, moto_subprocess):
    # boto3 made in the parent would leave threads behind; create the bucket from a subprocess.
    subprocess.run(
        [sys.executable, "-c", f"from airflow_spot.testing.moto_s3 import create_bucket;"
         f"create_bucket({moto_subprocess!r}, 'torture')"],
        check=True, timeout=60,
    )
    options = {"endpoint_url": moto_subprocess, "multipart_chunk": CHUNK, "big": 11 * 1024 * 1024}
    stats = torture_in_fresh_process("s3://torture/job/checkpoints", options, tmp_path, max_delay=0.35,
                                     kills_in_save=KILLS_IN_SAVE_S3)
    assert stats["in_save"] >= KILLS_IN_SAVE_S3, stats


if __name__ == "__main__":
    from pathlib import Path

    a = json.loads(sys.argv[1])
    result = torture(a["uri"], a["options"], Path(a["tmp_path"]), a["max_delay"], a["kills_in_save"])
    print(json.dumps(result))
