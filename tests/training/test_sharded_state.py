"""Sharded state (FSDP2 ``fully_shard``) under the session: saved and restored through torch.distributed.checkpoint.

Real processes: ``torch.distributed.run`` starts two ranks on CPU (gloo) that train a small FSDP2 model with Adam.
A notice reaches one rank; one checkpoint is committed holding every rank's DCP files under one manifest, and
the run resumed from it ends bit-identical to an uninterrupted one (the full model and optimizer state, as
rank 0 gathers it at the end). The same checkpoint resumed on one rank loads the same weights (DCP reshards);
a corrupt shard makes the resume fall back to the checkpoint before it; the store may be s3:// (moto's server).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from airflow_spot.storage.checkpoint import (
    MANIFEST, PAYLOAD, CheckpointError, CheckpointStore, NoUsableCheckpointError,
)
from airflow_spot.storage.host_share import SHARE_PREFIX
from airflow_spot.storage.job_view import JobView
from airflow_spot.storage.manifest import LAYOUT_DCP, MANIFEST_SCHEMA, Manifest, ManifestError, manifest_checksum
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout
from airflow_spot.training import env as E

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

TOTAL = 16

SCRIPT = textwrap.dedent("""
    import copy, logging, os, signal, tempfile, time
    if os.environ.get("TEST_HOST_PER_RANK"):  # each rank a host of its own: a temporary directory of its own
        tempfile.tempdir = os.path.join(os.environ["TEST_HOST_PER_RANK"], os.environ["RANK"])
        os.makedirs(tempfile.tempdir, exist_ok=True)
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from airflow_spot.training import ResumableSampler, SpotSession

    logging.basicConfig(level=logging.INFO, format=f"rank {os.environ['RANK']} %(levelname)s %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[3], model[5]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # each rank's dropout draws its own stream: a resume must give it back
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    target = data.mean(1, keepdim=True)
    sampler = ResumableSampler(64, seed=3, rank=rank, num_replicas=world)
    batches = sampler.batches(4)
    notice_rank = int(os.environ.get("TEST_NOTICE_RANK", "-1"))
    notice_step = int(os.environ.get("TEST_NOTICE_STEP", "-1"))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # collective: every rank takes part
    dumps = {}  # the state after each step (TEST_DUMP), to compare each checkpoint with
    slow_put = float(os.environ.get("TEST_SLOW_PUT", "0"))
    fail_put_rank = int(os.environ.get("TEST_FAIL_PUT_RANK", "-1"))
    with SpotSession.from_env() as spot:
        put, failed = spot.checkpoints.put_file, []

        def put_file(directory, name, write, step):  # the uploads of shards: slowed, or the first one refused
            if name.endswith(".distcp"):
                time.sleep(slow_put)
                if rank == fail_put_rank and not failed:
                    failed.append(step)
                    print(f"TEST refused a put at step {step}", flush=True)
                    raise OSError(28, "No space left on device")
            return put(directory, name, write, step)

        spot.checkpoints.put_file = put_file
        committed = spot.writer.committed

        def record(manifest, seconds):  # rank 0 (the only one that commits): every commit, as it happens
            print(f"TEST committed step {manifest.step} at step {spot.step}", flush=True)
            committed(manifest, seconds)

        spot.writer.committed = record
        if rank == int(os.environ.get("TEST_FAIL_RESTORE_RANK", "-1")):
            def refuse(directory, read):
                raise OSError(5, "Input/output error")

            spot.checkpoints.restore = refuse  # this rank cannot read the checkpoint rank 0 chose
        spot.track(model=model, optimizer=opt, sampler=sampler)
        restored = spot.restored_step
        if not os.environ.get("TEST_RESTORE_ONLY"):
            for step in spot.steps():
                idx = next(batches)
                loss = ((model(data[idx]) - target[idx]) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                time.sleep(float(os.environ.get("TEST_STEP_SLEEP", "0")))
                if os.environ.get("TEST_DUMP"):
                    dumps[step + 1] = copy.deepcopy({  # a copy: Adam's step count is the live tensor
                        "model": get_model_state_dict(model, options=full),
                        "optimizer": get_optimizer_state_dict(model, opt, options=full)})
                if rank == 0:
                    print(f"TEST step {step} ran, a save writing: {spot.writer.busy}; stall "
                          f"{spot.save_cost_ewma} write {spot.writer.last_write_seconds}", flush=True)
                if rank == notice_rank and step == notice_step:
                    os.kill(os.getpid(), signal.SIGTERM)  # the notice reaches this rank only
    state = {"model": get_model_state_dict(model, options=full),
             "optimizer": get_optimizer_state_dict(model, opt, options=full)}
    if rank == 0:
        torch.save({"restored": restored, "step": spot.step, "dumps": dumps, **state}, os.environ["TEST_OUT"])
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path: Path, uri: str, attempt: str, out: Path, nproc: int = 2,
              extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "fsdp_train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_")}
    env.update({
        E.JOB_URI: uri, E.ATTEMPT_ID: attempt, E.START_STEP: "0", E.END_STEP: str(TOTAL), E.TOTAL_STEPS: str(TOTAL),
        E.CKPT_MIN_INTERVAL: "0.05", E.CKPT_MAX_INTERVAL: "0.1", E.OUTCOME_FILE: str(tmp_path / f"outcome-{attempt}"),
        "TEST_OUT": str(out), "OMP_NUM_THREADS": "1", **(extra_env or {}),
    })
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(script)],
        env=env, capture_output=True, text=True, timeout=240,
    )


def _ckpts(uri: str, **options) -> CheckpointStore:
    return CheckpointStore(open_store(uri, **options).child(JobLayout.CHECKPOINTS))


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys() and a["model"]
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs"
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys() and a["optimizer"]["state"]
    for name, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][name][key]), f"optimizer {name}.{key} differs"


def _dcp_state(ckpts: CheckpointStore, manifest: Manifest, tmp_path: Path) -> dict:
    """What the checkpoint holds, read by torch's own converter from its files (no session involved)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = tmp_path / f"dcp-{manifest.directory}"
    folder.mkdir()
    ckpts.fetch_all(manifest, str(folder))
    dcp_to_torch_save(str(folder), str(folder / "full.pt"))
    return _load(folder / "full.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 2-rank run on file://, and one on s3:// (moto's server) preempted at step 10 by a notice
    to rank 1, then resumed."""
    from airflow_spot.testing.moto_s3 import create_bucket, moto_server

    tmp = tmp_path_factory.mktemp("sharded")
    # periodic saves in the background: uploads slowed (so steps run while one writes), rank 1's first refused
    straight = _torchrun(tmp, f"file://{tmp}/straight", "s", tmp / "straight.pt", extra_env={
        "TEST_SLOW_PUT": "0.25", "TEST_FAIL_PUT_RANK": "1", "TEST_STEP_SLEEP": "0.05", "TEST_DUMP": "1",
        E.CKPT_KEEP: "50"})
    assert straight.returncode == 0, straight.stdout + straight.stderr
    with moto_server() as endpoint:
        create_bucket(endpoint, "sharded")
        uri, s3 = "s3://sharded/job", {"AWS_ENDPOINT_URL_S3": endpoint}
        stopped = _torchrun(tmp, uri, "p", tmp / "unused.pt",
                            extra_env={**s3, "TEST_NOTICE_RANK": "1", "TEST_NOTICE_STEP": "9"})
        emergency = _ckpts(uri, endpoint_url=endpoint).committed()
        resumed = _torchrun(tmp, uri, "r", tmp / "resumed.pt", extra_env={**s3, E.START_STEP: "10"})
        hosts = _torchrun(tmp, uri, "h", tmp / "hosts.pt",  # each rank on a host of its own
                          extra_env={**s3, "TEST_RESTORE_ONLY": "1", "TEST_HOST_PER_RANK": str(tmp / "hosts")})
        statuses = _ckpts(uri, endpoint_url=endpoint).inspect(verify_payloads=True)
    return {"tmp": tmp, "straight": f"file://{tmp}/straight", "straight_log": straight.stdout + straight.stderr,
            "stopped": stopped, "emergency": emergency, "resumed": resumed, "hosts": hosts, "statuses": statuses}


def test_periodic_sharded_saves_write_in_the_background_and_a_failed_one_commits_nothing(runs, tmp_path):
    """Two ranks, uploads slowed: training steps on while a periodic save writes, the stall counted into the
    interval is the staging alone, each checkpoint holds the state of its step (the staged copy, not the live
    state the following steps changed), and a save one rank could not upload commits nothing, the next ones do."""
    log = runs["straight_log"]
    (refused,) = [int(s) for s in re.findall(r"TEST refused a put at step (\d+)", log)]
    assert (f"background checkpoint write failed: sharded checkpoint at step {refused} was not committed (rank 1: "
            "OSError: [Errno 28] No space left on device)") in log, log
    commits = [(int(a), int(b)) for a, b in re.findall(r"TEST committed step (\d+) at step (\d+)", log)]
    manifests = _ckpts(runs["straight"]).committed()
    assert [m.step for m in manifests] == [step for step, _ in commits] and commits[-1][0] == TOTAL, log
    assert refused not in [m.step for m in manifests]  # rank 0's files put, but no manifest names them
    periodic = [m for m in manifests if m.meta["reason"] == "periodic"]
    assert periodic and periodic[0].step > refused, manifests  # the next one tried again, and committed
    # committed after training went on: the save started before step N ran, its commit came at a later step
    assert any(at > step for step, at in commits[:-1]), commits
    assert re.search(r"TEST step \d+ ran, a save writing: True", log), log
    stall, write = map(float, re.findall(r"stall ([\d.e-]+) write ([\d.e-]+)", log)[-1])
    assert write >= 0.25 > stall, (stall, write)  # each rank's upload sleeps 0.25 s, in the background
    dumps = _load(runs["tmp"] / "straight.pt")["dumps"]
    for m in periodic:
        _assert_same_state(dumps[m.step], _dcp_state(_ckpts(runs["straight"]), m, tmp_path))


def test_a_notice_to_one_rank_commits_one_sharded_checkpoint_and_the_resume_is_bit_exact(runs):
    tmp, stopped = runs["tmp"], runs["stopped"]
    log = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0 and (tmp / "outcome-p").read_text().startswith("preempted"), log
    assert "emergency checkpoint at step 10 committed" in log, log
    last = runs["emergency"][-1]
    assert (last.step, last.meta["reason"], last.layout, last.schema) == (10, "emergency", LAYOUT_DCP, MANIFEST_SCHEMA)
    # one manifest names every rank's files: rank 0's payload first, the DCP metadata, one shard file per rank
    assert [f.name for f in last.files] == [PAYLOAD, ".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(m.layout == LAYOUT_DCP for m in runs["emergency"])  # the periodic saves too
    assert not (tmp / "unused.pt").exists()

    resumed = runs["resumed"]
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    statuses = runs["statuses"]  # on s3, every file of every checkpoint fetched and verified
    assert statuses and all(s.ok and s.manifest.layout == LAYOUT_DCP for s in statuses), statuses
    later = [s.manifest for s in statuses if s.manifest.writer == "r"]
    assert later and min(m.step for m in later) > 10 and later[-1].step == TOTAL
    out = _load(tmp / "resumed.pt")
    assert (out["restored"], out["step"]) == (10, TOTAL)
    _assert_same_state(_load(tmp / "straight.pt"), out)
    counts = _fetch_counts(resumed.stdout + resumed.stderr)
    # the two ranks share one host: between them they fetched each of the checkpoint's four files once from s3
    assert sum(fetched for fetched, _ in counts.values()) == 4 and counts[1][1] >= 2, counts  # rank 1: payload, metadata


def test_each_host_fetches_only_the_shard_files_its_ranks_read(runs):
    """Two ranks on two hosts (a temporary directory each): each fetches the payload, DCP's metadata and the shard
    files its own read plan names, not the whole checkpoint, and the state is the checkpoint's."""
    hosts = runs["hosts"]
    log = hosts.stdout + hosts.stderr
    assert hosts.returncode == 0, log
    counts = _fetch_counts(log)
    assert all(reused == 0 for _, reused in counts.values()), counts  # nothing shared across hosts
    assert all(fetched >= 3 for fetched, _ in counts.values()), counts  # payload, metadata, its own shards
    assert sum(fetched for fetched, _ in counts.values()) < 2 * 4, counts  # not the whole checkpoint on each host
    for rank in ("0", "1"):  # each host's share is gone once its ranks have read what they need
        assert not [n for n in os.listdir(runs["tmp"] / "hosts" / rank) if n.startswith(SHARE_PREFIX)]
    out = _load(runs["tmp"] / "hosts.pt")
    assert out["restored"] == TOTAL
    _assert_same_state(_load(runs["tmp"] / "resumed.pt"), out)


def _fetch_counts(log: str) -> dict[int, tuple[int, int]]:
    """rank: (files it fetched from the store, files another rank of its host fetched), from its log."""
    found = re.findall(r"rank (\d) INFO checkpoint files: (\d+) fetched from the store by this rank, (\d+) fetched "
                       r"by another rank of this host", log)
    assert len(found) == 2, log
    return {int(rank): (int(fetched), int(reused)) for rank, fetched, reused in found}


def test_a_two_rank_checkpoint_resumes_on_one_rank_with_the_same_weights(runs, tmp_path):
    ckpts = _ckpts(runs["straight"])
    newest = ckpts.committed()[-1]
    one = _torchrun(tmp_path, runs["straight"], "one", tmp_path / "one.pt", nproc=1,
                    extra_env={"TEST_RESTORE_ONLY": "1"})
    assert one.returncode == 0, one.stdout + one.stderr
    out = _load(tmp_path / "one.pt")
    assert out["restored"] == newest.step == TOTAL
    _assert_same_state(_dcp_state(ckpts, newest, tmp_path), out)  # resharded 2 -> 1
    _assert_same_state(_load(runs["tmp"] / "straight.pt"), out)


def test_a_corrupt_shard_falls_back_to_the_previous_checkpoint(runs, tmp_path):
    job = tmp_path / "job"
    shutil.copytree(runs["straight"].removeprefix("file://"), job)
    uri = f"file://{job}"
    ckpts = _ckpts(uri)
    newest, previous = ckpts.committed()[-1], ckpts.committed()[-2]
    shard = job / JobLayout.CHECKPOINTS / newest.directory / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the digest can tell
    shard.write_bytes(bytes(raw))
    assert ckpts.latest_step() == newest.step  # sizes only: as before, the digest is checked by a restore

    got = _torchrun(tmp_path, uri, "c", tmp_path / "c.pt", extra_env={"TEST_RESTORE_ONLY": "1"})
    log = got.stdout + got.stderr
    assert got.returncode == 0, log
    assert "is unusable, falling back to the previous one" in log and "__1_0.distcp: sha256 mismatch" in log, log
    out = _load(tmp_path / "c.pt")
    assert out["restored"] == previous.step < newest.step
    _assert_same_state(_dcp_state(ckpts, previous, tmp_path), out)
    # the Airflow side's readers see it too: inspect verifies every file, the job view sums them
    broken = [s for s in ckpts.inspect(verify_payloads=True) if not s.ok]
    assert [s.directory for s in broken] == [newest.directory] and "__1_0.distcp" in broken[0].problem
    sizes = {c["step"]: c["size"] for c in JobView(open_store(uri)).checkpoints()}
    assert sizes[previous.step] == sum(f.size for f in previous.files) > previous.files[0].size


def test_a_rank_that_cannot_read_the_chosen_checkpoint_stops_every_rank_with_the_reason(runs, tmp_path):
    temp = tmp_path / "temp"  # the ranks' temporary directory, where the host share lives
    temp.mkdir()
    got = _torchrun(tmp_path, runs["straight"], "f", tmp_path / "f.pt",
                    extra_env={"TEST_RESTORE_ONLY": "1", "TEST_FAIL_RESTORE_RANK": "1", "TMPDIR": str(temp)})
    log = got.stdout + got.stderr
    assert got.returncode != 0 and not (tmp_path / "f.pt").exists(), log
    assert "Input/output error" in log, log  # rank 1's own reason
    assert "another rank could not read the checkpoint" in log, log  # rank 0's, before DCP's collectives
    assert not [n for n in os.listdir(temp) if n.startswith(SHARE_PREFIX)], log  # removed on the way out


def test_restore_to_copies_a_sharded_checkpoint_into_a_folder_dcp_reads(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from airflow_spot.cli import main

    newest = _ckpts(runs["straight"]).committed()[-1]
    assert main(["checkpoints", "restore", "--step", str(newest.step), "--to", str(tmp_path / "out"),
                 runs["straight"]]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == sorted(f.name for f in newest.files)
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "full.pt"))
    _assert_same_state(_load(runs["tmp"] / "straight.pt"), _load(tmp_path / "full.pt"))
    assert main(["checkpoints", "verify", runs["straight"]]) == 0


# ---------------------------------------------------------------------------------------------- manifest rules
def _sharded_manifest(tmp_path: Path) -> tuple[CheckpointStore, Manifest]:
    ckpts = CheckpointStore(open_store(f"file://{tmp_path}/ckpts"), writer="w")
    directory = ckpts.new_directory(7)
    files = tuple(ckpts.put_file(directory, name, lambda f, n=name: f.write(n.encode() * 100), 7)
                  for name in (PAYLOAD, ".metadata", "__0_0.distcp", "__1_0.distcp"))
    return ckpts, ckpts.commit(7, directory, files, {"reason": "periodic"}, 0.1, layout=LAYOUT_DCP)


def test_a_sharded_manifest_is_schema_4_and_an_older_reader_is_told_to_upgrade(tmp_path, monkeypatch):
    import airflow_spot.storage.manifest as manifest_module

    ckpts, m = _sharded_manifest(tmp_path)
    raw = ckpts.store.get_bytes(f"{m.directory}/{MANIFEST}")
    d = json.loads(raw)
    assert d["schema"] == 4 and d["meta"]["layout"] == LAYOUT_DCP
    # no field of its own: a schema-3 reader (which checks fields before the schema) meets only the schema number
    assert set(d) <= {"step", "directory", "files", "writer", "created_at", "save_seconds", "meta", "schema",
                      "checksum"}
    assert Manifest.from_json(raw, m.directory).layout == LAYOUT_DCP
    monkeypatch.setattr(manifest_module, "MANIFEST_SCHEMA", 3)  # the reader before sharded checkpoints
    with pytest.raises(ManifestError, match="schema 4 is newer than this code understands; upgrade airflow-spot"):
        Manifest.from_json(raw, m.directory)


def test_a_single_payload_checkpoint_stays_schema_3_so_a_rollback_reads_it(tmp_path):
    ckpts = CheckpointStore(open_store(f"file://{tmp_path}/c"))
    m = ckpts.save(1, lambda f: f.write(b"x"))
    assert (m.schema, m.layout) == (3, None)


@pytest.mark.parametrize("schema, layout", [(3, LAYOUT_DCP), (4, "megatron")])
def test_a_layout_the_schema_does_not_know_makes_the_manifest_untrusted(tmp_path, schema, layout):
    ckpts, m = _sharded_manifest(tmp_path)
    d = json.loads(ckpts.store.get_bytes(f"{m.directory}/{MANIFEST}"))
    d["schema"], d["meta"]["layout"] = schema, layout
    d["checksum"] = manifest_checksum(d)
    with pytest.raises(ManifestError, match="is not a layout of manifest schema"):
        Manifest.from_json(json.dumps(d).encode(), m.directory)


def test_every_file_of_a_sharded_checkpoint_is_checked_and_a_restore_fetches_only_what_a_rank_reads(tmp_path):
    ckpts, m = _sharded_manifest(tmp_path)
    assert ckpts.latest_step() == 7 and m.size == sum(f.size for f in m.files)
    # read sees the payload and DCP's metadata, fetched beside it; the shard files are left to each rank's plan
    assert ckpts.restore_latest(lambda p: sorted(os.listdir(os.path.dirname(p))))[1] == [".metadata", PAYLOAD]
    folder = tmp_path / "rank1"
    folder.mkdir()
    assert ckpts.fetch_into(m, str(folder), ["__1_0.distcp"]) == 1
    assert ckpts.fetch_into(m, str(folder), ["__1_0.distcp"]) == 0  # there already
    assert os.listdir(folder) == ["__1_0.distcp"] and (folder / "__1_0.distcp").read_bytes() == b"__1_0.distcp" * 100
    with pytest.raises(CheckpointError, match=r"__2_0.distcp is not one of its files \(its manifest lists"):
        ckpts.fetch_into(m, str(folder), ["__2_0.distcp"])
    ckpts.store.delete([f"{m.directory}/__1_0.distcp"])
    with pytest.raises(Exception, match="__1_0.distcp: file is missing"):
        ckpts.latest_step()
    # a restore checks every file's size before it reads one: a missing shard is skipped like a broken payload
    with pytest.raises(NoUsableCheckpointError, match="__1_0.distcp: file is missing"):
        ckpts.restore_latest(lambda p: None)


def test_a_restore_skips_what_it_is_told_is_broken(tmp_path):
    ckpts = CheckpointStore(open_store(f"file://{tmp_path}/c"))
    older, newer = ckpts.save(1, lambda f: f.write(b"one")), ckpts.save(2, lambda f: f.write(b"two"))
    read = lambda p: open(p, "rb").read()  # noqa: E731
    assert ckpts.restore_latest(read, skip={newer.directory: "a shard does not verify"}) == (older, b"one")
    with pytest.raises(NoUsableCheckpointError, match="a shard does not verify"):
        ckpts.restore_latest(read, skip={newer.directory: "a shard does not verify", older.directory: "nor here"})


# ---------------------------------------------------------------------------------------------- track() refusals
@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _sharded_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def _train_one_rank(job_uri: str, steps: int) -> dict[str, torch.Tensor]:
    """Train a one-rank sharded model ``steps`` steps under a session at ``job_uri``; its full weights after."""
    from airflow_spot.training.session import SpotSession

    torch.manual_seed(0)
    model = _sharded_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with SpotSession(job_uri, steps) as spot:
        spot.track(model=model, optimizer=opt)
        for _ in spot.steps():
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def test_an_optimizer_over_sharded_and_plain_parameters_is_refused(one_rank_group, tmp_path):
    from airflow_spot.training.session import SpotSession

    model, plain = _sharded_model(), torch.nn.Linear(2, 2)
    opt = torch.optim.Adam([*model.parameters(), *plain.parameters()])
    spot = SpotSession(f"file://{tmp_path}/job", 10)
    with pytest.raises(ValueError, match="sharded \\(DTensor\\) and plain parameters"):
        spot.track(model=model, optimizer=opt)


def test_a_sharded_optimizer_without_its_model_is_refused(one_rank_group, tmp_path):
    from airflow_spot.training.session import SpotSession

    model = _sharded_model()
    spot = SpotSession(f"file://{tmp_path}/job", 10)
    with pytest.raises(ValueError, match="belong to no single tracked sharded model"):
        spot.track(optimizer=torch.optim.Adam(model.parameters()))


def test_sharded_state_without_torch_distributed_is_refused(one_rank_group, tmp_path):
    import torch.distributed as dist

    from airflow_spot.training.session import SpotSession

    model = _sharded_model()
    spot = SpotSession(f"file://{tmp_path}/job", 10)
    dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="init_process_group"):
        spot.track(model=model)


def test_one_process_saves_and_restores_sharded_state(one_rank_group, tmp_path):
    """One rank (torch.distributed on one process, no Ranks): the same DCP layout, in process."""
    from airflow_spot.training.session import SpotSession

    saved = _train_one_rank(f"file://{tmp_path}/job", 3)
    (m,) = [m for m in _ckpts(f"file://{tmp_path}/job").committed() if m.step == 3]
    assert m.layout == LAYOUT_DCP and [f.name for f in m.files] == [PAYLOAD, ".metadata", "__0_0.distcp"]
    torch.manual_seed(1)
    fresh = _sharded_model()
    again = SpotSession(f"file://{tmp_path}/job", 6, start_step=3)
    assert again.track(model=fresh, optimizer=torch.optim.Adam(fresh.parameters(), lr=0.1)) == 3
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.full_tensor(), saved[k]), k


def test_a_save_before_the_first_step_leaves_the_optimizer_without_state_as_it_was(one_rank_group, tmp_path):
    """DCP's optimizer state dict gives a fresh optimizer state (a step at lr 0: Adam would count from 1); neither
    the live optimizer nor the resumed one may keep it, or the run is no longer the uninterrupted one."""
    from airflow_spot.training.session import SpotSession

    model = _sharded_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    spot = SpotSession(f"file://{tmp_path}/job", 3)
    spot.track(model=model, optimizer=opt)
    spot.save()
    assert not opt.state and all(p.grad is None for p in model.parameters())
    fresh = _sharded_model()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    assert SpotSession(f"file://{tmp_path}/job", 3).track(model=fresh, optimizer=fresh_opt) == 0
    assert not fresh_opt.state
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.full_tensor(), model.state_dict()[k].full_tensor()), k


def test_a_shard_that_cannot_be_put_commits_nothing(one_rank_group, tmp_path, monkeypatch, caplog):
    from airflow_spot.storage.checkpoint import CheckpointSaveError
    from airflow_spot.training.session import SpotSession

    model = _sharded_model()
    spot = SpotSession(f"file://{tmp_path}/job", 3)
    spot.track(model=model, optimizer=torch.optim.Adam(model.parameters()))
    put = spot.checkpoints.put_file

    def refuse_shards(directory, name, write, step):
        if name.endswith(".distcp"):
            raise OSError(28, "No space left on device")
        return put(directory, name, write, step)

    monkeypatch.setattr(spot.checkpoints, "put_file", refuse_shards)
    with pytest.raises(CheckpointSaveError, match="rank 0: OSError.*No space left on device"):
        spot.save()  # a required save: the error reaches the script
    spot._save("periodic", wait=False)  # a periodic one, in the background, is logged; the next one tries again
    spot.writer.wait()
    assert spot.writer.failures == 1 and spot.writer.last_committed_step is None
    assert "background checkpoint write failed" in caplog.text and "No space left on device" in caplog.text
    assert _ckpts(f"file://{tmp_path}/job").committed() == []  # files put, but never a manifest naming them


def test_a_torch_without_dcps_staging_helpers_saves_sharded_state_synchronously(one_rank_group, tmp_path, monkeypatch):
    """The background save copies the shards with DCP's private staging helpers; a torch build without them
    must still save (in the foreground), not fail every periodic save."""
    import builtins

    real_import = builtins.__import__

    def no_helpers(name, *args, **kwargs):
        if name == "torch.distributed._state_dict_utils":
            raise ImportError("no DCP staging helpers in this torch")
        return real_import(name, *args, **kwargs)

    from airflow_spot.training import sharded
    from airflow_spot.training.session import SpotSession

    model = _sharded_model()
    spot = SpotSession(f"file://{tmp_path}/job", 3)
    spot.track(model=model, optimizer=torch.optim.Adam(model.parameters()))
    with monkeypatch.context() as patched:
        patched.setattr(builtins, "__import__", no_helpers)
        available = sharded._host_copy_available()
    # the save itself runs with the real import: torch's own imports failing under the patch left state behind
    # that made a DataLoader worker forked later in the same test process crash
    monkeypatch.setattr(sharded, "_host_copy_available", lambda: available)
    assert not available and spot._save("periodic", wait=False)
    assert not spot.writer.busy  # nothing went to the background: the save is done
    assert [m.step for m in _ckpts(f"file://{tmp_path}/job").committed()] == [0]


def test_a_new_job_warm_starts_its_sharded_model_from_a_sharded_job(one_rank_group, tmp_path):
    """A retraining pipeline: the new job's sharded model starts from the previous job's sharded checkpoint
    (through DCP), its optimizer and steps fresh."""
    from airflow_spot.training.session import SpotSession

    trained = _train_one_rank(f"file://{tmp_path}/old", 3)
    torch.manual_seed(1)
    fresh = _sharded_model()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    new = SpotSession(f"file://{tmp_path}/new", 3, warm_start_uri=f"file://{tmp_path}/old")
    assert new.track(model=fresh, optimizer=fresh_opt) == 0
    assert not fresh_opt.state  # only the model is warm-started (warm_start_keys)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.full_tensor(), trained[k]), k


def test_the_host_copy_reuses_its_buffers_while_the_layout_holds_and_never_broadcasts_into_another_shape():
    from airflow_spot.training.sharded import _to_host

    live = {"model": {"w": torch.arange(4.0)}, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    first, kept = _to_host(live, None)
    live["model"]["w"] += 10
    live["optimizer"]["param_groups"][0]["lr"] = 0.05
    second, kept_again = _to_host(live, kept)
    assert kept_again is kept and second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert torch.equal(second["model"]["w"], torch.arange(4.0) + 10) and second["optimizer"]["param_groups"][0]["lr"] == 0.05
    live["model"]["w"] += 1  # training goes on: the copy does not change with it
    assert torch.equal(second["model"]["w"], torch.arange(4.0) + 10)

    live["model"]["w"] = torch.tensor([7.0])  # another shape under the same key: new buffers, not a broadcast
    third, kept_new = _to_host(live, kept)
    assert kept_new is not kept and torch.equal(third["model"]["w"], torch.tensor([7.0]))
    live["optimizer"]["state"] = {0: {"step": torch.tensor(1.0)}}  # an optimizer's first state: a new key
    fourth, _ = _to_host(live, kept_new)
    assert torch.equal(fourth["optimizer"]["state"][0]["step"], torch.tensor(1.0))


def _train_plain(job_uri: str, steps: int, ddp_style: bool = False) -> dict[str, torch.Tensor]:
    """Train an unsharded model of ``_sharded_model``'s shape ``steps`` steps in one process; its weights after.
    ``ddp_style``: tracked under a wrapper whose keys carry ``module.``, as ``DistributedDataParallel``'s do."""
    from airflow_spot.training.session import SpotSession

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with SpotSession(job_uri, steps) as spot:
        spot.track(model=torch.nn.ModuleDict({"module": model}) if ddp_style else model, optimizer=opt)
        for _ in spot.steps():
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("ddp_style", [False, True])
def test_a_sharded_model_warm_starts_from_an_unsharded_job(one_rank_group, tmp_path, ddp_style):
    """A retraining pipeline that moves to FSDP: the new job's sharded model takes the old job's full weights."""
    from airflow_spot.training.session import SpotSession

    trained = _train_plain(f"file://{tmp_path}/old", 3, ddp_style)
    torch.manual_seed(1)
    fresh = _sharded_model()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    new = SpotSession(f"file://{tmp_path}/new", 3, warm_start_uri=f"file://{tmp_path}/old")
    assert new.track(model=fresh, optimizer=fresh_opt) == 0
    assert not fresh_opt.state
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.full_tensor(), trained[k]), k


def test_an_unsharded_model_warm_starts_from_a_sharded_job(one_rank_group, tmp_path):
    from airflow_spot.training.session import SpotSession

    trained = _train_one_rank(f"file://{tmp_path}/old", 3)
    torch.manual_seed(1)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    new = SpotSession(f"file://{tmp_path}/new", 3, warm_start_uri=f"file://{tmp_path}/old")
    assert new.track(model=plain, optimizer=torch.optim.Adam(plain.parameters(), lr=0.1)) == 0
    for k, v in plain.state_dict().items():
        assert torch.equal(v, trained[k]), k


def test_an_optimizer_or_a_resume_across_the_kinds_is_refused_with_the_fix(one_rank_group, tmp_path):
    from airflow_spot.training.session import SpotSession

    _train_plain(f"file://{tmp_path}/old", 2)
    model = _sharded_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    warm_opt = SpotSession(f"file://{tmp_path}/new", 3, warm_start_uri=f"file://{tmp_path}/old",
                           warm_start_keys=("model", "optimizer"))
    with pytest.raises(RuntimeError, match="warm-starts the model only"):
        warm_opt.track(model=model, optimizer=opt)
    resumed = SpotSession(f"file://{tmp_path}/old", 3)  # the unsharded job's own checkpoint, resumed sharded
    with pytest.raises(RuntimeError, match="resuming an unsharded job's state"):
        resumed.track(model=_sharded_model())


@pytest.mark.parametrize("failure, kind, says", [
    (CheckpointError("checkpoint d/__1_0.distcp: sha256 mismatch (corrupt or tampered)"), "BrokenShardError",
     "sha256 mismatch"),
    (ConnectionResetError(104, "Connection reset by peer"), "CheckpointError", "the store is unreachable"),
    (AssertionError("req mismatch sizes"), "RuntimeError", "Build the sharded state as it was"),
])
def test_a_failed_dcp_read_is_told_apart_a_broken_file_falls_back_a_store_error_never_does(failure, kind, says):
    """What every rank gets from a failed dcp.load (DCP gathers the ranks' failures into one exception): a file
    that does not verify makes the ranks fall back to the checkpoint before; a store that cannot be read is
    retried by the next attempt, never a fall-back; anything else is the state not matching the files."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from airflow_spot.training.sharded import BrokenShardError, _read_failure

    gathered = CheckpointException("read", {1: (failure, traceback.StackSummary())})
    got = _read_failure(gathered, "the checkpoint at step 7")
    assert type(got).__name__ == kind and says in str(got) and "the checkpoint at step 7" in str(got), got
    assert isinstance(got, BrokenShardError) == (kind == "BrokenShardError")
