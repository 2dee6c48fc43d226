"""The job's page (``airflow_spot.ui.app.job_detail`` and ``airflow_spot.ui.page``) when what it shows is
hostile or damaged: values that hold HTML, a ledger row that does not decode, a finished job whose store
is gone, a checkpoint whose manifest is cut short, a summary whose savings the rounded figures would
recompute differently, a list longer than the page shows."""
from __future__ import annotations

import json
import shutil

import pytest
from test_job_rows import T0, finished_job, ref

from airflow_spot.policy.ledger import JobSummary
from airflow_spot.storage.job_view import JobView, final_figures
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout
from airflow_spot.ui import page
from airflow_spot.ui.app import job_detail

EVIL = "<img src=x onerror=alert(1)>"


def render(detail: dict) -> str:
    return page.job_page(detail["dag_id"], detail["run_id"], detail, detail["offers"], detail["offers_note"],
                         detail.get("ranking"))


# ------------------------------------------------------------------ 1. nothing user-controlled is markup
def test_every_value_on_the_pages_is_escaped():
    attempt = {k: EVIL for k in ("attempt_id", "instance_type", "zone", "market", "outcome", "segment_index",
                                 "resume_step", "end_step", "steps_done", "steps_lost", "price_per_hour",
                                 "started_at", "ended_at", "cost")}
    snap = {
        "state": EVIL, "job_uri": EVIL, "current_step": EVIL, "total_steps": EVIL, "progress": EVIL,
        "cost": EVIL, "on_demand_cost": EVIL, "savings": EVIL, "savings_fraction": EVIL, "preemptions": EVIL,
        "steps_lost": EVIL, "attempts": [attempt], "series": [], "estimate": {"basis": EVIL},
        "checkpoints": [{"step": EVIL, "time": EVIL, "size": EVIL, "writer": EVIL}],
        "broken_checkpoints": [{"step": EVIL, "directory": EVIL, "problem": EVIL}],
        "unreadable": [{"key": EVIL, "error": EVIL}], "store_note": EVIL,
    }
    offer = {"instance_type": EVIL, "zone": EVIL, "market": EVIL, "gpu_name": EVIL, "gpu_count": EVIL,
             "price_per_hour": 0.2, "steps": EVIL}
    ranking = {"basis": EVIL, "steps": EVIL, "offers": [{**offer, "relative_cost": 1.0}]}
    pages = [
        page.job_page(EVIL, EVIL, snap, [offer], EVIL, ranking),
        page.job_page(EVIL, EVIL, snap, [], EVIL, {"note": EVIL, "offers": []}),
        page.jobs_page([{"dag_id": EVIL, "run_id": EVIL, "state": EVIL, "progress": EVIL, "cost": EVIL,
                         "savings": EVIL, "preemptions": EVIL, "error": EVIL}],
                       shown={"limit": 1, "offset": 1, "more": True, "dag_id": EVIL, "max": EVIL}),
        page.message_page(EVIL),
    ]
    for html in pages:
        assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


# ------------------------------------------------------------------ 2. a malformed ledger row
def test_a_malformed_ledger_row_leaves_the_rest_of_the_job_on_its_page(tmp_path):
    uri, summary = finished_job(tmp_path / "job")
    store = open_store(uri)
    bad = "control/ledger/train.segment_001.try0.json"
    store.put_bytes(bad, b'{"attempt_id": "train.segment_001.try0", "outcome": "preempted"}')
    store.delete([JobLayout.SUMMARY_KEY])  # read from the store, not from the summary
    detail = job_detail(ref(uri, run_state="running"))
    assert [u["key"] for u in detail["unreadable"]] == [bad]
    assert "not a valid ledger row" in detail["unreadable"][0]["error"]
    assert len(detail["attempts"]) == 3 and detail["preemptions"] == 1
    assert detail["cost"] == pytest.approx(1180 / 3600 * 0.2, abs=1e-6)  # the three readable rows
    html = render(detail)
    assert "id=unreadable" in html and bad in html and html.count('class="attempt ') == 3
    # the list's row shows the same figures, and says an object was left out
    from airflow_spot.ui.jobs import job_row

    row = job_row(ref(uri, run_state="running"), now=T0 + 3000)
    assert row["cost"] == detail["cost"] and bad in row["error"]


# ------------------------------------------------------------------ 3. the store of a finished job is gone
def test_a_finished_job_whose_store_is_gone_shows_its_summary_and_says_so(tmp_path):
    uri, summary = finished_job(tmp_path / "job")
    with_store = job_detail(ref(uri, summary))
    shutil.rmtree(tmp_path / "job")
    detail = job_detail(ref(uri, summary))
    final = final_figures(summary)
    assert {k: detail[k] for k in final} == final
    assert {k: detail[k] for k in final} == {k: with_store[k] for k in final}
    assert detail["state"] == "finished" and detail["total_steps"] == 200 and detail["cost"] > 0
    assert detail["steps_lost"] == summary["steps_lost"] == 7 and detail["summary"] == summary
    assert "gone or empty" in detail["store_note"] and uri in detail["store_note"]
    assert detail["ranking"] is None  # not the ranking "before the job starts"
    assert "has not recorded its GPU request yet" not in (detail["offers_note"] or "")
    html = render(detail)
    assert "id=store-note" in html and "200 / 200 steps (100.0 %)" in html


# ------------------------------------------------------------------ 4. a checkpoint that does not verify
def test_a_checkpoint_with_a_truncated_manifest_is_shown_broken(tmp_path):
    uri, _ = finished_job(tmp_path / "job")
    store = open_store(uri)
    JobLayout(store).checkpoint_store(writer="train").save(400, lambda f: f.write(b"x" * 500))
    key = next(k for k in store.list("checkpoints/") if k.startswith("checkpoints/000000000400-")
               and k.endswith("/MANIFEST.json"))
    store.put_bytes(key, store.get_bytes(key)[:30])  # cut short
    detail = job_detail(ref(uri))
    assert [c["step"] for c in detail["checkpoints"]] == [60, 100, 200]
    assert [b["step"] for b in detail["broken_checkpoints"]] == [400]
    html = render(detail)
    table = html[html.index("<table id=checkpoints>"):]
    table = table[:table.index("</table>")]
    assert table.count("<tr class=checkpoint>") == 3 and table.count("<tr class=broken>") == 1
    assert "<td class=n>400</td>" in table and "BROKEN: " in table
    assert "id=broken-checkpoints" in html


# ------------------------------------------------------------------ 5. the summary's own savings
def test_the_headline_shows_the_summarys_savings_not_ones_recomputed_from_rounded_figures():
    s = JobSummary(attempts=1, preemptions=0, cost=0.0102604, on_demand_cost=0.0020156, spot_cost=0.0102604,
                   billed_seconds=100.0, gpu_hours=0.03, lost_gpu_hours=0.0, steps_done=10, steps_lost=0).to_dict()
    summary = {**s, "total_steps": 10, "latest_step": 10, "completed": True}
    assert summary["savings"] == -0.008245 and f"{100 * summary['savings_fraction']:.1f}" == "-409.0"
    final = final_figures(summary)
    assert final["savings"] == summary["savings"] and final["savings_fraction"] == summary["savings_fraction"]
    html = page.job_page("d", "r", {**final, "attempts": [], "checkpoints": [], "series": [], "summary": summary},
                         [])
    assert "$-0.0082 (-409.0 %)" in html


def test_the_job_page_and_the_list_show_the_summarys_savings_from_the_store_too(tmp_path):
    uri, summary = finished_job(tmp_path / "job")
    summary = {**summary, "savings": 0.123457, "savings_fraction": 0.654321}  # as a finish task wrote them
    open_store(uri).put_bytes(JobLayout.SUMMARY_KEY, json.dumps(summary).encode())
    snap = JobView(open_store(uri)).snapshot(T0 + 3000)
    assert snap["savings"] == 0.123457 and snap["savings_fraction"] == 0.654321


# ------------------------------------------------------------------ 6. a list longer than the page
def test_the_list_says_when_older_jobs_are_not_shown_and_links_to_them():
    rows = [{"dag_id": "d", "run_id": f"r{i}", "state": "finished"} for i in range(2)]
    html = page.jobs_page(rows, shown={"limit": 2, "offset": 0, "more": True, "dag_id": None, "max": 1000})
    assert "id=jobs-more" in html and "Only the 2 newest jobs are shown: older jobs are not." in html
    assert 'href="/spot/?limit=2&amp;offset=2"' in html and "?limit=N" in html
    assert "id=jobs-more" not in page.jobs_page(rows, shown={"limit": 2, "offset": 0, "more": False})


def test_a_store_that_cannot_be_read_at_all_still_gives_the_job_a_page(tmp_path):
    """Not a 500: the page names the store and why; a finished job's figures come from its summary."""
    gone = ref("nope://bucket/job")  # a scheme no store has
    detail = job_detail(gone)
    assert detail["unreadable"][0]["key"] == "nope://bucket/job" and detail["ranking"] is None
    assert "store not readable" in detail["unreadable"][0]["error"] and "id=unreadable" in render(detail)
    ledger_row_as_list = tmp_path / "job"
    uri, summary = finished_job(ledger_row_as_list)
    open_store(uri).put_bytes("control/ledger/x.json", b"[1, 2]")  # JSON, but no object
    detail = job_detail(ref(uri, summary))
    assert [u["key"] for u in detail["unreadable"]] == ["control/ledger/x.json"] and detail["state"] == "finished"
    from dataclasses import replace

    summarized = job_detail(replace(gone, summary=summary))
    assert summarized["cost"] == final_figures(summary)["cost"] and "could not be read" in summarized["store_note"]
