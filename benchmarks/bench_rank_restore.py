"""A resume under torchrun: N ranks of one host reading one checkpoint from s3:// (moto's server on 127.0.0.1),
each fetching its own copy (before) against fetching once through a host share (``storage/host_share.py``).

Side by side in one run, interleaved (who goes first alternates): N threads stand in for the ranks (the
share's ``flock`` locks exclude each other between threads as between processes), each calls
``CheckpointStore.restore`` of the same checkpoint (download, sha256 verify, read) as a non-writer rank does.
Reports the wall time until every rank has its verified payload and the bytes fetched from the store.

    python benchmarks/bench_rank_restore.py [--mb 256] [--ranks 4] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid

from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.host_share import HostShare
from airflow_spot.storage.object_store import S3Store
from airflow_spot.testing.moto_s3 import create_bucket, moto_server_process


def _restore_on_every_rank(ckpts: CheckpointStore, directory: str, ranks: int, shared: bool) -> tuple[float, int]:
    token = uuid.uuid4().hex
    sizes: list[int] = []
    shares: list[HostShare] = []

    def rank() -> None:
        view = ckpts
        if shared:
            share = HostShare(token)
            shares.append(share)
            view = ckpts.sharing(share)
        sizes.append(view.restore(directory, os.path.getsize)[1])

    started = time.perf_counter()
    threads = [threading.Thread(target=rank) for _ in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if len(sizes) != ranks:
        raise SystemExit("a rank failed to restore; see the error above")
    fetched = sum(s.fetched for s in shares) if shared else ranks
    if shares:
        shares[0].remove()
    return wall, fetched * sizes[0]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    data = os.urandom(args.mb * 1024 * 1024)
    with moto_server_process() as endpoint:
        create_bucket(endpoint, "bench")
        ckpts = CheckpointStore(S3Store("bench", "job/checkpoints", endpoint_url=endpoint), writer="bench")
        directory = ckpts.save(1, lambda f: f.write(data)).directory
        own, shared = [], []
        for i in range(args.repeats):
            for mode in ((False, True) if i % 2 == 0 else (True, False)):
                wall, fetched = _restore_on_every_rank(ckpts, directory, args.ranks, mode)
                (shared if mode else own).append((wall, fetched))
    mb = 1024 * 1024
    print(f"{args.ranks} ranks of one host restore one {args.mb} MB checkpoint from s3:// (moto), "
          f"{args.repeats} repeats, interleaved; python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    for name, runs in (("each rank fetches its own copy", own), ("one fetch per host (host share)", shared)):
        walls = [w for w, _ in runs]
        print(f"  {name:34s} wall median {statistics.median(walls):6.2f} s (min {min(walls):.2f}, "
              f"max {max(walls):.2f})  fetched {runs[0][1] / mb:7.0f} MB")
    ratio = statistics.median(w for w, _ in shared) / statistics.median(w for w, _ in own)
    print(f"  wall, host share / own copies: {ratio:.2f}x; bytes fetched: "
          f"{shared[0][1] / own[0][1]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
