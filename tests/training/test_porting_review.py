"""Defects a practitioner porting an existing PyTorch loop to ``airflow_spot.training`` runs into.

Each test fails because of the defect its docstring names and passes once it is fixed. All run in process
on CPU in well under a second each (no subprocess, no timing-dependent periodic saves: saves come from the
segment's end, ``spot.save()`` or an injected notice).
"""
from __future__ import annotations

import os
import re
import time
from collections import Counter

import pytest
import torch
from torch import nn

from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.training import ResumableSampler, SpotSession
from airflow_spot.training.notices import PREEMPTION, FileNotice


@pytest.fixture(autouse=True)
def _no_spot_env(monkeypatch):
    """The sessions here are built by hand: no SPOT_* variable of the surrounding shell may leak in."""
    for name in [k for k in os.environ if k.startswith("SPOT_")]:
        monkeypatch.delenv(name)


def session(job: str, end: int, **kw) -> SpotSession:
    """A session that hears no notice unless given one and never saves periodically."""
    kw.setdefault("notice_sources", [])
    kw.setdefault("min_interval_seconds", 1e9)
    kw.setdefault("max_interval_seconds", 1e9)
    return SpotSession(job, end, heartbeat_seconds=60, **kw)


def checkpoints(job: str) -> CheckpointStore:
    return CheckpointStore(open_store(job).child("checkpoints"))


X = torch.arange(64.0).reshape(16, 4) / 64


def sgd_run(job: str, end: int, *, start: int = 0, save_at: int | None = None, crash_at: int | None = None):
    """A small SGD loop over a shuffled ResumableSampler; optionally ``spot.save()`` at the end of the body of
    step ``save_at`` (the place a ported ``if step % N == 0: save()`` sits) and a crash at ``crash_at``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ResumableSampler(16, seed=1)
    with session(job, end, start_step=start) as spot:
        spot.track(model=model, optimizer=opt, sampler=sampler)
        batches = sampler.batches(4)
        for step in spot.steps():
            idx = torch.tensor(next(batches))
            opt.zero_grad()
            model(X[idx]).pow(2).sum().backward()
            opt.step()
            if step == save_at:
                spot.save()
            if step == crash_at:
                raise RuntimeError(f"crash at step {step}")
    return model


def test_save_inside_the_loop_body_resumes_without_repeating_a_step(tmp_path):
    """``SpotSession.save`` (session.py) labels the checkpoint with ``self.step``, which inside the loop body
    is the index of the step being run, not the number of steps done: ``steps()`` increments it only when
    the body returns. A ported loop that checkpoints at the end of its body (``spot.save()`` after
    ``opt.step()``) commits the state after step 3 labelled "step 3"; a crash or a SIGKILL then resumes at
    step 3 and runs it again with the next batch (the sampler's position and the RNGs were saved after it),
    so the run takes one extra optimizer step and is not bit-exact.

    Expected: a resume from a checkpoint taken with ``save()`` anywhere in the body ends with the same
    weights as an uninterrupted run (e.g. ``save()`` inside the loop commits between steps, at the end of
    the current step, or labels the state with the steps done).
    """
    reference = sgd_run(str(tmp_path / "ref"), 10)
    job = str(tmp_path / "job")
    with pytest.raises(RuntimeError, match="crash at step 5"):
        sgd_run(job, 10, save_at=3, crash_at=5)
    resumed = sgd_run(job, 10)
    assert torch.equal(resumed.weight, reference.weight) and torch.equal(resumed.bias, reference.bias), (
        "the resume from the save() taken in the loop body ran step 3 twice"
    )


def test_save_before_track_does_not_poison_the_store(tmp_path):
    """``SpotSession.save`` (session.py, ``_save`` -> ``_stage``) does not check that anything is tracked,
    as ``steps()`` does. Called before ``track()`` it commits a valid checkpoint holding no objects; the
    ``track()`` that follows restores that checkpoint and ``_apply`` raises ``KeyError: checkpoint has no
    state for tracked object 'model' (saved: [])``. The empty checkpoint verifies, so every later attempt
    of the job fails the same way, with a message that points at the checkpoint rather than the call order.

    Expected: ``save()`` before ``track()`` raises an error saying to call ``spot.track(...)`` first and
    commits nothing, so the job's next ``track()`` works.
    """
    job = str(tmp_path)
    with session(job, 5) as spot:
        try:
            spot.save()
        except Exception as exc:  # noqa: BLE001 - a refusal is the fix; it must name the missing call
            assert "track" in str(exc), exc
        assert spot.track(model=nn.Linear(2, 2)) == 0


def test_a_sampler_refuses_a_checkpoint_saved_with_another_seed():
    """``ResumableSampler.load_state_dict`` (sampler.py) checks only the dataset length: the saved
    ``seed`` (it is in ``state_dict()``) is ignored, so a resumed script whose seed changed (a CLI default
    edited, a seed taken from the attempt) silently continues mid-epoch in a different permutation: some
    items of the epoch are seen twice and others never, and the run is not bit-exact. ``ResumableLoader``
    refuses exactly this ("resuming would feed different batches").

    Expected: a ``ValueError`` that names the seed, as for a changed length.
    """
    saved = ResumableSampler(10, seed=1)
    next(saved.batches(3))
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(10, seed=2).load_state_dict(saved.state_dict())


def test_a_session_used_without_with_still_honours_notices_or_refuses(tmp_path):
    """The notice sources and the heartbeat thread start only in ``SpotSession.__enter__`` (session.py),
    but ``track()`` and ``steps()`` work without it. A ported script written as
    ``spot = SpotSession.from_env(...); spot.track(...); for step in spot.steps(): ...`` trains normally,
    so it looks right when tried by hand, yet it never sees a preemption notice (no emergency save: every
    preemption loses the steps since the last save) and writes no heartbeat while training (the trigger
    then declares a healthy attempt lost after the heartbeat window).

    Expected: ``steps()`` outside the ``with`` block either refuses with an error saying to use
    ``with SpotSession...`` or starts what ``__enter__`` starts, so a notice already issued ends the loop with
    the preempted exit code.
    """
    notice = tmp_path / "notice"
    notice.write_text("spot/instance-action: terminate")
    spot = session(str(tmp_path / "job"), 10, notice_sources=[FileNotice(str(notice), interval=0.01)])
    spot.track(model=nn.Linear(2, 2))
    trained = 0
    try:
        for _ in spot.steps():
            time.sleep(0.03)
            trained += 1
    except SystemExit as exc:
        assert exc.code == 75
        return
    except RuntimeError as exc:
        assert "with" in str(exc), exc
        return
    finally:
        for src in spot.notice_sources:
            src.stop()
        spot.writer.close()
    pytest.fail(f"trained all {trained} steps under a preemption notice that was never heard")


def test_retention_after_a_fallback_keeps_the_checkpoint_it_just_saved(tmp_path):
    """When the newest checkpoint's payload is corrupt, ``track()`` rightly falls back to the previous one.
    But ``AsyncCheckpointer._write`` (async_save.py) then calls ``CheckpointStore.prune(keep)``, which
    ranks committed checkpoints by step and counts the corrupt one (its manifest verifies): with
    ``keep_checkpoints=1`` the first save of the resumed attempt deletes itself and the good checkpoint it
    resumed from, leaving only the corrupt one. The next attempt gets ``NoUsableCheckpointError``
    (the segment fails without retries) and all the job's progress is gone.

    Expected: a save is never pruned by the save that wrote it, nor by a checkpoint the session found
    unusable: after the emergency save at step 5 the store still restores step 5.
    """
    job = str(tmp_path)

    def segment(start: int, end: int, notice_at: int | None = None, keep: int = 3) -> None:
        model = nn.Linear(4, 2)
        with session(job, end, start_step=start, keep=keep) as spot:
            spot.track(model=model)
            for step in spot.steps():
                with torch.no_grad():
                    model.weight.add_(1.0)
                if step == notice_at:
                    spot._on_notice(PREEMPTION, "test notice")

    segment(0, 3)
    segment(3, 6)
    newest = checkpoints(job).committed()[-1]
    payload = tmp_path / "checkpoints" / newest.directory / "state.pt"
    raw = bytearray(payload.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    payload.write_bytes(bytes(raw))

    with pytest.raises(SystemExit) as exc:
        segment(6, 9, notice_at=4, keep=1)  # resumes from step 3, a notice during step 4
    assert exc.value.code == 75
    restored = checkpoints(job).restore_latest(lambda path: None)
    assert restored is not None and restored[0].step == 5


def test_restore_errors_name_the_tracked_object_and_the_checkpoint(tmp_path):
    """``SpotSession._apply`` (session.py) calls each object's ``load_state_dict`` bare. A checkpoint
    from a changed model or optimizer then fails with torch's text alone: for a widened layer "Error(s) in
    loading state_dict for Linear: size mismatch ..."; for an optimizer with a parameter group added
    (unfreezing a backbone) just "loaded state dict has a different number of parameter groups". Neither
    says which tracked object failed, which checkpoint (step) it came from, or what to do about it
    (rebuild the object as it was at that step, or start a new job / warm-start), and the agent's error
    tail is all the DAG author sees.

    Expected: the error names the tracked object (``'model'``, ``'optimizer'``) and the checkpoint's step.
    """
    job = str(tmp_path)
    model, extra = nn.Linear(4, 8), nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    with session(job, 2) as spot:
        spot.track(model=model, optimizer=opt)
        for _ in spot.steps():
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()

    wider = nn.Linear(4, 16)
    with session(job, 4, start_step=2) as spot, pytest.raises(Exception) as exc:
        spot.track(model=wider, optimizer=torch.optim.Adam(wider.parameters()))
    assert re.search(r"'model'", str(exc.value)) and re.search(r"\bstep 2\b", str(exc.value)), str(exc.value)

    same = nn.Linear(4, 8)
    two_groups = torch.optim.Adam([{"params": same.parameters()}, {"params": extra.parameters(), "lr": 1e-4}])
    with session(job, 4, start_step=2) as spot, pytest.raises(Exception) as exc:
        spot.track(model=same, optimizer=two_groups)
    assert re.search(r"'optimizer'", str(exc.value)) and re.search(r"\bstep 2\b", str(exc.value)), str(exc.value)


class Tally:
    """Plain python state a script keeps beside the model (label counts for a class-balanced loss)."""

    def __init__(self) -> None:
        self.labels: Counter[str] = Counter()

    def state_dict(self) -> dict:
        return {"labels": self.labels}

    def load_state_dict(self, state: dict) -> None:
        self.labels = state["labels"]


def test_dict_subclasses_in_state_survive_staging(tmp_path):
    """``Stager._stage`` (state.py) rebuilds every dict as ``type(obj)(staged items)``. For a dict subclass
    whose constructor does not take (key, value) pairs this is wrong: a ``collections.Counter`` becomes a
    count of the pairs (``Counter({'cat': 3})`` is restored as ``Counter({('cat', 3): 1})``), a
    ``defaultdict`` raises ``TypeError`` at ``track()``, and a module's ``state_dict()`` (an ``OrderedDict``)
    loses its ``_metadata`` attribute, so ``load_state_dict`` sees every module as version ``None`` and
    runs its legacy migration: a quantization observer's ``eps`` buffer (a QAT run) is reset to the
    float32 default on every resume.

    Expected: a tracked object's state comes back equal to what was saved, ``_metadata`` included (e.g.
    stage into a copy of the dict, ``copy.copy(obj)`` then fill it, keeping its attributes).
    """
    from torch.ao.quantization.observer import MinMaxObserver

    class Observed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.obs = MinMaxObserver(eps=1e-3)

    job = str(tmp_path)
    tally, model = Tally(), Observed()
    with session(job, 2) as spot:
        spot.track(model=model, tally=tally)
        for _ in spot.steps():
            tally.labels.update(["cat", "cat", "dog"])
            model.obs(torch.randn(8))

    tally2, model2 = Tally(), Observed()
    with session(job, 3, start_step=2) as spot:
        assert spot.track(model=model2, tally=tally2) == 2
    assert tally2.labels == Counter({"cat": 4, "dog": 2})
    assert torch.equal(model2.obs.eps, model.obs.eps), "the observer's eps was reset by the resume"


def test_track_during_training_does_not_roll_the_live_state_back(tmp_path):
    """``SpotSession.track`` (session.py) restores the newest checkpoint into *every* tracked object each
    time it is called. Called once the loop runs (registering an object created mid-run: a second
    optimizer or a param group when a backbone is unfrozen, an EMA model when averaging starts), it
    overwrites the live model with the last checkpoint's weights; here the new object is not in that
    checkpoint, so it then raises ``KeyError: checkpoint has no state for tracked object 'head'`` with the
    model already rolled back. On a fresh job (no checkpoint yet) the same call works, so the script passes
    a trial run and breaks at the first resume.

    Expected: ``track()`` after ``steps()`` began never touches the live state: it either registers the new
    object (saved from then on) or refuses with an error saying to track everything before ``steps()``.
    """
    job = str(tmp_path)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step() -> None:
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()

    with session(job, 3) as spot:
        spot.track(model=model, optimizer=opt)
        for _ in spot.steps():
            train_step()

    with session(job, 8, start_step=3) as spot:
        spot.track(model=model, optimizer=opt)
        for step in spot.steps():
            train_step()
            if step == 5:
                live = model.weight.detach().clone()
                error = None
                try:
                    spot.track(head=nn.Linear(2, 2))
                except Exception as exc:  # noqa: BLE001 - a clear refusal is one acceptable fix
                    error = exc
                assert torch.equal(model.weight, live), "track() rolled the live model back to step 3"
                if error is not None:
                    assert "steps()" in str(error), error
                break
