"""What ``airflow-spot demo`` shows a person, and where it puts everything else.

* :func:`quiet_output` sends Airflow's own log lines — and the tracebacks of the expected preemptions
  (each one is a retryable task failure, which Airflow logs in full) — to a log file, at the file
  descriptor level so subprocesses and C extensions are caught too; the demo's own lines go to the
  terminal through a duplicate of the original stdout.
* :class:`ProgressPrinter` watches the job store (read-only, through
  :class:`~airflow_spot.storage.job_view.JobView`) from a thread and prints one line per finished
  segment attempt: a progress line for a completed segment, a preemption line (where, when, steps kept)
  for a preempted or lost one.
* :func:`simulated_savings` replays the bundled spot traces for the 48 h reference job through the
  default policy, so the summary shows what the mechanism saves at a scale where billing minima and
  start-up no longer dominate.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

#: seconds between two looks at the job store
POLL_SECONDS = 0.5


@contextlib.contextmanager
def quiet_output(log_path: Path) -> Iterator[IO[str]]:
    """Redirect file descriptors 1 and 2 to ``log_path`` for the block; yield a stream to the terminal."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(saved_out), "w", buffering=1)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield console
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            console.close()


def _clock(ts: float | None) -> str:
    return "?" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def attempt_line(a: dict[str, Any], total_steps: int | None, cost_so_far: float, rate: float | None,
                 eta_seconds: float | None = None) -> str:
    """One line for one finished attempt (``JobView.attempts`` as dicts)."""
    where = f"{a.get('instance_type')} in {a.get('zone')} ({a.get('market')})"
    took = (a.get("ended_at") or 0) - (a.get("started_at") or 0)
    kept = a.get("steps_done") or 0
    resume = a.get("resume_step") or 0
    if a.get("preemption"):
        what = "preempted" if a.get("outcome") == "preempted" else "lost (instance gone without a status)"
        return (
            f"  ! preemption  segment {a.get('segment_index')} {what} at {_clock(a.get('ended_at'))} on {where} "
            f"after {took:.1f} s: {kept} steps kept (next try resumes from step {resume + kept}), "
            f"{a.get('steps_lost') or 0} lost"
        )
    if a.get("outcome") == "abandoned":
        return (f"  x abandoned   segment {a.get('segment_index')} cut short on {where} after {took:.1f} s "
                f"(its task killed or its try gone): {kept} steps kept, {a.get('steps_lost') or 0} lost; "
                "billed, no budget spent; the segment runs again")
    if a.get("outcome") == "failed":
        return (f"  x failure     segment {a.get('segment_index')} failed on {where} after {took:.1f} s; "
                f"its output: instances/{a.get('instance_id')}/attempts/{a.get('attempt_id')}.log "
                "under the instance logs printed at the end")
    done = resume + kept
    pct = f"{100 * done / total_steps:5.1f} %" if total_steps else "?"
    speed = f"{rate:.1f} steps/s" if rate else "? steps/s"
    return (
        f"  segment {a.get('segment_index')}   steps {resume}->{done} done on {where} in {took:.1f} s: "
        f"{pct} of the job, {speed}, cost so far ${cost_so_far:.4f}"
        + (f", ETA {eta_seconds:.0f} s" if eta_seconds and done < (total_steps or 0) else "")
    )


class ProgressPrinter:
    """Print a line for each attempt that ends, in every job directory that appears under ``jobs_dir``.

    :param jobs_dir: ``<out>/jobs/<dag_id>``: one directory per DAG run.
    :param console: where the lines go.
    """

    def __init__(self, jobs_dir: Path, console: IO[str]) -> None:
        self.jobs_dir = jobs_dir
        self.console = console
        self.before = set(jobs_dir.iterdir()) if jobs_dir.is_dir() else set()
        self.printed: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="demo-progress", daemon=True)

    def __enter__(self) -> ProgressPrinter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.poll(final=True)  # the last attempts, ended just before the run did

    def _loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a half-written object is read again next round
                print(f"  (progress not readable yet: {exc})", file=self.console)

    def poll(self, final: bool = False) -> None:
        """Print the attempts that ended since the last poll. An attempt whose status is written but whose
        ledger row is not yet (it is being accounted) waits for the next poll, so that its line's "cost so
        far" holds its own cost; ``final`` prints it all the same."""
        from airflow_spot.storage.job_view import JobView
        from airflow_spot.storage.object_store import open_store

        if not self.jobs_dir.is_dir():
            return
        for job in sorted(set(self.jobs_dir.iterdir()) - self.before):
            if job.name.startswith("_"):  # the deployment's availability log, beside the job roots
                continue
            view = JobView(open_store(f"file://{job}"))
            snap = view.snapshot(time.time())
            cost = 0.0
            for a in snap["attempts"]:
                if a["outcome"] == "running" or (a.get("cost") is None and not final):
                    continue
                cost += a.get("cost") or 0.0
                if a["attempt_id"] in self.printed:
                    continue
                self.printed.add(a["attempt_id"])
                rate = 1.0 / a["step_seconds"] if a.get("step_seconds") else None
                eta = (snap.get("estimate") or {}).get("remaining_seconds")
                print(attempt_line(a, snap.get("total_steps"), cost, rate, eta), file=self.console)


def simulated_savings(work_hours: float = 48.0, deadline_hours: float = 52.0) -> dict[str, Any]:
    """Cost of the reference job on the bundled traces with the default policy and on demand only.

    One start (hour 0 of the traces) and every hourly start: a single start can be lucky or not, the
    spread says which.

    :returns: ``policy``, ``cost``, ``on_demand_cost``, ``savings_fraction``, ``preemptions`` (hour 0),
        ``starts``, ``mean_ratio``, ``best_ratio``, ``worst_ratio``, ``deadlines_met`` (every hourly start,
        cost as a multiple of on-demand), ``seconds`` (how long the replays took), or ``error`` when the
        simulator cannot run here.
    """
    started = time.monotonic()
    try:
        from airflow_spot.market import get_market
        from airflow_spot.market.traces import PREEMPTION_TRACES_SUBDIR, default_traces_dir, load_traces
        from airflow_spot.simulate.controllers import controllers
        from airflow_spot.simulate.engine import JobSpec
        from airflow_spot.simulate.report import build_pools, distribution, offsets_for, run_policies

        spec = JobSpec(work_hours=work_hours, deadline_hours=deadline_hours)
        traces = load_traces(default_traces_dir() / PREEMPTION_TRACES_SUBDIR)
        pools, on_demand = build_pools(traces, spot_price=None, on_demand_price=None, market=get_market("local"))
        policy = controllers.default or "ours"
        baseline = run_policies(spec, pools, on_demand, ["on-demand"])[0].cost
        result = run_policies(spec, pools, on_demand, [policy])[0]
        spread = distribution(spec, pools, on_demand, policy, offsets_for(spec, traces), baseline)
    except Exception as exc:  # noqa: BLE001 - the demo's own result stands without this figure
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "policy": policy,
        "work_hours": work_hours,
        "deadline_hours": deadline_hours,
        "zones": [t.zone for t in traces],
        "cost": result.cost,
        "on_demand_cost": baseline,
        "savings_fraction": 1.0 - result.cost / baseline if baseline > 0 else 0.0,
        "preemptions": result.preemptions,
        "completed": result.completed,
        "starts": spread.runs,
        "mean_ratio": spread.mean_ratio,
        "best_ratio": min(spread.ratios),
        "worst_ratio": spread.worst_ratio,
        "deadlines_met": spread.deadline_met,
        "seconds": time.monotonic() - started,
    }
