"""A session never silently restarts from step 0: lost or broken checkpoints stop it with a clear error."""
from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from airflow_spot.storage.checkpoint import MANIFEST, CheckpointError, CheckpointStore, NoUsableCheckpointError
from airflow_spot.storage.object_store import open_store
from airflow_spot.training import SpotSession


def _session(job: str, start: int, end: int):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return SpotSession(job, end, start_step=start, notice_sources=[], heartbeat_seconds=0.05), model


def _first_segment(job: str) -> None:
    spot, model = _session(job, 0, 5)
    with spot:
        spot.track(model=model)
        for _ in spot.steps():
            pass


def test_checkpoint_directory_deleted_between_segments_is_an_error(tmp_path):
    job = str(tmp_path / "job")
    _first_segment(job)
    shutil.rmtree(tmp_path / "job" / "checkpoints")  # someone deletes the checkpoints mid-run
    spot, model = _session(job, 5, 10)
    with pytest.raises(CheckpointError, match="planned to start at step 5.*holds no checkpoint"):
        with spot:
            spot.track(model=model)


def test_unreadable_sole_manifest_stops_the_session_instead_of_training_from_zero(tmp_path):
    job = str(tmp_path / "job")
    _first_segment(job)
    ckpts = CheckpointStore(open_store(job).child("checkpoints"))
    for m in ckpts.committed():
        ckpts.store.put_bytes(f"{m.directory}/{MANIFEST}", b"{")
    spot, model = _session(job, 0, 10)  # even a segment planned from 0 must not overwrite lost progress
    with pytest.raises(NoUsableCheckpointError, match="airflow-spot checkpoints verify"):
        with spot:
            spot.track(model=model)
