"""The figures the Spot Training page, its JSON and the list show (a review, 2026-11-27): each test in the
first part failed on the code it was written against and names the mechanism; the tests in the second part
(marked) pin down behaviour that was checked and found right."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from test_job_figures_agree import running_job
from test_job_rows import OFFER, T0, finished_job, ref

from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.storage.job_view import JobView
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import AttemptStatus, Heartbeat, JobLayout
from airflow_spot.ui import app as ui_app
from airflow_spot.ui import page
from airflow_spot.ui.app import job_detail
from airflow_spot.ui.jobs import job_row

AID = "train.segment_000.try1"


@pytest.fixture
def clock(monkeypatch):
    """``job_detail`` reads ``time.time()``; the fixtures' jobs live at ``T0`` (2027): set the page's now."""
    now = {"t": T0 + 600}
    monkeypatch.setattr(ui_app, "time", SimpleNamespace(time=lambda: now["t"]))
    return now


def render(detail: dict) -> str:
    return page.job_page(detail["dag_id"], detail["run_id"], detail, detail["offers"], detail["offers_note"],
                         detail.get("ranking"))


def card(html: str, name: str) -> str:
    """The text of the page's card ``name`` (``card-<first word of its label>``)."""
    m = re.search(rf'id="card-{name}"><span class=muted>[^<]*</span><b>(.*?)</b></div>', html)
    assert m, f"no card {name}"
    return m.group(1)


def row(aid: str, outcome: str, start: float, end: float, kept: int, lost: int = 0, seg: int = 0,
        market: str = "spot", price: float = 0.2) -> LedgerRow:
    return LedgerRow(attempt_id=aid, instance_id=f"i-{aid[-4:]}", instance_type="g4dn.xlarge", zone="us-east-1a",
                     market=market, price_per_hour=price, on_demand_price_per_hour=0.526, started_at=start,
                     ended_at=end, steps_done=kept, outcome=outcome, segment_index=seg, steps_lost=lost,
                     step_seconds=5.0)


# ====================================================================== defects (each fails on the code reviewed)

# ------------------------------------------------------------------ 1. a cleared run shows its old summary
def test_a_cleared_run_that_trains_again_is_not_shown_with_its_old_summary(tmp_path, clock):
    """A job whose run failed short of the last step (the finish task wrote ``control/summary.json`` with
    ``completed: false``) is cleared by its user and trains on: a new attempt resumes from step 150 and is
    at step 180. Nothing removes or supersedes the old summary, and ``JobView.snapshot``
    (``JobView.snapshot``) takes any summary in the store as the job's final account:
    ``state = finished_state(summary)`` ("incomplete") and ``**final_figures(summary)`` over cost,
    on-demand cost, savings, progress and preemptions. ``app._state`` (``ui/app.py:78-82``) keeps that
    store state while the run is running. So the page and the list (whose newest XCom is now the new
    attempt's link, so it reads the store, as ``tests/ui/test_ui_api.py`` intends for a cleared run) show
    the running job as "incomplete",
    frozen at the old summary's cost and progress (150 of 200), and the page stops reloading itself (it
    reloads only a running or waiting job)."""
    uri, summary = finished_job(tmp_path / "job", last_step=150)
    assert summary["completed"] is False
    store = open_store(uri)
    again = "train.segment_001.try2"
    AttemptLaunch(again, 1, 100, 200, "i-new", OFFER, T0 + 5000, T0 + 5000, False, 2, "train.segment_001",
                  resume_step=150, run_id="r").write(store)
    JobLayout(store).write_heartbeat(Heartbeat(again, step=180, time=T0 + 5400, step_time_ewma=5.0,
                                               last_committed_step=150))
    clock["t"] = T0 + 5410
    detail = job_detail(ref(uri, None, run_state="running"))
    listed = job_row(ref(uri, None, run_state="running"), now=T0 + 5410)
    running_cost = 410 / 3600 * 0.2
    assert (detail["state"], listed["state"]) == ("running", "running"), (
        f"a running re-run shows as {detail['state']!r} on its page and {listed['state']!r} in the list")
    assert detail["current_step"] == 180, f"the page shows step {detail['current_step']}: the old summary's"
    assert detail["cost"] == pytest.approx(summary["cost"] + running_cost, abs=1e-5), (
        f"the page shows step {detail['current_step']} and cost {detail['cost']}: the old summary's")
    assert 'http-equiv="refresh"' in render(detail)


# ------------------------------------------------------------------ 2. savings dip when an attempt ends
def test_the_on_demand_cost_of_the_work_does_not_vanish_when_an_attempt_ends_before_its_ledger_row(tmp_path):
    """While an attempt runs, ``JobView.snapshot`` credits its steps so far at its on-demand price
    (``live_on_demand``, ``JobView.snapshot``: running attempts only). When it ends, its agent
    writes its status; its ledger row lands at the trigger's next poll, or, for a killed task, at the
    finish task. In between, its cost is still counted (``live_cost`` takes every attempt without a row,
    priced to its end: the mend of an earlier review) but its on-demand credit is not: a completed
    segment's 100 steps go from $0.073 of on-demand work to $0, and the card reads "savings $-0.0444
    (0.0 %)" where a moment before it read "$0.0289 (39.5 %)" and a moment after "$0.0724 (62.0 %)". An
    ended attempt without a row should be credited as its row will credit it (a completed one its whole
    billed time, another its kept steps)."""
    uri, layout = running_job(tmp_path / "job", AID)
    view = JobView(layout.store)
    layout.write_heartbeat(Heartbeat(AID, step=100, time=T0 + 790, step_time_ewma=5.0, last_committed_step=100))
    before = view.snapshot(T0 + 795)
    layout.write_status(AttemptStatus(AID, "completed", 0, T0, T0 + 800, last_committed_step=100, instance_id="i-a"))
    between = view.snapshot(T0 + 805)
    LedgerStore(layout.store).write(row(AID, "completed", T0, T0 + 800, 100))
    after = view.snapshot(T0 + 810)
    assert before["savings"] > 0 and after["savings"] > 0
    assert between["on_demand_cost"] >= before["on_demand_cost"] and between["savings"] > 0, (
        f"savings {before['savings']} -> {between['savings']} -> {after['savings']}; on-demand cost "
        f"{before['on_demand_cost']} -> {between['on_demand_cost']} -> {after['on_demand_cost']}")


# ------------------------------------------------------------------ 3. an on-demand job "loses" against on-demand
def test_a_running_on_demand_attempt_shows_no_loss_against_on_demand(tmp_path):
    """An on-demand-only job (or a deadline's on-demand attempt) while it runs: ``live_on_demand``
    (``JobView.snapshot``) credits a running attempt only ``steps so far x step-time EWMA`` at
    the on-demand price, while its cost so far is its whole time since launch (boot, restore, start-up).
    The page then says an on-demand instance ran 140 % dearer than an on-demand instance: "savings
    $-0.0411 (-140.5 %)", for the whole of the attempt, until its ledger row lands and the figure jumps to
    $0.0000 (0.0 %) (a completed attempt is credited its whole bill). Savings are defined (README) as what
    an on-demand instance of the same type pays for the same work, less what was paid: for an attempt that
    is that on-demand instance, nothing. A running attempt should be credited as a completed one is, its
    billed time so far (or at least an on-demand one its cost)."""
    od = {**OFFER, "market": "on-demand", "zone": "us-east-1", "price_per_hour": 0.526,
          "preemption_rate_per_hour": 0.0}
    store = open_store(f"file://{tmp_path}/job")
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": T0, "total_steps": 200}).encode())
    AttemptLaunch(AID, 0, 0, 100, "i-od", od, T0, T0, False, 1, "train.segment_000", resume_step=0,
                  run_id="r").write(store)
    JobLayout(store).write_heartbeat(Heartbeat(AID, step=40, time=T0 + 480, step_time_ewma=5.0,
                                               last_committed_step=None, first_step_at=T0 + 280, first_step=1))
    snap = JobView(store).snapshot(T0 + 481)
    assert snap["cost"] == pytest.approx(481 / 3600 * 0.526, abs=1e-6)
    html = page.job_page("dag", "r", snap, [])
    assert snap["savings"] == pytest.approx(0.0, abs=1e-6), f"savings card: {card(html, 'savings')}"


# ------------------------------------------------------------------ 4. a failed run shows what remains
def test_a_failed_run_does_not_show_a_remaining_time_and_cost(tmp_path, clock):
    """A run that failed short of its last step (retries spent; the finish task wrote an ``incomplete``
    summary, Airflow says ``failed``): nothing runs and nothing will until someone clears it. The page's
    remaining-time and remaining-cost cards (``ui/page.py:277-280``) show the estimate for every state but
    ``finished``, and ``JobView.snapshot`` computes it for any job with a total: the failed job's page reads
    "remaining time 4m 31s ± 41s", "remaining cost $0.0151", as if the job were on its way (and, not
    reloading, it never changes). A job that is not running or waiting should say it is stopped, not give an
    ETA."""
    uri, summary = finished_job(tmp_path / "job", last_step=150)
    clock["t"] = T0 + 3000
    detail = job_detail(ref(uri, summary, run_state="failed"))
    assert detail["state"] == "failed"
    est = detail["estimate"] or {}
    html = render(detail)
    shown = (card(html, "remaining"), re.findall(r'id="card-remaining">.*?<b>(.*?)</b>', html)[1])
    assert est.get("remaining_seconds") is None or page._duration(est["remaining_seconds"]) not in shown[0], (
        f"a failed run's page shows remaining time {shown[0]!r} and remaining cost {shown[1]!r}")
    assert est.get("remaining_cost") is None or shown[1] != page._money(est["remaining_cost"]), shown


# ------------------------------------------------------------------ 5. one bad field takes the whole job down
@pytest.mark.parametrize("key, body", [
    (f"control/attempts/{AID}/heartbeat.json",
     {"schema": 1, "attempt_id": AID, "step": None, "time": T0 + 480}),  # a null step
    (f"control/attempts/{AID}/heartbeat.json",
     {"schema": 1, "attempt_id": AID, "step": 40, "time": T0 + 480, "step_time_ewma": "5.0"}),
    (f"control/attempts/{AID}/status.json",
     {"schema": 1, "attempt_id": AID, "outcome": "preempted", "exit_code": 75, "started_at": T0, "ended_at": "soon"}),
    (f"control/attempts/{AID}/launch.json",
     {"attempt_id": AID, "segment_index": 0, "resume_step": 0, "end_step": 100, "billed_from": T0,
      "offer": {**OFFER, "price_per_hour": "0.2"}}),  # a price that is no number
])
def test_an_object_with_a_field_of_the_wrong_type_is_named_not_the_whole_store(tmp_path, clock, key, body):
    """README: "An object of the job that cannot be read (a torn ledger row, launch record or heartbeat) is
    left out of the page and named on it". ``_Record.from_json`` (``storage/protocol.py``) checks a
    record's schema and that its fields are present, not their types, and ``_malformed_launch``
    (``storage/attempt_view.py``, ``_malformed_launch``) checks some of a launch record's numbers but not its offer's prices. A
    heartbeat whose ``step`` is null or whose step time is a string, a status whose ``ended_at`` is not a
    number, a launch whose price is a string, all decode, then raise ``TypeError`` in
    ``JobView.attempts`` (``storage/job_view.py``); ``job_detail`` catches it as a store it could
    not read at all: the running job's page loses every figure, attempt and checkpoint, and says "store not
    readable: TypeError: unsupported operand type(s) for -: 'NoneType' and 'int'", naming the store, not
    the object. The object should be left out and named, as a torn one is."""
    uri, layout = running_job(tmp_path / "job", AID)
    layout.store.put_bytes(key, json.dumps(body).encode())
    detail = job_detail(ref(uri, run_state="running"))
    assert [u["key"] for u in detail["unreadable"]] == [key], detail["unreadable"]
    assert detail["cost"] is not None


# ------------------------------------------------------------------ 6. a loss shown as "0.0 %"
def test_a_loss_with_no_work_to_credit_is_not_shown_as_zero_percent(tmp_path):
    """A job whose first attempt was preempted before it kept a step (common: a preemption in the
    start-up) and that waits for its next: cost $0.0222, on-demand cost of the work kept $0, savings
    $-0.0222. ``money_figures`` (``storage/job_figures.py``) makes the fraction ``0.0`` when the on-demand
    cost is 0, and the card (``ui/page.py:274``, ``savings_fraction or 0``) shows "savings $-0.0222
    (0.0 %)": a loss next to a percentage that says nothing was lost. With no on-demand cost to compare
    with, the fraction is not a number: the card should say so ("–"), not 0.0 %."""
    store = open_store(f"file://{tmp_path}/job")
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": T0, "total_steps": 200}).encode())
    AttemptLaunch(AID, 0, 0, 100, "i-a", OFFER, T0, T0, False, 1, "train.segment_000", resume_step=0,
                  run_id="r").write(store)
    LedgerStore(store).write(row(AID, "preempted", T0, T0 + 400, 0, lost=10))
    snap = JobView(store).snapshot(T0 + 450)
    assert snap["on_demand_cost"] == 0 and snap["savings"] < 0
    shown = card(page.job_page("dag", "r", snap, []), "savings")
    assert "(0.0 %)" not in shown, f"savings card: {shown}"


# ====================================================================== checked and found right (these pass)

def test_pinned_finished_job_figures_agree_with_its_ledger_and_its_cards_say_done(tmp_path, clock):
    """PASSING (checked): a finished job's headline, list row and JSON are the summary's, which are the
    ledger's totals (cost, on-demand cost with the restarted segment credited only its kept steps,
    preemptions); its remaining cards say done / $0."""
    uri, summary = finished_job(tmp_path / "job")
    clock["t"] = T0 + 3000
    detail = job_detail(ref(uri, summary))
    ledger = JobView(open_store(uri)).totals(T0 + 3000)
    assert detail["state"] == "finished" and detail["progress"] == 1.0
    assert detail["cost"] == pytest.approx(ledger["cost"], abs=1e-6) == pytest.approx(1180 / 3600 * 0.2, abs=1e-6)
    # segment 0's try2 restarted after a preemption: credited its 40 kept steps (200 s), not its 280 s
    credited = (60 * 5.0 + 40 * 5.0 + 500) / 3600 * 0.526
    assert detail["on_demand_cost"] == pytest.approx(credited, abs=1e-6)
    assert detail["preemptions"] == ledger["preemptions"] == 1
    html = render(detail)
    assert card(html, "remaining") == "done" and "$0" in html


def test_pinned_a_lost_attempt_counts_as_a_preemption_everywhere_and_an_abandoned_one_nowhere(tmp_path):
    """PASSING (checked): ``lost`` is a preemption in the ledger's totals, the snapshot and the list alike;
    ``abandoned`` is none."""
    store = open_store(f"file://{tmp_path}/job")
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": T0, "total_steps": 200}).encode())
    rows = [row("train.segment_000.try1", "lost", T0, T0 + 300, 20, lost=5),
            row("train.segment_000.try2", "abandoned", T0 + 320, T0 + 600, 30, lost=2),
            row("train.segment_000.try3", "completed", T0 + 620, T0 + 900, 50)]
    for r in rows:
        AttemptLaunch(r.attempt_id, 0, 0, 100, r.instance_id, OFFER, r.started_at, r.started_at, False, 1,
                      "train.segment_000", resume_step=0, run_id="r").write(store)
        LedgerStore(store).write(r)
    snap = JobView(store).snapshot(T0 + 1000)
    listed = job_row(ref(f"file://{tmp_path}/job", run_state="running"), now=T0 + 1000)
    assert snap["preemptions"] == JobView(store).totals(T0 + 1000)["preemptions"] == listed["preemptions"] == 1
    assert [a["preemption"] for a in snap["attempts"]] == [True, False, False]


def test_pinned_the_estimate_is_zero_not_negative_once_every_step_is_done(tmp_path):
    """PASSING (checked): a job past its last step, before its finish task, has nothing left (0 s, $0), not
    a negative or NaN figure."""
    uri, layout = running_job(tmp_path / "job", AID)
    layout.write_heartbeat(Heartbeat(AID, step=200, time=T0 + 1480, step_time_ewma=5.0, last_committed_step=200))
    est = JobView(layout.store).snapshot(T0 + 1481)["estimate"]
    assert (est["remaining_steps"], est["remaining_seconds"], est["remaining_cost"]) == (0, 0.0, 0.0)
