"""The figures one job shows agree (a review, 2026-11-27): the ledger's totals, ``JobView.snapshot``, the
finish task's summary, the page and its JSON, the demo's printout. Each test failed on the code it was
written against and names the mechanism."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from test_job_rows import OFFER, T0, finished_job, ref

from airflow_spot.operators import accounting
from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.storage.job_view import JobView
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import AttemptStatus, Heartbeat, JobLayout
from airflow_spot.ui.app import job_detail
from airflow_spot.ui.jobs import ROW_FIELDS, job_row


def running_job(root, attempt_id: str = "train.segment_000.try1", instance_id: str = "i-a") -> tuple[str, JobLayout]:
    """A 200-step job whose first attempt was launched at T0 on a fresh spot instance at $0.2/h and trained
    to step 40 (its last heartbeat at T0 + 480); nothing billed yet, no summary."""
    uri = f"file://{root}"
    store = open_store(uri)
    store.put_bytes(JobLayout.JOB_KEY, json.dumps({"started_at": T0, "total_steps": 200}).encode())
    AttemptLaunch(attempt_id, 0, 0, 100, instance_id, OFFER, T0, T0, False, 1, "train.segment_000",
                  resume_step=0, run_id="r").write(store)
    layout = JobLayout(store)
    layout.write_heartbeat(Heartbeat(attempt_id, step=40, time=T0 + 480, step_time_ewma=5.0,
                                     last_committed_step=None))
    return uri, layout


# ------------------------------------------------------------------ 1. reap's bills after the summary
def test_the_jobs_page_cost_holds_what_reap_billed_after_the_summary(tmp_path):
    """``airflow-spot reap`` (``commands/reap.py`` ``JobBilling``) bills "the reaped instances' time in their
    jobs' cost": an attempt nobody accounted for on a reaped instance as ``abandoned``, a live warm instance's
    time after its last attempt as idle. It runs on finished DAG runs, i.e. after the finish task wrote the
    job's summary, and never touches that summary. The page's headline of a finished job is the summary's
    (``JobView.snapshot`` spreads ``final_figures(summary)`` over the store's figures), but
    ``idle_dollars``, ``probe_dollars`` and the attempts table come from the store: the cost card then reads
    "cost $0.0656 of which warm instances idle $0.0667", the idle dollars not being in the cost, and the
    attempts table lists an abandoned attempt whose cost is in no headline figure. Reap's bills never reach
    the job's cost on the page. The page's cost should be the ledger's total, and its "of which" parts and
    its attempts should add up to it."""
    uri, summary = finished_job(tmp_path / "job")
    store = open_store(uri)
    # an attempt the finish task's listing missed (launched as it ran), and the last segment's warm instance
    late = "train.segment_001.try2"
    AttemptLaunch(late, 1, 100, 200, "i-late", OFFER, T0 + 1900, T0 + 1900, False, 2, "train.segment_001",
                  resume_step=200, run_id="r").write(store)
    from airflow_spot.commands.reap import JobBilling

    hook = SimpleNamespace(get_store=open_store, get_market=lambda: None)
    instances = [SimpleNamespace(instance_id=i, job_uri=uri) for i in ("i-late", "i-try1")]
    billing = JobBilling(hook)
    at = T0 + 2400
    billing.before_terminate(instances, at)
    lines = billing.after_terminate(instances, set(), at)
    assert lines and "1 attempt(s)" in lines[0]
    ledger = JobView(store).totals(T0 + 3000)
    assert ledger["abandoned"] == 1 and ledger["idle_dollars"] > 0
    assert ledger["cost"] > summary["cost"] + ledger["idle_dollars"] - 1e-9  # reap billed more than the summary

    detail = job_detail(ref(uri, summary))
    parts = sum(a["cost"] or 0.0 for a in detail["attempts"]) + detail["idle_dollars"] + detail["probe_dollars"]
    assert detail["cost"] == pytest.approx(parts, abs=1e-5), (
        f"the card says cost {detail['cost']} of which idle {detail['idle_dollars']}; its attempts and bills "
        f"add up to {parts}")
    assert detail["cost"] == pytest.approx(ledger["cost"], abs=1e-5)


# ------------------------------------------------------------------ 2. a kill counted as a preemption
def test_a_killed_attempt_not_billed_yet_is_no_preemption_on_the_page(tmp_path):
    """A segment killed while its attempt runs in a worker (marked failed, ``execution_timeout``, a worker's
    shutdown): ``on_kill`` records the kill, then ends the instance; the agent saves and writes a
    ``preempted`` status saying it saw the kill (``kill_seen``). Whoever bills it bills ``abandoned``, never a
    preemption (README, Reliability) -- but until then (the finish task, or never when the DAG run was marked
    failed and the finish task skipped) the attempt has no ledger row, and ``JobView.attempts`` takes its
    outcome from the status as it is: the page, the JSON and the list count a preemption (and mark the
    attempt "preemption"), and the estimate's MTBF counts it too. A status the kill brought about
    (``AttemptStatus.before_kill`` false) should read as abandoned, not as a preemption."""
    aid = "train.segment_000.try1"
    uri, layout = running_job(tmp_path / "job", aid)
    layout.write_kill(aid, T0 + 490)
    layout.write_status(AttemptStatus(aid, "preempted", 143, T0, T0 + 495, last_committed_step=None,
                                      instance_id="i-a", kill_seen=True))
    snap = JobView(layout.store).snapshot(T0 + 600)
    (attempt,) = snap["attempts"]
    row = job_row(ref(uri, run_state="running"), now=T0 + 600)
    assert (snap["preemptions"], attempt["preemption"], row["preemptions"]) == (0, False, 0), (
        f"a kill counted as a preemption: outcome {attempt['outcome']!r}")


# ------------------------------------------------------------------ 3. cost so far drops at an attempt's end
def test_cost_so_far_does_not_drop_when_an_attempt_ends_before_its_ledger_row(tmp_path):
    """While an attempt runs, ``JobView.attempts`` prices it ``(now - billed_from) x price`` and the page's
    "cost so far" holds it. Its agent writes its status when it ends; the trigger writes its ledger row at
    its next poll (a killed attempt's row may wait for the finish task). In between, the attempt is no
    longer ``running`` and has no row, so its cost is None and "cost so far" (and the chart's last point)
    falls by the whole attempt's cost, to come back when the row lands: a page reloading every 5 s shows
    the job's cost going down. An ended attempt without a row should be priced from its start to its
    status's end, as its row will bill it."""
    aid = "train.segment_000.try1"
    uri, layout = running_job(tmp_path / "job", aid)
    view = JobView(layout.store)
    before = view.snapshot(T0 + 495)["cost"]
    assert before == pytest.approx(495 / 3600 * 0.2, abs=1e-6)
    layout.write_status(AttemptStatus(aid, "preempted", 143, T0, T0 + 490, last_committed_step=None,
                                      instance_id="i-a", kill_seen=False))
    after = view.snapshot(T0 + 500)
    assert after["cost"] == pytest.approx(490 / 3600 * 0.2, abs=1e-4), (
        f"cost so far went from {before} to {after['cost']} when the attempt ended")


# ------------------------------------------------------------------ 4. a killed instance billed as idle
def test_a_killed_attempts_instance_is_not_billed_idle_after_its_termination(tmp_path):
    """A killed attempt is billed ``abandoned`` up to its kill, when the killer ended its instance. The
    agent, on that SIGTERM, lets the process save, writes its status and only then its liveness ``exited``
    with ``exit_reason="sigterm"``. ``accounting.bill_idle_exits`` (every segment start, the finish task)
    skips an instance whose last row is a preemption, but not one whose last row is ``abandoned``: it bills
    the instance "idle" from the kill to the agent's exit -- the emergency save during the termination's
    shutdown, which the README says is not billed, on an instance that was never warm -- and the page shows
    it as "of which warm instances idle". An instance its killer terminated should get no idle bill."""
    store = open_store(f"file://{tmp_path}/job")
    aid = "train.segment_000.try1"
    layout = JobLayout(store)
    layout.write_kill(aid, T0 + 600)
    row = LedgerRow(attempt_id=aid, instance_id="i-k", instance_type="g4dn.xlarge", zone="us-east-1a",
                    market="spot", price_per_hour=0.2, on_demand_price_per_hour=0.526, started_at=T0,
                    ended_at=T0 + 600, steps_done=40, outcome="abandoned", segment_index=0, steps_lost=3)
    LedgerStore(store).write(row)
    store.put_bytes(JobLayout.agent_key("i-k"), json.dumps(
        {"schema": 1, "instance_id": "i-k", "pid": 1, "state": "exited", "attempt_id": None,
         "time": T0 + 645, "exit_reason": "sigterm"}).encode())
    billed = accounting.bill_idle_exits(store, [row])
    assert billed == 0.0 and LedgerStore(store).idle_rows()[0] == [], (
        f"${billed:.6f} billed as idle for the 45 s after the kill's termination")
    assert JobView(store).totals(T0 + 700)["idle_dollars"] == 0.0


# ------------------------------------------------------------------ 5. the demo prints a kill as a finished segment
def test_the_demo_does_not_print_an_abandoned_attempt_as_a_finished_segment():
    """``demo_console.attempt_line`` knows three kinds of end: a preemption (preempted or lost), a failure,
    and else a finished segment ("steps 0->40 done ..., 20.0 % of the job"). An ``abandoned`` attempt (its
    task killed, its try gone; billed, no budget spent) falls into the last: the demo's printout says the
    segment was done, with its progress and an ETA, when it was cut short and its segment runs again. It
    should get its own line (abandoned, where, steps kept and lost)."""
    from airflow_spot.demo_console import attempt_line

    a = {"attempt_id": "train.segment_000.try1", "segment_index": 0, "instance_type": "g5.xlarge",
         "zone": "apse3-az3", "market": "spot", "started_at": T0, "ended_at": T0 + 30.0, "outcome": "abandoned",
         "preemption": False, "resume_step": 0, "end_step": 200, "steps_done": 40, "steps_lost": 3,
         "instance_id": "i-a"}
    line = attempt_line(a, 600, 0.0123, 2.0, 90.0)
    assert " done " not in line and "% of the job" not in line and "abandoned" in line, line


# ------------------------------------------------------------------ 6. the chart's cost leaves bills out
def test_the_charts_cost_ends_at_the_jobs_cost(tmp_path):
    """The chart of cost over time (``JobView.progress_series``) sums the attempts only: a warm instance's
    idle bill (and a probe's) is in the job's cost and in the summary the headline shows, never in the
    chart. A finished job's chart ends, and labels its maximum, at less than the cost card beside it. The
    series should add each idle and probe bill over its own time, so that its last point is the job's cost."""
    uri, _ = finished_job(tmp_path / "job")
    store = open_store(uri)
    # the finish task terminates the last segment's warm instance at T0 + 1800 and bills its idle time
    accounting.bill_idle(store, ["i-try1"], accounting.read_rows(store), T0 + 1800)
    summary = {**accounting.summarize(store, now=T0 + 2000), "job_uri": uri, "total_steps": 200,
               "latest_step": 200, "completed": True}
    store.put_bytes(JobLayout.SUMMARY_KEY, json.dumps(summary).encode())
    snap = JobView(store).snapshot(T0 + 3000)
    assert snap["idle_dollars"] > 0 and snap["cost"] == pytest.approx(summary["cost"], abs=1e-6)
    assert max(p["cost"] for p in snap["series"]) == pytest.approx(snap["cost"], abs=1e-5)
    assert {k: snap[k] for k in ROW_FIELDS} == {k: job_row(ref(uri, summary))[k] for k in ROW_FIELDS}


# ------------------------------------------------------------------ 7. an unknown remaining cost logged as $0
def test_the_progress_line_does_not_log_an_unknown_remaining_cost_as_zero(tmp_path):
    """Before the job has measured a step time (every job's first attempt, in its start-up) the estimate has
    no remaining time or cost (``remaining_cost`` None; the page shows "–"). ``progress_line``, the segment
    task's log line, prints ``est.get('remaining_cost') or 0.0``: "ETA ?, cost so far $0.0278 (remaining
    ~$0.0000)", i.e. that nothing is left to pay. An unknown remaining cost should read as unknown, as the
    ETA does."""
    from airflow_spot.storage.job_view import progress_line

    aid = "train.segment_000.try1"
    uri, layout = running_job(tmp_path / "job", aid)
    layout.write_heartbeat(Heartbeat(aid, step=0, time=T0 + 480, last_committed_step=None))  # still starting
    snap = JobView(layout.store).snapshot(T0 + 500)
    assert snap["estimate"]["remaining_cost"] is None and snap["estimate"]["remaining_seconds"] is None
    line = progress_line(snap)
    assert "ETA ?" in line and "remaining ~$0.0000" not in line, line
