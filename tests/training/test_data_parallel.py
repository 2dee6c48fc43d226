"""A data parallel command (torchrun, DDP) under the session: rank 0 saves for all, the ranks stop together.

Real processes: ``torch.distributed.run`` starts two ranks on CPU (gloo) that train a small DDP model. A
notice reaches one rank only; both must leave at the same step, one checkpoint is committed, and the run
resumed from it ends bit-identical to an uninterrupted run — each rank's own random stream included.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout
from airflow_spot.training import env as E
from airflow_spot.training.sampler import ResumableSampler

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

TOTAL = 24

SCRIPT = textwrap.dedent("""
    import os, signal, time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from airflow_spot.training import ResumableSampler, SpotSession

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(100 + rank)  # each rank's dropout draws its own stream: a resume must give it back
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    target = data.mean(1, keepdim=True)
    sampler = ResumableSampler(64, seed=3, rank=rank, num_replicas=world)
    batches = sampler.batches(4)
    notice_rank = int(os.environ.get("TEST_NOTICE_RANK", "-1"))
    notice_step = int(os.environ.get("TEST_NOTICE_STEP", "-1"))
    with SpotSession.from_env() as spot:
        spot.track(model=model, optimizer=opt, sampler=sampler)
        for step in spot.steps():
            idx = next(batches)
            loss = ((model(data[idx]) - target[idx]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.01)
            if rank == notice_rank and step == notice_step:
                os.kill(os.getpid(), signal.SIGTERM)  # the notice reaches this rank only
    if rank == 0:
        torch.save(model.module.state_dict(), os.environ["TEST_OUT"])
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path: Path, job: Path, out: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_")}
    env.update({
        E.JOB_URI: "file://" + str(job), E.ATTEMPT_ID: f"a-{job.name}", E.START_STEP: "0", E.END_STEP: str(TOTAL),
        E.TOTAL_STEPS: str(TOTAL), E.CKPT_MIN_INTERVAL: "0.05", E.CKPT_MAX_INTERVAL: "0.1",
        E.OUTCOME_FILE: str(tmp_path / f"outcome-{job.name}"), "TEST_OUT": str(out), "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    })
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(script)],
        env=env, capture_output=True, text=True, timeout=240,
    )


def _committed(job: Path) -> list:
    return CheckpointStore(open_store("file://" + str(job)).child(JobLayout.CHECKPOINTS)).committed()


def test_a_notice_to_one_rank_stops_both_at_one_step_and_the_resume_is_bit_exact(tmp_path):
    straight = _torchrun(tmp_path, tmp_path / "straight", tmp_path / "straight.pt")
    assert straight.returncode == 0, straight.stdout + straight.stderr

    job = tmp_path / "preempted"
    stopped = _torchrun(tmp_path, job, tmp_path / "unused.pt", {"TEST_NOTICE_RANK": "1", "TEST_NOTICE_STEP": "9"})
    log = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0, log  # torchrun reports its workers' exit 75 as a failure of its own ...
    # ... so the session says why, for the agent
    assert (tmp_path / "outcome-preempted").read_text().startswith("preempted"), log
    assert "heard by another rank" in log and "emergency checkpoint at step 10 committed" in log, log
    saves = _committed(job)
    assert saves[-1].step == 10 and saves[-1].meta["reason"] == "emergency"
    assert all(m.writer == "a-preempted" for m in saves)  # one writer: rank 0 (the ranks share an attempt)
    assert len({m.step for m in saves}) == len(saves), "two ranks saved the same step"
    assert not (tmp_path / "unused.pt").exists()

    resumed = _torchrun(tmp_path, job, tmp_path / "resumed.pt", {E.START_STEP: "10", E.ATTEMPT_ID: "a-resumed"})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    later = [m for m in _committed(job) if m.writer == "a-resumed"]
    assert later and min(m.step for m in later) > 10 and later[-1].step == TOTAL  # went on from step 10
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.isfinite(a[name]).all() and torch.equal(a[name], b[name]), f"{name} differs after the resume"


def test_torchrun_without_an_initialised_process_group_is_refused(monkeypatch, tmp_path):
    from airflow_spot.training.session import SpotSession

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        SpotSession("file://" + str(tmp_path / "job"), 10)


def test_the_sampler_shares_an_epoch_among_ranks_in_lockstep():
    ranks = [ResumableSampler(10, seed=1, rank=r, num_replicas=3) for r in range(3)]
    epoch = [list(iter(s)) for s in ranks]
    assert [len(e) for e in epoch] == [3, 3, 3]  # the tail that does not divide evenly is left out
    taken = [i for e in epoch for i in e]
    assert len(set(taken)) == 9 and set(taken) <= set(range(10))
    # in the next epoch, one index each; rank 0's saved position then restores every rank to its own next one
    its = [iter(s) for s in ranks]
    for i in its:
        next(i)
    state = ranks[0].state_dict()
    fresh = [ResumableSampler(10, seed=1, rank=r, num_replicas=3) for r in range(3)]
    for s in fresh:
        s.load_state_dict(state)
    assert [next(iter(s)) for s in fresh] == [next(i) for i in its]


def test_the_sampler_resumed_on_fewer_ranks_goes_on_after_the_items_taken():
    two = [ResumableSampler(12, seed=0, rank=r, num_replicas=2) for r in range(2)]
    its = [iter(s) for s in two]
    seen = {next(i) for i in its for _ in range(3)}  # 3 each: 6 of the epoch
    one = ResumableSampler(12, seed=0)
    one.load_state_dict(two[0].state_dict())
    rest = list(iter(one))
    assert len(rest) == 6 and not seen & set(rest)


def test_the_sampler_refuses_a_rank_outside_the_replicas():
    with pytest.raises(ValueError, match="rank < num_replicas"):
        ResumableSampler(10, rank=2, num_replicas=2)


class _Items(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        return torch.tensor([i])


def test_the_loader_shares_each_epoch_among_ranks_and_resumes_each_from_rank_0s_position():
    from airflow_spot.training.data import ResumableLoader

    loaders = [ResumableLoader(_Items(), 3, seed=1, rank=r, num_replicas=2) for r in range(2)]
    assert [len(x) for x in loaders] == [4, 4]  # 10 items a rank: 3 full batches and 1
    first = [[next(x).flatten().tolist() for _ in range(2)] for x in loaders]
    items = [i for batches in first for batch in batches for i in batch]
    assert len(items) == len(set(items)) == 12  # no item on two ranks
    state = loaders[0].state_dict()
    fresh = [ResumableLoader(_Items(), 3, seed=1, rank=r, num_replicas=2) for r in range(2)]
    for x in fresh:
        x.load_state_dict(state)
    assert [next(x).tolist() for x in fresh] == [next(x).tolist() for x in loaders]


def test_the_loader_refuses_ranks_over_an_iterable_dataset():
    from airflow_spot.training.data import ResumableLoader

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    with pytest.raises(ValueError, match="shards itself"):
        ResumableLoader(Stream(), 2, rank=1, num_replicas=2)
