"""Chaos: >= 1,000 manifest corruptions, each followed by a restore; 0 wrong restores, 0 silent restarts.

Run before a release with ``python -m pytest -m chaos -s tests/chaos/test_chaos_manifests.py``. Corruptions
(see airflow_spot.testing.manifest_faults): bit flips anywhere in a manifest (1 to 8 bits), truncation at a
random length, wrong-but-valid JSON (changed step, size, sha256, digest block size, directory or writer, a removed field; half
of them re-checksummed, as a tool rewriting the manifest would), manifests swapped between checkpoints,
non-object JSON and empty files; in 10% of the cases every manifest of the store is damaged at once.
Each run prints one summary line per store for the README.
"""
from __future__ import annotations

import pytest

from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.testing.manifest_faults import build_store, run_campaign

pytestmark = pytest.mark.chaos

STEPS = [100, 200, 300, 400, 500]


def _campaign(ckpts: CheckpointStore, label: str, cases: int, seed: int):
    keys = build_store(ckpts, STEPS)
    result = run_campaign(ckpts, keys, cases=cases, seed=seed)
    print("\n" + result.summary(label))
    assert result.failures == [], "\n".join(result.failures[:20])
    v = result.verdicts
    assert v["wrong_restore"] == 0 and v["silent_restart"] == 0 and v["refused"] == 0 and v["wrong_latest"] == 0
    # latest_step checks manifests and payload sizes but never re-hashes payloads (see manifest_faults):
    # the only cases that are not "correct" are those, and restore still skipped them.
    assert v["correct"] + v["latest_ahead_unhashed"] == cases
    assert v["raised_no_intact"] > 0 and v["fell_back"] > 0  # both ways of being right were exercised
    return result


def test_manifest_corruptions_file(tmp_path):
    _campaign(CheckpointStore(open_store(f"file://{tmp_path}/ckpts"), writer="chaos"), "file://", 1200, seed=20261123)


def test_manifest_corruptions_s3():
    from airflow_spot.testing.moto_s3 import create_bucket, moto_server

    with moto_server() as endpoint:
        create_bucket(endpoint, "chaos")
        store = open_store("s3://chaos/job/checkpoints", endpoint_url=endpoint)
        _campaign(CheckpointStore(store, writer="chaos"), "s3:// (moto server)", 200, seed=11)
