"""Review of the data parallel (torchrun, DDP) support: real ranks under ``torch.distributed.run`` on CPU (gloo).

Each test starts its ranks with a hard timeout, and kills every rank it started (their pids are recorded by
the ranks themselves: torchrun starts each worker in a session of its own, so killing torchrun's process
group does not reach them).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout, Outcome
from airflow_spot.training import env as E

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

TOTAL = 12
HANG_TIMEOUT = 45  # a run that normally takes ~5 s; past this it is a hang

#: every script starts by recording its pid (so that a hung or orphaned rank can be killed by the test)
PROLOGUE = textwrap.dedent("""
    import os, pathlib
    _d = pathlib.Path(os.environ["TEST_PID_DIR"]); _d.mkdir(parents=True, exist_ok=True)
    (_d / os.environ["RANK"]).write_text(str(os.getpid()))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    def __init__(self, returncode: int | None, output: str, timed_out: bool) -> None:
        self.returncode, self.output, self.timed_out = returncode, output, timed_out


def _alive(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return marker in cmd and state != "Z"


def _rank_pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.glob("*")] if pid_dir.exists() else []


def _kill_ranks(pid_dir: Path, marker: str) -> None:
    for pid in _rank_pids(pid_dir):
        if _alive(pid, marker):
            os.kill(pid, signal.SIGKILL)


def _env(tmp_path: Path, name: str, job: Path, extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_")}
    env.update({
        E.JOB_URI: "file://" + str(job), E.ATTEMPT_ID: f"a-{name}", E.START_STEP: "0", E.END_STEP: str(TOTAL),
        E.TOTAL_STEPS: str(TOTAL), E.CKPT_MIN_INTERVAL: "1000", E.CKPT_MAX_INTERVAL: "2000",
        E.OUTCOME_FILE: str(tmp_path / f"outcome-{name}"), "OMP_NUM_THREADS": "1",
        "TEST_PID_DIR": str(tmp_path / f"pids-{name}"), "TEST_OUT": str(tmp_path / f"out-{name}"),
        **(extra or {}),
    })
    return env


def _cmd(script: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(script)]


def _torchrun(tmp_path: Path, name: str, body: str, job: Path, extra: dict[str, str] | None = None, nproc: int = 2,
              timeout: float = HANG_TIMEOUT) -> Run:
    script = tmp_path / f"{name}.py"
    script.write_text(PROLOGUE + textwrap.dedent(body))
    pid_dir = tmp_path / f"pids-{name}"
    proc = subprocess.Popen(_cmd(script, nproc), env=_env(tmp_path, name, job, extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return Run(proc.returncode, out, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _kill_ranks(pid_dir, str(script))
        out, _ = proc.communicate(timeout=30)
        return Run(None, out or "", True)
    finally:
        _kill_ranks(pid_dir, str(script))


def _committed(job: Path) -> list:
    return CheckpointStore(open_store("file://" + str(job)).child(JobLayout.CHECKPOINTS)).committed()


# ---------------------------------------------------------------------------------------------------------------
# leaving the loop: a save asked for in the step the loop is left is not agreed among the ranks

LEAVE_SCRIPT = """
import os, torch, torch.distributed as dist
from airflow_spot.training import SpotSession
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(2, 1)
mode = os.environ["TEST_MODE"]
with SpotSession.from_env() as spot:
    spot.track(model=model)
    for step in spot.steps():
        if step == 4:
            if mode == "rank0_save":              # e.g. a new best validation loss, computed on rank 0
                if rank == 0:
                    spot.save()
            elif mode == "rank0_save_break":       # ... and the last epoch is done: every rank leaves
                if rank == 0:
                    spot.save()
                break
            elif mode == "save_then_crash":        # every rank asks for its periodic save; rank 1 hits a bug
                spot.save()
                if rank == 1:
                    raise ValueError("a genuine bug on rank 1")
print(f"rank {rank} finished", flush=True)
dist.destroy_process_group()
"""


def test_rank0_save_request_in_the_loop_is_taken_by_all_ranks(tmp_path):
    """Control: a save that only rank 0 asks for is agreed before the next step (passes today)."""
    job = tmp_path / "job"
    run = _torchrun(tmp_path, "r0save", LEAVE_SCRIPT, job, {"TEST_MODE": "rank0_save"})
    assert not run.timed_out and run.returncode == 0, run.output
    assert [(m.step, m.meta["reason"]) for m in _committed(job)][:1] == [(5, "final")], run.output


def test_rank0_save_request_then_break_commits_the_save(tmp_path):
    """Every rank leaves the loop at the same step after rank 0 asked for a save: the session must commit it
    (as it does when every rank asks, or when the loop goes on); it must not run the save on rank 0 alone."""
    job = tmp_path / "job"
    run = _torchrun(tmp_path, "r0break", LEAVE_SCRIPT, job, {"TEST_MODE": "rank0_save_break"})
    assert not run.timed_out, "the ranks hung:\n" + run.output
    assert run.returncode == 0, run.output
    assert "Exception ignored in: <generator object SpotSession.steps" not in run.output, run.output
    assert 5 in [m.step for m in _committed(job)], "the save asked for before the break was lost:\n" + run.output


def test_a_rank_crashing_after_a_save_request_fails_the_job_instead_of_hanging(tmp_path):
    """Rank 1 raises in the body after spot.save() was called on every rank. Its generator is closed and
    its GeneratorExit path starts a collective save on its own, while rank 0 waits in the next step's
    agreement: the job must fail promptly (torchrun sees rank 1's exit), not hang until the collective
    timeout with rank 0's heartbeats still saying it is alive."""
    job = tmp_path / "job"
    started = time.monotonic()
    run = _torchrun(tmp_path, "crash", LEAVE_SCRIPT, job, {"TEST_MODE": "save_then_crash"})
    assert not run.timed_out, f"hung for {time.monotonic() - started:.0f} s after rank 1 crashed:\n" + run.output
    assert run.returncode not in (0, None), run.output
    assert "a genuine bug on rank 1" in run.output
    assert not (tmp_path / "outcome-crash").exists()  # a crash, not a preemption


# ---------------------------------------------------------------------------------------------------------------
# a crash of one rank is a failure, not a preemption (passes today)

CRASH_SCRIPT = """
import os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from airflow_spot.training import SpotSession
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(2, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with SpotSession.from_env() as spot:
    spot.track(model=model, optimizer=opt)
    for step in spot.steps():
        loss = model(torch.ones(4, 2)).sum(); opt.zero_grad(); loss.backward(); opt.step()
        if step == 4:
            if rank == 1:
                raise ValueError("a genuine bug on rank 1")
            time.sleep(2)  # rank 0 is mid-step when torchrun SIGTERMs it: the SIGTERM is not a notice
dist.destroy_process_group()
"""


def test_a_crash_of_one_rank_is_classified_failed_not_preempted(tmp_path):
    from airflow_spot.training.agent import Agent

    agent = Agent("file://" + str(tmp_path / "job"), "i-test", idle_timeout=10, work_dir=tmp_path / "agent")
    run = _torchrun(tmp_path, "crash1", CRASH_SCRIPT, tmp_path / "job", {E.OUTCOME_FILE: str(agent.outcome_file)})
    assert not run.timed_out and run.returncode == 1, run.output
    assert not agent.outcome_file.exists(), agent.outcome_file.read_text()
    outcome, _ = agent._classify(run.returncode, "")
    assert outcome is Outcome.FAILED


# ---------------------------------------------------------------------------------------------------------------
# per-rank state: a tracked RNG object (the README's way to make augmentation resumable)

RNG_SCRIPT = """
import os, signal, json, torch, torch.distributed as dist
from airflow_spot.training import SpotSession
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(2, 1)
aug = torch.Generator().manual_seed(1000 + rank)   # this rank's augmentation stream
draws = {}
with SpotSession.from_env() as spot:
    spot.track(model=model, aug=aug)
    for step in spot.steps():
        draws[step] = torch.rand(1, generator=aug).item()
        with open(os.environ["TEST_OUT"] + f".{rank}", "w") as f:
            json.dump(draws, f)
        if step == int(os.environ.get("TEST_NOTICE_STEP", "-1")) and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
dist.destroy_process_group()
"""


def test_each_rank_resumes_its_own_tracked_rng_object(tmp_path):
    """README: "each rank's dropout and augmentation draw their own streams", and RNG objects "can be
    tracked too". A tracked per-rank generator is saved from rank 0 only and every rank restores rank 0's
    state: after the resume rank 1 draws rank 0's augmentation stream (silently, no warning)."""
    straight = _torchrun(tmp_path, "straight", RNG_SCRIPT, tmp_path / "straight")
    assert straight.returncode == 0, straight.output
    job = tmp_path / "pre"
    stopped = _torchrun(tmp_path, "pre", RNG_SCRIPT, job, {"TEST_NOTICE_STEP": "4"})
    assert stopped.returncode not in (0, None) and (tmp_path / "outcome-pre").read_text().startswith("preempted")
    resumed = _torchrun(tmp_path, "res", RNG_SCRIPT, job, {E.START_STEP: "5"})
    assert resumed.returncode == 0, resumed.output
    for rank in (0, 1):
        a = json.loads((tmp_path / f"out-straight.{rank}").read_text())
        b = json.loads((tmp_path / f"out-res.{rank}").read_text())
        assert min(map(int, b)) == 5
        assert {k: a[k] for k in b} == b, f"rank {rank}'s tracked generator did not resume its own stream"


# ---------------------------------------------------------------------------------------------------------------
# host memory: only rank 0 stages, so only rank 0 needs staging buffers

STAGER_SCRIPT = """
import os, json, torch, torch.distributed as dist
from airflow_spot.training import SpotSession
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(512, 512)
opt = torch.optim.Adam(model.parameters())
with SpotSession.from_env() as spot:
    spot.track(model=model, optimizer=opt)
    for step in spot.steps():
        model(torch.ones(2, 512)).sum().backward(); opt.step(); opt.zero_grad()
        spot.save() if step == 2 else None
    held = sum(b.numel() * b.element_size() for b in spot.stager._buffers.values())
with open(os.environ["TEST_OUT"] + f".{rank}", "w") as f:
    json.dump(held, f)
dist.destroy_process_group()
"""


def test_ranks_other_than_0_hold_no_staging_buffers(tmp_path):
    """track() pre-stages every tracked state into host buffers (pinned, for GPU tensors) on every rank,
    though only rank 0 ever stages a save (_stage returns before staging elsewhere): each other rank holds a
    host copy of the model, and on a resume of the restored optimizer state too, for nothing (7 extra
    copies of a 7B model in bf16 is ~100 GB of pinned host memory on an 8-GPU instance)."""
    run = _torchrun(tmp_path, "stager", STAGER_SCRIPT, tmp_path / "job")
    assert run.returncode == 0, run.output
    held = [json.loads((tmp_path / f"out-stager.{r}").read_text()) for r in (0, 1)]
    assert held[0] > 512 * 512 * 4  # rank 0 stages the model (and the optimizer)
    assert held[1] == 0, f"rank 1 holds {held[1]} bytes of staging buffers it never uses"


# ---------------------------------------------------------------------------------------------------------------
# the agent's clean-up of a torchrun command

HUNG_SCRIPT = """
import os, time, torch, torch.distributed as dist
from airflow_spot.training import SpotSession
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(2, 1)
with SpotSession.from_env() as spot:
    spot.track(model=model)
    for step in spot.steps():
        if step == 1:
            open(os.environ["TEST_OUT"] + f".{rank}", "w").close()
            if rank == 1:
                time.sleep(600)   # a rank stuck (a data loader, a collective); rank 0 waits for it
dist.destroy_process_group()
"""


def test_the_agents_cleanup_of_a_torchrun_command_reaches_its_ranks(tmp_path):
    """The agent ends a command by its process group (SIGTERM, then SIGKILL after a grace). torchrun starts
    each worker with start_new_session=True, so the ranks are in no group the agent signals or waits for:
    torchrun is killed, group_alive() says the command is gone, and the ranks run on as orphans (holding the
    GPUs, and rank 0 writing heartbeats and checkpoints for the ended attempt)."""
    from airflow_spot.training.agent import OWN_PROCESS_GROUP, Agent
    from airflow_spot.training.handoff import group_alive

    name = "hung"
    script = tmp_path / f"{name}.py"
    script.write_text(PROLOGUE + textwrap.dedent(HUNG_SCRIPT))
    pid_dir = tmp_path / f"pids-{name}"
    agent = Agent("file://" + str(tmp_path / "job"), "i-test", idle_timeout=10, work_dir=tmp_path / "agent",
                  term_grace=2.0)
    token = "tok-" + name  # the agent's mark on the command's processes, as Agent._run_command sets it
    env = {**_env(tmp_path, name, tmp_path / "job", None), "SPOT_COMMAND_TOKEN": token}
    proc = subprocess.Popen(_cmd(script, 2), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **OWN_PROCESS_GROUP)
    proc.spot_token = token
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"out-{name}.{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        ranks = _rank_pids(pid_dir)
        assert len(ranks) == 2
        agent.child = proc
        agent._end_group(proc, "the attempt is being ended")  # SIGTERM the group, SIGKILL it after the grace
        proc.wait(timeout=30)
        assert not group_alive(proc.pid)  # what the agent checks: it believes the command is gone
        time.sleep(1)
        left = [pid for pid in ranks if _alive(pid, str(script))]
        assert not left, f"ranks {left} of the ended command are still running (orphaned)"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        _kill_ranks(pid_dir, str(script))
