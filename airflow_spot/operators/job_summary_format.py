"""Rendering of the job summary that ``SpotJobSummaryOperator`` writes: the deadline figures and the
human-readable text shown in the task log and by ``airflow-spot demo``.

Its own module because it is presentation, not orchestration: it needs nothing of Airflow, and
``operators/training.py`` (which builds the task group and runs the finish task) stays under the size limit.
``airflow_spot.operators.training`` re-exports ``deadline_figures`` and ``format_summary``.
"""
from __future__ import annotations

import json
from typing import Any

from airflow_spot.storage.protocol import JobLayout


def deadline_figures(store, summary: dict[str, Any], deadline_seconds: float, now: float) -> dict[str, Any]:
    """Whether the job met its deadline: its last step committed (the end of its last completed attempt)
    within ``deadline_seconds`` of its start (``control/job.json``). ``deadline_met`` is None while it is
    neither done nor late (a run that failed early), and missing with the job's start."""
    try:
        started = float(json.loads(store.get_bytes(JobLayout.JOB_KEY))["started_at"])
    except Exception:  # noqa: BLE001 - no job record (nothing ran): nothing to say of the deadline
        return {"deadline_seconds": deadline_seconds}
    out: dict[str, Any] = {"deadline_seconds": deadline_seconds, "started_at": started}
    ends = [r["ended_at"] for r in summary.get("rows", []) if r.get("outcome") == "completed"]
    if summary.get("completed") and ends:
        out["elapsed_seconds"] = max(ends) - started
        out["deadline_met"] = out["elapsed_seconds"] <= deadline_seconds
    else:
        out["deadline_met"] = False if now - started > deadline_seconds else None
    return out


def _deadline_line(s: dict[str, Any]) -> list[str]:
    if s.get("deadline_seconds") is None:
        return []
    hours = s["deadline_seconds"] / 3600.0
    met = s.get("deadline_met")
    if "elapsed_seconds" in s:
        word = "met" if met else "MISSED"
        return [f"  deadline            {word}: the last step committed {s['elapsed_seconds'] / 3600:.2f} h after the "
                f"job's start, of {hours:.2f} h"]
    return [f"  deadline            {'MISSED: not done' if met is False else 'not reached: the job is not done'} "
            f"({hours:.2f} h from the job's start)"]


def format_summary(s: dict[str, Any]) -> str:
    """Human-readable summary (task log and ``airflow-spot demo``)."""
    lines = [
        f"  segments            {s.get('segments')}",
        f"  attempts            {s.get('attempts')}",
        f"  preemptions         {s.get('preemptions')} (lost instances: {s.get('lost', 0)})",
        f"  code failures       {s.get('failures')}",
        *([f"  abandoned           {s['abandoned']} (ended unwaited: a killed task, a try that went; billed)"]
          if s.get("abandoned") else []),
        f"  steps lost          {s.get('steps_lost')} ({s.get('lost_gpu_hours', 0.0):.3f} GPU hours lost: "
        "paid time that left no kept progress)",
        f"  last step           {s.get('latest_step')} of {s.get('total_steps')}",
        f"  cost                ${s.get('cost', 0.0):.4f}",
        *([f"  of which probes     ${s.get('probe_dollars', 0.0):.4f} ({s['probes']} spot instances launched "
           "only to learn whether their pool had capacity)"] if s.get("probes") else []),
        *([f"  of which idle       ${s.get('idle_dollars', 0.0):.4f} ({s.get('idle_seconds', 0.0):.0f} s of warm "
           "instances after their last attempt, until terminated)"] if s.get("idle_dollars") else []),
        f"  on-demand cost      ${s.get('on_demand_cost', 0.0):.4f}",
        f"  savings             ${s.get('savings', 0.0):.4f} ({100 * s.get('savings_fraction', 0.0):.1f} %)",
        *_deadline_line(s),
    ]
    return "\n".join(lines)
