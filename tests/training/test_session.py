"""SpotSession behaviour inside one process: saves, intervals, insurance, emergency exit, heartbeats."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from airflow_spot.policy.checkpoint_interval import daly_interval
from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import PREEMPTED_EXIT_CODE, AttemptStatus, JobLayout
from airflow_spot.training import ResumableSampler, SpotSession
from airflow_spot.training.async_save import AsyncCheckpointer
from airflow_spot.training.notices import REBALANCE, FileNotice


def make(job, **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("notice_sources", [])
    spot = SpotSession(job, kw.pop("end", 10), heartbeat_seconds=0.02, **kw)
    return spot, model, opt


def train(spot, model, opt, on_step=None):
    for step in spot.steps():
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        spot.report(loss=float(step))
        if on_step:
            on_step(step)


def ckpts(job):
    return CheckpointStore(open_store(job).child("checkpoints"))


def test_segment_end_commits_and_next_segment_resumes(tmp_path):
    job = str(tmp_path)
    spot, model, opt = make(job, end=5, min_interval_seconds=1000)
    started = time.time()
    with spot:
        assert spot.track(model=model, optimizer=opt) == 0
        train(spot, model, opt)
    assert ckpts(job).latest_step() == 5
    assert ckpts(job).committed()[-1].meta["reason"] == "final"
    hb = JobLayout(open_store(job)).read_heartbeat("manual")
    assert hb.step == 5 and hb.last_committed_step == 5 and hb.metrics == {"loss": 4.0}
    assert hb.step_time_ewma is not None and hb.step_time_ewma > 0
    # the attempt's start-up ends at its first step (resumed from 0: step 1), before its last heartbeat
    assert hb.first_step == 1 and started <= hb.first_step_at <= hb.time

    spot2, model2, opt2 = make(job, start_step=5, end=8)
    with spot2:
        assert spot2.track(model=model2, optimizer=opt2) == 5
        assert torch.equal(model2.weight, model.weight)
        seen = []
        train(spot2, model2, opt2, seen.append)
    assert seen == [5, 6, 7]


def exit_code_after_a_notice_at_7(job, save_at: int | None = None) -> int | str | None:
    """Train until a preemption notice at step 7 ends the process; its exit code."""
    spot, model, opt = make(job, end=100, min_interval_seconds=1000)

    def on_step(step):
        if step == save_at:
            spot.save()
        if step == 7:
            spot._on_notice("preemption", "test")

    with pytest.raises(SystemExit) as exc:
        with spot:
            spot.track(model=model, optimizer=opt)
            train(spot, model, opt, on_step)
    return exc.value.code


def test_emergency_save_on_notice_exits_with_preempted_code(tmp_path):
    job = str(tmp_path)
    assert exit_code_after_a_notice_at_7(job) == PREEMPTED_EXIT_CODE
    m = ckpts(job).committed()[-1]
    assert (m.step, m.meta["reason"]) == (8, "emergency")  # step 7 finished, nothing lost


def test_an_emergency_save_the_store_refuses_still_exits_as_a_preemption(tmp_path, monkeypatch):
    """The instance is going either way: a failed emergency save (a 503 from the store) must not make the
    attempt the user's failure (the code-retry budget, retry_delay); the committed checkpoints stand."""
    from airflow_spot.storage import checkpoint as C

    job = str(tmp_path)
    real_save = C.CheckpointStore.save

    def save(self, step, write, meta=None):
        if (meta or {}).get("reason") == "emergency":
            raise C.CheckpointSaveError("cannot save the checkpoint: SlowDown (503)")
        return real_save(self, step, write, meta)

    monkeypatch.setattr(C.CheckpointStore, "save", save)
    assert exit_code_after_a_notice_at_7(job, save_at=3) == PREEMPTED_EXIT_CODE
    assert ckpts(job).latest_step() == 4  # the save in step 3 (after it: 4 steps done) stands; nothing newer


def test_periodic_saves_follow_the_interval_and_insurance_on_rebalance(tmp_path):
    job = str(tmp_path)
    spot, model, opt = make(job, end=60, min_interval_seconds=0.05, max_interval_seconds=0.05)

    def slow(step):
        time.sleep(0.01)
        if step == 30:
            spot._on_notice(REBALANCE, "rebalance")

    with spot:
        spot.track(model=model, optimizer=opt)
        train(spot, model, opt, slow)
    assert spot.saves["periodic"] >= 3
    assert spot.saves["insurance"] == 1
    assert spot.interval == pytest.approx(0.05)


def test_interval_follows_measured_save_cost_observed_preemptions_and_the_notices_they_showed(tmp_path):
    from airflow_spot.policy.ledger import LedgerRow
    from airflow_spot.storage.ledger_store import LedgerStore

    job = str(tmp_path)
    layout = JobLayout(open_store(job))
    for i in range(3):  # this job was preempted three times in 300 s; every time without a notice, losing steps
        layout.write_status(AttemptStatus(f"t{i}", "preempted", 75, started_at=0.0, ended_at=100.0))
        LedgerStore(open_store(job)).write(LedgerRow(
            attempt_id=f"t{i}", instance_id="i", instance_type="t", zone="z", market="spot", price_per_hour=1.0,
            on_demand_price_per_hour=3.0, started_at=0.0, ended_at=100.0, steps_done=20, outcome="preempted",
            steps_lost=5, notice_at=None))
    spot, model, opt = make(job, end=3, mtbf_seconds=3600.0, min_interval_seconds=0.0, notice_window_seconds=120.0,
                            notice_sources=[FileNotice(str(tmp_path / "notice"))])
    with spot:
        assert spot.mtbf == pytest.approx((3600 + 300) / 4)
        assert spot.notice_evidence == (0, 3)
        spot.track(model=model, optimizer=opt)
        spot.save_cost_ewma = 2.0
        spot._recompute_interval()
        # three misses against a prior worth five preemptions at 0.99: the notices are no longer trusted much
        assert spot.notice_coverage == pytest.approx(5 * 0.99 / 8)
        assert spot.interval == pytest.approx(daly_interval(2.0, spot.mtbf / (1 - spot.notice_coverage)))
        # an emergency save slower than the notice window covers nothing: plain Daly on every preemption
        spot.save_cost_ewma = 200.0
        spot._recompute_interval()
        assert spot.notice_coverage == 0.0
        assert spot.interval == pytest.approx(daly_interval(200.0, spot.mtbf))
        # the window counts from the notice, and the file source sees it up to one poll (0.1 s) late
        spot.save_cost_ewma = 119.85 - spot.writer.last_write_seconds
        spot._recompute_interval()
        assert spot.notice_coverage > 0.5
        spot.save_cost_ewma = 119.95 - spot.writer.last_write_seconds
        spot._recompute_interval()
        assert spot.notice_coverage == 0.0


def test_a_job_that_trusts_its_notices_saves_periodically_about_ten_times_less_often(tmp_path):
    # no preemption seen yet: the prior (0.99) trusts the notice, so only 1 % of preemptions would lose
    # work, and Daly's interval over that rate is about sqrt(100) = 10 times the plain one
    spot, model, opt = make(str(tmp_path), end=3, mtbf_seconds=3600.0, min_interval_seconds=0.0,
                            notice_sources=[FileNotice(str(tmp_path / "notice"))])
    with spot:
        spot.track(model=model, optimizer=opt)
        spot.save_cost_ewma = 2.0
        spot._recompute_interval()
        assert spot.notice_coverage == pytest.approx(0.99)
        assert spot.interval == pytest.approx(daly_interval(2.0, 3600.0 / 0.01))
        assert spot.interval > 9 * daly_interval(2.0, 3600.0)
    # a session that hears no notice at all has no emergency save to count on: plain Daly
    deaf, model, opt = make(str(tmp_path / "deaf"), end=3, mtbf_seconds=3600.0, min_interval_seconds=0.0)
    with deaf:
        deaf.track(model=model, optimizer=opt)
        deaf.save_cost_ewma = 2.0
        deaf._recompute_interval()
        assert deaf.notice_coverage == 0.0 and deaf.interval == pytest.approx(daly_interval(2.0, 3600.0))


def test_corrupt_newest_checkpoint_is_skipped_on_resume(tmp_path):
    job = str(tmp_path)
    spot, model, opt = make(job, end=3, min_interval_seconds=1000)
    with spot:
        spot.track(model=model, optimizer=opt)
        train(spot, model, opt)
    w3 = model.weight.detach().clone()
    spot, model, opt = make(job, start_step=3, end=6, min_interval_seconds=1000)
    with spot:
        spot.track(model=model, optimizer=opt)
        train(spot, model, opt)
    newest = ckpts(job).committed()[-1]
    path = tmp_path / "checkpoints" / newest.directory / "state.pt"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    spot, model, opt = make(job, start_step=6, end=9)
    with spot:
        assert spot.track(model=model, optimizer=opt) == 3
        assert torch.equal(model.weight, w3)


def test_warm_start_takes_only_the_model(tmp_path):
    prev = str(tmp_path / "prev")
    spot, model, opt = make(prev, end=4, min_interval_seconds=1000)
    with spot:
        spot.track(model=model, optimizer=opt)
        train(spot, model, opt)
    spot2, model2, opt2 = make(str(tmp_path / "new"), end=2, warm_start_uri=prev)
    with spot2:
        assert spot2.track(model=model2, optimizer=opt2) == 0
        assert torch.equal(model2.weight, model.weight)
        assert opt2.state_dict()["state"] == {}


def test_track_rejects_objects_without_state(tmp_path):
    spot, model, opt = make(str(tmp_path))
    with pytest.raises(TypeError, match="no state_dict"):
        spot.track(model=model, thing=object())
    with pytest.raises(ValueError, match="start_step < end_step"):
        SpotSession(str(tmp_path), 0)


def test_sampler_resumes_mid_epoch():
    a = ResumableSampler(10, seed=3)
    it = a.batches(4)
    first = [next(it) for _ in range(4)]  # crosses an epoch boundary
    b = ResumableSampler(10, seed=3)
    b.load_state_dict(a.state_dict())
    assert next(b.batches(4)) == next(it)
    assert sorted(sum(first[:2], []) + first[2][:2]) == list(range(10))
    with pytest.raises(ValueError, match="dataset of 10 items"):
        ResumableSampler(11).load_state_dict(a.state_dict())


def test_async_checkpointer_keeps_one_write_in_flight(tmp_path):
    release = threading.Event()
    started = threading.Event()

    def slow_serialize(obj, f):
        started.set()
        release.wait(5)
        f.write(obj)

    writer = AsyncCheckpointer(ckpts(str(tmp_path)), slow_serialize, keep=2)
    assert writer.save_async(1, b"one")
    started.wait(5)
    assert writer.busy and not writer.save_async(2, b"two")  # coalesced, not queued
    release.set()
    writer.wait(5)
    assert writer.last_committed_step == 1
    assert writer.save_sync(3, b"three").step == 3
    writer.close()
    assert [m.step for m in ckpts(str(tmp_path)).committed()] == [1, 3]


def test_from_env_reads_the_notice_window_and_names_a_bad_number(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOT_END_STEP", "5")
    monkeypatch.setenv("SPOT_NOTICE_WINDOW_SECONDS", "30")
    assert SpotSession.from_env(job_uri=str(tmp_path)).notice_window == 30.0
    monkeypatch.setenv("SPOT_NOTICE_WINDOW_SECONDS", "two minutes")
    with pytest.raises(ValueError, match="SPOT_NOTICE_WINDOW_SECONDS='two minutes' is not a number of seconds"):
        SpotSession.from_env(job_uri=str(tmp_path))


@pytest.mark.parametrize("total_steps", [0, -3, 2.5])
def test_from_env_by_hand_names_a_bad_total_steps(tmp_path, monkeypatch, total_steps):
    monkeypatch.delenv("SPOT_END_STEP", raising=False)
    with pytest.raises(ValueError, match="total_steps must be a positive number of training steps"):
        SpotSession.from_env(total_steps=total_steps, job_uri=str(tmp_path))
