"""A sharded (FSDP2) resume across hosts: the bytes each host fetches from s3:// (moto's server on 127.0.0.1).

Four ranks under ``torch.distributed.run`` (gloo, CPU) train an FSDP2 model with Adam one step under a
``SpotSession`` that commits one sharded checkpoint; then the same four ranks restore it, grouped into 1, 2 and 4
"hosts" (a temporary directory per host, where the host share lives). Each rank counts the bytes it downloads
(``CheckpointStore._download_verified``, wrapped in the script); reported per host against the checkpoint's
size, which is what every host fetched before a rank fetched only the shard files its DCP read plan names.

    python benchmarks/bench_host_fetch.py [--width 1024] [--layers 8]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap

from airflow_spot.testing.moto_s3 import create_bucket, moto_server_process
from airflow_spot.training import env as E

RANKS = 4

SCRIPT = textwrap.dedent("""
    import json, os, tempfile, time
    host = os.environ.get("BENCH_HOSTS_DIR")
    if host:  # this rank's host: a temporary directory per group of ranks
        per_host = int(os.environ["WORLD_SIZE"]) // int(os.environ["BENCH_HOSTS"])
        tempfile.tempdir = os.path.join(host, str(int(os.environ["RANK"]) // per_host))
        os.makedirs(tempfile.tempdir, exist_ok=True)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from airflow_spot.storage.checkpoint import CheckpointStore
    from airflow_spot.training import SpotSession

    fetched = []
    download = CheckpointStore._download_verified

    def counted(self, manifest, entry, dest):
        download(self, manifest, entry, dest)
        fetched.append((entry.name, entry.size))

    CheckpointStore._download_verified = counted
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width, layers = int(os.environ["BENCH_WIDTH"]), int(os.environ["BENCH_LAYERS"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with SpotSession.from_env() as spot:
        started = time.perf_counter()
        spot.track(model=model, optimizer=opt)
        restore = time.perf_counter() - started
        if not host:
            for _ in spot.steps():
                model(torch.ones(2, width)).sum().backward()
                opt.step()
                opt.zero_grad()
    with open(os.path.join(os.environ["BENCH_OUT"], f"rank{rank}.json"), "w") as out:
        json.dump({"rank": rank, "fetched": fetched, "restore_s": restore}, out)
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script: str, env: dict[str, str]) -> list[dict]:
    out = tempfile.mkdtemp(prefix="bench-host-fetch-")
    env = {**env, "BENCH_OUT": out}
    got = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(RANKS),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", script],
        env=env, capture_output=True, text=True, timeout=900)
    if got.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{got.stdout[-3000:]}\n{got.stderr[-3000:]}")
    rows = []
    for rank in range(RANKS):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            rows.append(json.load(f))
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, moto_server_process() as endpoint:
        create_bucket(endpoint, "bench")
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_")}
        env.update({E.JOB_URI: "s3://bench/job", E.START_STEP: "0", E.END_STEP: "1", E.TOTAL_STEPS: "1",
                    "AWS_ENDPOINT_URL_S3": endpoint, "OMP_NUM_THREADS": "1", "BENCH_WIDTH": str(args.width),
                    "BENCH_LAYERS": str(args.layers), E.OUTCOME_FILE: os.path.join(tmp, "outcome")})
        _torchrun(script, {**env, E.ATTEMPT_ID: "save"})
        rows = []
        for hosts in (1, 2, 4):
            ranks = _torchrun(script, {**env, E.ATTEMPT_ID: f"h{hosts}", "BENCH_HOSTS": str(hosts),
                                       "BENCH_HOSTS_DIR": os.path.join(tmp, f"hosts{hosts}")})
            rows.append((hosts, ranks))
    mb = 1024 * 1024
    one = rows[0][1]
    total = sum(size for r in one for _, size in r["fetched"])  # one host: every file once
    print(f"{RANKS} ranks restore one sharded checkpoint (FSDP2 {args.layers} x Linear({args.width}, {args.width}) + "
          f"Adam: {total / mb:.1f} MB in {sum(len(r['fetched']) for r in one)} files) from s3:// (moto); python "
          f"{sys.version.split()[0]}, {os.cpu_count()} cpus")
    for hosts, ranks in rows:
        per_host = RANKS // hosts
        by_host = [sum(size for r in ranks if r["rank"] // per_host == h for _, size in r["fetched"])
                   for h in range(hosts)]
        files = [sorted(name for r in ranks if r["rank"] // per_host == h for name, _ in r["fetched"])
                 for h in range(hosts)]
        print(f"  {hosts} host(s) of {per_host} rank(s): fetched per host "
              + ", ".join(f"{b / mb:.1f} MB ({b / total:.2f}x, {len(f)} files)" for b, f in zip(by_host, files))
              + f"; all hosts {sum(by_host) / mb:.1f} MB against {hosts * total / mb:.1f} MB for the whole "
              f"checkpoint on each; slowest rank's restore {max(r['restore_s'] for r in ranks):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
