"""The read-only job view: one answer, read from the store, for the operators, the trigger and the UI."""
from __future__ import annotations

import io
import json

import pytest

from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.policy.ledger import LedgerRow, summarize
from airflow_spot.storage.job_view import JobView, progress_line
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import AttemptStatus, Heartbeat, JobLayout, Outcome

T0 = 1_700_000_000.0
OFFER = {
    "instance_type": "g5.xlarge", "region": "us-east-1", "zone": "use1-az1", "market": "spot",
    "price_per_hour": 0.36, "on_demand_price_per_hour": 1.006, "gpu_name": "A10G", "gpu_count": 1,
    "gpu_memory_gib": 24.0, "relative_throughput": 0.9, "preemption_rate_per_hour": 0.2,
}


def row(aid: str, seg: int, start: float, end: float, outcome: str, kept: int, lost: int = 0) -> LedgerRow:
    return LedgerRow(attempt_id=aid, instance_id="i-" + aid, instance_type="g5.xlarge", zone="use1-az1",
                     market="spot", price_per_hour=0.36, on_demand_price_per_hour=1.006, started_at=start,
                     ended_at=end, steps_done=kept, outcome=outcome, segment_index=seg, steps_lost=lost,
                     step_seconds=1.0)


@pytest.fixture
def view(tmp_path) -> JobView:
    store = open_store(f"file://{tmp_path}")
    layout = JobLayout(store)
    ledger = LedgerStore(store)
    for aid, seg, resume, start in (("s0.try1", 0, 0, T0), ("s0.try2", 0, 40, T0 + 100), ("s1.try1", 1, 100, T0 + 200)):
        AttemptLaunch(aid, seg, seg * 100, seg * 100 + 100, "i-" + aid, OFFER, start, start, False, 1, aid[:2],
                      resume_step=resume).write(store)
    ledger.write(row("s0.try1", 0, T0, T0 + 90, "preempted", 40, lost=5))
    ledger.write(row("s0.try2", 0, T0 + 100, T0 + 170, "completed", 60))
    layout.write_status(AttemptStatus("s0.try2", "completed", 0, T0 + 100, T0 + 170, 100))
    layout.write_heartbeat(Heartbeat("s1.try1", step=130, time=T0 + 240, step_time_ewma=1.0))
    cps = layout.checkpoint_store(writer="s1.try1")
    for step in (40, 100, 120):
        cps.save(step, lambda f: f.write(io.BytesIO(b"w" * 2048).getvalue()))
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": T0, "total_steps": 300}).encode())
    return JobView(store)


def test_attempts_merge_launch_ledger_status_and_heartbeat(view):
    attempts = {a.attempt_id: a for a in view.attempts(now=T0 + 250)}
    assert list(attempts) == ["s0.try1", "s0.try2", "s1.try1"]
    first, running = attempts["s0.try1"], attempts["s1.try1"]
    assert first.is_preemption and first.steps_done == 40 and first.steps_lost == 5
    assert running.outcome == "running" and running.current_step == 130 and running.steps_done == 30
    assert running.cost == pytest.approx(50 / 3600 * 0.36)  # billed from its start until now
    assert attempts["s0.try2"].outcome == "completed" and attempts["s0.try2"].ended_at == T0 + 170


def test_a_running_attempt_is_priced_at_its_price_so_far_and_its_ledger_row_supersedes_it(view):
    """The trigger's live price (its market's history so far) prices the running attempt on the page and in
    the snapshot's cost; an ended attempt's ledger row bills the run whatever the live price said."""
    from airflow_spot.storage.protocol import LivePrice

    layout = JobLayout(view.store)
    before = view.snapshot(now=T0 + 250)
    layout.write_live_price(LivePrice("s1.try1", price_per_hour=0.72, through=T0 + 240))
    layout.write_live_price(LivePrice("s0.try2", price_per_hour=9.0, through=T0 + 160))  # its row wins
    attempts = {a.attempt_id: a for a in view.attempts(now=T0 + 250)}
    assert attempts["s1.try1"].price_per_hour == 0.72
    assert attempts["s1.try1"].cost == pytest.approx(50 / 3600 * 0.72)
    assert attempts["s0.try2"].price_per_hour == 0.36
    after = view.snapshot(now=T0 + 250)
    assert after["cost"] == pytest.approx(before["cost"] + 50 / 3600 * (0.72 - 0.36), abs=1e-4)
    view.store.put_bytes(JobLayout.price_key("s1.try1"), b"{not json")  # a torn object: the launch price
    assert view.attempts(now=T0 + 250)[-1].price_per_hour == 0.36


def test_totals_are_the_ledgers_and_counts_filter_by_outcome_segment_and_time(view):
    totals = view.totals(now=T0 + 250)
    assert totals["cost"] == pytest.approx(summarize(view.ledger_rows()).cost, abs=1e-6)
    assert totals["preemptions"] == 1 and totals["attempts"] == 2 and totals["wall_seconds"] == 170
    assert view.count([Outcome.PREEMPTED, Outcome.LOST]) == 1
    assert view.count([Outcome.COMPLETED], segment_index=1) == 0
    assert view.count([Outcome.PREEMPTED], since=T0 + 95) == 0


def test_checkpoint_transfers_are_counted_in_the_cost_and_shown_apart(view):
    from dataclasses import replace

    before = view.snapshot(now=T0 + 250)
    assert before["transfer_dollars"] == 0.0
    second = next(r for r in view.ledger_rows() if r.attempt_id == "s0.try2")
    LedgerStore(view.store).write(replace(second, transfer_dollars=1.25))  # restored from another region
    after = view.snapshot(now=T0 + 250)
    assert after["transfer_dollars"] == pytest.approx(1.25)
    assert after["cost"] == pytest.approx(before["cost"] + 1.25)


def test_snapshot_progress_cost_estimate_and_series(view):
    snap = view.snapshot(now=T0 + 250)
    assert snap["state"] == "running" and snap["total_steps"] == 300
    assert snap["current_step"] == 130 and snap["committed_step"] == 120
    assert snap["progress"] == pytest.approx(130 / 300, abs=1e-4)
    assert snap["cost"] > view.totals(T0 + 250)["cost"]  # the running attempt's cost so far is included
    assert snap["estimate"]["remaining_steps"] == 170 and snap["estimate"]["step_seconds"] == 1.0
    steps = [p["step"] for p in snap["series"]]
    assert steps == sorted(steps) and steps[-1] == 120
    assert snap["series"][1]["step"] == 40  # the preempted attempt's kept steps, though no checkpoint is left
    line = progress_line(snap)
    assert "step 130 of 300 (43.3 %)" in line and "1.00 steps/s" in line and line.endswith(", 1 preemption")


def test_a_job_without_objects_is_not_started(tmp_path):
    snap = JobView(open_store(f"file://{tmp_path}")).snapshot(now=T0)
    assert snap["state"] == "not started" and snap["attempts"] == [] and snap["progress"] is None


def test_an_attempts_pace_past_its_warm_up_comes_from_its_own_checkpoint(tmp_path, monkeypatch):
    # s0.try1 launched at T0, first step (step 1) at T0 + 4; its checkpoint at step 60 was reached at
    # T0 + 7.5 (committed at T0 + 7.7 after a 0.2 s write); its heartbeat says step 160 at T0 + 11.5:
    # steady = 4.0 s / 100 steps = 0.04 s; warm-up = (7.5 - 4) - 59 x 0.04 = 1.14 s beyond that pace
    import types

    from airflow_spot.storage import checkpoint as checkpoint_module

    store = open_store(f"file://{tmp_path}")
    layout = JobLayout(store)
    AttemptLaunch("s0.try1", 0, 0, 300, "i-1", OFFER, T0, T0, False, 1, "s0", resume_step=0).write(store)
    clock = iter([0.0, 0.2])
    monkeypatch.setattr(checkpoint_module, "time", types.SimpleNamespace(
        time=lambda: T0 + 7.7, monotonic=lambda: next(clock)))
    layout.checkpoint_store(writer="s0.try1").save(60, lambda f: f.write(b"w" * 64))
    monkeypatch.undo()
    layout.write_heartbeat(Heartbeat("s0.try1", step=160, time=T0 + 11.5, step_time_ewma=0.09,
                                     first_step_at=T0 + 4.0, first_step=1))
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": T0, "total_steps": 300}).encode())
    view = JobView(store)
    (a,) = view.attempts(now=T0 + 12.0)
    assert a.steady_seconds == pytest.approx(0.04) and a.warmup_seconds == pytest.approx(1.14)
    assert a.steady_steps == 100
    assert a.pace_seconds == pytest.approx(7.5 / 159) and a.pace_steps == 159  # the mean holds the warm-up
    assert a.write_seconds == pytest.approx(0.2)  # what a save on a notice would cost
    # the estimate: 140 steps left at 0.04 s, less the 0.5 s trained since the heartbeat
    est = view.snapshot(now=T0 + 12.0)["estimate"]
    assert est["step_seconds"] == pytest.approx(0.04) and est["mtbf_seconds"] is None  # no pool MTBF known: none
    assert est["compute_seconds"] == pytest.approx(140 * 0.04 - 0.5)
    assert est["overheads"]["tail"] == pytest.approx(0.2)  # no preemption seen: a training attempt's tail is its save


def test_a_checkpoint_inside_the_warm_up_or_too_near_the_heartbeat_is_no_mark():
    from airflow_spot.storage.job_view import _steady_window

    hb = Heartbeat("a", step=100, time=T0 + 10.0, first_step_at=T0 + 4.0, first_step=1)
    assert _steady_window(hb, [(15, T0 + 5.0), (90, T0 + 9.6)])[:2] == (None, None)  # 14 steps in; 10 before the beat
    steady, warmup, _ = _steady_window(hb, [(15, T0 + 5.0), (40, T0 + 7.0), (90, T0 + 9.6)])
    assert steady == pytest.approx(3.0 / 60) and warmup == pytest.approx(3.0 - 39 * 0.05)
    assert _steady_window(Heartbeat("a", step=100, time=T0 + 10.0), [(40, T0 + 7.0)])[:2] == (None, None)  # no first step


def test_a_running_attempt_told_to_go_is_a_preemption_under_way(view):
    layout = JobLayout(view.store)
    layout.write_heartbeat(Heartbeat("s1.try1", step=130, time=T0 + 240, step_time_ewma=1.0, notice_at=T0 + 239))
    running = view.attempts(now=T0 + 241)[-1]
    assert running.outcome == "running" and running.notice_at == T0 + 239
    snap = view.snapshot(now=T0 + 241)
    est = snap["estimate"]
    assert "preemption under way" in est["basis"] and est["current_seconds"] > 0
    # exposure: s0.try1 to its end (no notice recorded, 90 s) + s0.try2 (70 s) + s1.try1 to its notice (39 s);
    # preemptions seen: s0.try1 and the one under way
    assert est["mtbf_seconds"] == pytest.approx((90 + 70 + 39) / 2)


def test_the_estimate_takes_what_the_job_has_not_met_from_the_deployments_earlier_jobs(view, tmp_path):
    from airflow_spot.storage import overhead_history
    from airflow_spot.storage.overhead_history import OverheadHistory, job_name

    now = T0 + 250
    before = view.snapshot(now)["estimate"]
    assert before["overheads"]["last_finish"] == 0.0  # no process exit seen yet: it counted nothing
    measured = view.measured_overheads(now)
    assert "last_finish" not in measured and "gap_after_preemption" in measured
    [uri] = overhead_history.history_uris(view.uri)  # in the tests, the deployment's only (conftest)
    history = OverheadHistory(view.store.at(uri))
    # an earlier run of the same DAG saw its last process exit in 4 s; this job's own entry is not its prior
    history.append("earlier_run", T0 - 3600, {"last_finish": 4.0, "gap_after_preemption": 60.0})
    history.append(job_name(view.uri), T0 - 60, {"last_finish": 100.0})
    after = JobView(view.store).snapshot(now)["estimate"]
    assert after["overheads"]["last_finish"] == 4.0
    assert after["overheads"]["gap_after_preemption"] == before["overheads"]["gap_after_preemption"]  # its own
    assert after["remaining_seconds"] == pytest.approx(before["remaining_seconds"] + 4.0)


def test_an_unreadable_history_leaves_the_estimate_to_the_jobs_own_figures(view, monkeypatch):
    from airflow_spot.storage.overhead_history import ENV_URI

    monkeypatch.setenv(ENV_URI, "ftp://nowhere/overheads")  # not a store this code can open
    assert JobView(view.store).snapshot(T0 + 250)["estimate"]["overheads"]["last_finish"] == 0.0


# ------------------------------------------------------------------ what the UI shows of a damaged store
def test_each_attempt_carries_its_billed_seconds(view):
    """A finished attempt's are its ledger row's (whole seconds, with the minimum on a new instance); a
    running one's are the seconds since it was billed from, what its cost so far is priced over."""
    attempts = {a["attempt_id"]: a for a in view.snapshot(now=T0 + 250)["attempts"]}
    rows = {r.attempt_id: r for r in view.ledger_rows()}
    assert attempts["s0.try1"]["billed_seconds"] == rows["s0.try1"].billed_seconds == 90
    assert attempts["s0.try2"]["billed_seconds"] == rows["s0.try2"].billed_seconds == 70
    running = attempts["s1.try1"]
    assert running["billed_seconds"] == pytest.approx(50)
    assert running["cost"] == pytest.approx(running["billed_seconds"] / 3600 * running["price_per_hour"])


def test_a_malformed_ledger_row_is_left_out_of_the_view_and_named_but_counting_still_refuses_it(view):
    """The page shows what it can read and names the row it cannot; what the operators count against
    their budgets (``count``, ``ledger_rows``, ``totals``) still raises on it rather than counting it as
    no row."""
    good = view.snapshot(now=T0 + 250)
    assert good["unreadable"] == [] and good["broken_checkpoints"] == []
    bad_key = "control/ledger/s1.try0.json"
    view.store.put_bytes(bad_key, b'{"attempt_id": "s1.try0"}')  # a row missing its fields
    with pytest.raises(ValueError, match="s1.try0.json"):
        view.snapshot(now=T0 + 250)  # the strict read, as before
    with pytest.raises(ValueError, match="s1.try0.json"):
        view.count([Outcome.PREEMPTED])
    with pytest.raises(ValueError, match="s1.try0.json"):
        view.totals(now=T0 + 250)
    snap = view.snapshot(now=T0 + 250, skip_unreadable=True)
    assert [u["key"] for u in snap["unreadable"]] == [bad_key]
    assert "not a valid ledger row" in snap["unreadable"][0]["error"]
    # the readable rows' figures, as before the bad row was written
    assert {k: snap[k] for k in ("cost", "preemptions", "steps_lost", "current_step")} == pytest.approx(
        {k: good[k] for k in ("cost", "preemptions", "steps_lost", "current_step")}, abs=1e-4)
    assert [a["attempt_id"] for a in snap["attempts"]] == [a["attempt_id"] for a in good["attempts"]]
    assert [r.attempt_id for r in view.readable_ledger_rows()] == ["s0.try1", "s0.try2"]


def test_a_checkpoint_with_a_truncated_manifest_is_listed_as_broken(view):
    store = view.store.child("checkpoints")
    cps = JobLayout(view.store).checkpoint_store(writer="s1.try1")
    cps.save(200, lambda f: f.write(b"w" * 2048))
    manifest = next(k for k in store.list() if k.startswith("000000000200-") and k.endswith("/MANIFEST.json"))
    store.put_bytes(manifest, store.get_bytes(manifest)[:40])
    snap = view.snapshot(now=T0 + 250)
    assert [c["step"] for c in snap["checkpoints"]] == [40, 100, 120]
    (broken,) = snap["broken_checkpoints"]
    assert broken["step"] == 200 and broken["directory"] == manifest.split("/")[0] and broken["problem"]


@pytest.mark.parametrize("name, body", [
    ("heartbeat.json", {"schema": 1, "attempt_id": "s1.try1"}),  # fields missing
    ("status.json", {"schema": "x", "attempt_id": "s1.try1"}),  # a schema that is no number
    ("price.json", {"schema": 1, "attempt_id": "s1.try1", "price_per_hour": "abc", "through": 1}),
    ("launch.json", {"attempt_id": "s1.try1", "offer": "g5", "billed_from": 1.0}),  # an offer that is no object
    ("launch.json", {"attempt_id": "s1.try1", "offer": {}, "billed_from": "yesterday"}),
])
def test_a_malformed_per_attempt_object_is_named_and_the_rest_of_the_job_shown(view, name, body):
    view.store.put_bytes(f"control/attempts/s1.try1/{name}", json.dumps(body).encode())
    snap = JobView(view.store).snapshot(now=T0 + 250, skip_unreadable=True)
    assert [u["key"] for u in snap["unreadable"]] == [f"control/attempts/s1.try1/{name}"]
    assert {a["attempt_id"] for a in snap["attempts"]} >= {"s0.try1", "s0.try2"}
