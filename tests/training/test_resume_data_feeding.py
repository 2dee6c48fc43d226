"""Each way of feeding data, interrupted by notices and SIGKILLs at random steps and resumed from the store
each time, ends with weights and optimizer state bit-identical to a run that was never interrupted.

The runs are forked from a server that imported torch once (``airflow_spot.testing.forkserver``):
``torch.use_deterministic_algorithms`` alone imports torch's compiler stack, seconds per interpreter.
"""
from __future__ import annotations

import itertools
import json
import os

import pytest

from airflow_spot.examples.train_feeds import FEEDS
from airflow_spot.testing.forkserver import ForkServer
from tests.training.test_bit_exact_resume import assert_same_training, finish, interrupt_and_resume

TOTAL = 240
MODULE = "airflow_spot.examples.train_feeds"
#: what the scripts import, loaded once by the fork server
PRELOAD = ["torch", "torch._inductor", "numpy", "airflow_spot.examples.train_tiny", MODULE,
           "airflow_spot.training.session"]


@pytest.fixture(scope="module")
def forks():
    with ForkServer(PRELOAD) as server:
        yield server


def forked(forks: ForkServer, argv: list[str], log_dir):
    """``spawn`` for interrupt_and_resume: each run forked from the server, its output in its own file."""
    counter = itertools.count()

    def spawn(args: list[str], env: dict):
        return forks.spawn(MODULE, argv + args, env, os.path.join(str(log_dir), f"run{next(counter)}.log"))

    return spawn


@pytest.mark.parametrize("feed", FEEDS)
def test_interrupted_feed_resumes_bit_exact(tmp_path, feed, forks):
    argv = ["--feed", feed, "--total-steps", str(TOTAL)]
    spawn = forked(forks, argv, tmp_path)
    ref = tmp_path / "ref.pt"
    reference = spawn(["--job-uri", str(tmp_path / "ref-job"), "--final-weights", str(ref)], dict(os.environ))
    assert reference.wait(timeout=300) == 0, open(reference.output).read()[-3000:]
    job = f"file://{tmp_path}/job"
    modes = ["sigterm", "sigkill", "file", "sigkill"]
    record = interrupt_and_resume([], job, tmp_path, modes, seed=FEEDS.index(feed) + 11, total=TOTAL, spawn=spawn)
    out = finish([], job, tmp_path, total=TOTAL, spawn=spawn)
    print(feed, json.dumps(record))
    assert_same_training(str(ref), out)
