"""ResumableLoader and the session's handling of DataLoaders and RNG objects, in process."""
from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from airflow_spot.examples.train_feeds import PairStream
from airflow_spot.training import ResumableLoader, ResumableSampler, SpotSession


class Augmented(Dataset):
    """Each fetch draws from torch's, python's and numpy's RNGs: a batch records which draws it got."""

    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), random.random(), float(np.random.rand())])


class Unpositioned(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def take(loader, n: int) -> list[torch.Tensor]:
    return [next(loader) for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restored_loader_continues_with_the_same_batches(workers):
    """Across epoch ends (37 items, batches of 5, so 8 per epoch), a loader restored from a mid-epoch
    state feeds exactly what the loader that went on feeds; with workers the augmentations match too."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    # workers start from a fork server: a worker forked from this test process (after other tests of the same
    # process ran torch.distributed's gloo) could hang or crash in its first step, whatever this test does
    context = {"multiprocessing_context": "forkserver"} if workers else {}
    first = ResumableLoader(Augmented(), batch_size=5, seed=3, num_workers=workers, **context)
    take(first, 11)
    state = first.state_dict()
    rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    expected = take(first, 14)

    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    np.random.set_state(rng[2])
    second = ResumableLoader(Augmented(), batch_size=5, seed=3, num_workers=workers, **context)
    second.load_state_dict(state)
    got = take(second, 14)
    assert [len(b) for b in got] == [len(b) for b in expected]
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    assert second.epoch == first.epoch == 3 and second.batches == first.batches == 1
    indices = sorted(int(i) for b in expected[:5] for i in b[:, 0])  # batches 3-7 of epoch 1
    assert len(set(indices)) == len(indices), "an epoch hands out each item once"


def test_opening_a_loader_does_not_touch_the_global_rng():
    """The mechanism of the DataLoader bug: a new iterator drew its base seed from the global RNG."""
    torch.manual_seed(1)
    before = torch.get_rng_state()
    loader = ResumableLoader(list(range(20)), batch_size=4, num_workers=0)
    take(loader, 7)  # crosses an epoch end: two iterators opened
    assert torch.equal(torch.get_rng_state(), before)

    plain = DataLoader(list(range(20)), batch_size=4)
    iter(plain)
    assert not torch.equal(torch.get_rng_state(), before), "torch changed: the test no longer shows the bug"


def test_an_iterable_dataset_with_a_position_resumes_where_it_was():
    def stream():
        return PairStream(torch.arange(10.0)[:, None], torch.arange(10.0)[:, None], seed=4)

    first = ResumableLoader(stream(), batch_size=3)
    take(first, 5)  # 4 batches per pass (3+3+3+1): into the second pass
    state = first.state_dict()
    rng = torch.get_rng_state(), random.getstate()
    expected = take(first, 6)
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    second = ResumableLoader(stream(), batch_size=3)
    second.load_state_dict(state)
    got = take(second, 6)
    assert [len(y) for _, y in got] == [3, 3, 1, 3, 3, 3]
    for (xa, ya), (xb, yb) in zip(expected, got, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_bad_loader_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="num_workers=0, or a map-style dataset"):
        ResumableLoader(Unpositioned(), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="decides its own order"):
        ResumableLoader(Unpositioned(), batch_size=2, shuffle=True)
    with pytest.raises(TypeError, match="decides sampler itself"):
        ResumableLoader(list(range(4)), batch_size=2, sampler=None)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        ResumableLoader(list(range(4)), batch_size=0)
    loader = ResumableLoader(list(range(4)), batch_size=2)
    with pytest.raises(ValueError, match="saved with batch_size=3"):
        loader.load_state_dict({**loader.state_dict(), "batch_size": 3})
    with pytest.raises(RuntimeError, match="a whole epoch gave no batch"):
        next(ResumableLoader(list(range(3)), batch_size=4, drop_last=True))


@pytest.fixture
def session(tmp_path):
    with SpotSession(f"file://{tmp_path}/job", end_step=10, heartbeat_seconds=60) as spot:
        yield spot


def test_tracking_a_plain_dataloader_over_a_resumable_sampler_gives_it_a_generator(session):
    sampler = ResumableSampler(20, seed=2)
    loader = DataLoader(list(range(20)), sampler=sampler, batch_size=4)
    session.track(model=torch.nn.Linear(2, 2), loader=loader)
    assert session.tracked["loader"] is sampler and loader.generator is not None
    before = torch.get_rng_state()
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_prefetching_dataloader_is_refused_with_the_fix(session):
    loader = DataLoader(list(range(20)), sampler=ResumableSampler(20), batch_size=4, num_workers=2)
    with pytest.raises(ValueError, match=r"num_workers=2.*ResumableLoader"):
        session.track(loader=loader)


def test_unresumable_feeding_is_reported_once_at_start(session, caplog):
    caplog.set_level(logging.WARNING, logger="airflow_spot.session")
    model = torch.nn.Linear(2, 2)
    shuffled = DataLoader(list(range(20)), batch_size=4, shuffle=True)
    session.track(model=model, loader=shuffled, stream=ResumableLoader(Unpositioned(), batch_size=2))
    session.track(loader=shuffled)
    warnings = [r.getMessage() for r in caplog.records if "not be bit-exact" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert any("RandomSampler" in w for w in warnings) and any("Unpositioned" in w for w in warnings)
    assert "loader" not in session.tracked  # nothing of it could be restored


def test_rng_objects_are_checkpointed(tmp_path):
    gen, np_gen, py_rng = torch.Generator().manual_seed(5), np.random.default_rng(5), random.Random(5)
    uri = f"file://{tmp_path}/job"
    with SpotSession(uri, end_step=3, heartbeat_seconds=60) as spot:
        spot.track(model=torch.nn.Linear(2, 2), g=gen, n=np_gen, p=py_rng)
        for _ in spot.steps():
            torch.rand(3, generator=gen), np_gen.random(), py_rng.random()
    expected = torch.rand(3, generator=gen), np_gen.random(), py_rng.random()
    gen2, np_gen2, py_rng2 = torch.Generator(), np.random.default_rng(0), random.Random(0)
    with SpotSession(uri, end_step=4, heartbeat_seconds=60) as spot:
        assert spot.track(model=torch.nn.Linear(2, 2), g=gen2, n=np_gen2, p=py_rng2) == 3
    got = torch.rand(3, generator=gen2), np_gen2.random(), py_rng2.random()
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]
    with pytest.raises(TypeError, match="cannot be checkpointed"):
        SpotSession(uri, end_step=5).track(thing=object())
