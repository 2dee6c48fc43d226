"""What ``airflow-spot demo`` prints, and that everything else goes to its log file."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from airflow_spot.demo_console import ProgressPrinter, attempt_line, quiet_output, simulated_savings
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store


def test_a_preemption_is_one_line_saying_where_when_and_the_steps_kept():
    a = {"attempt_id": "s0.try1", "segment_index": 0, "instance_type": "g5.xlarge", "zone": "use1-az1",
         "market": "spot", "started_at": 1000.0, "ended_at": 1004.5, "outcome": "preempted", "preemption": True,
         "resume_step": 20, "steps_done": 35, "steps_lost": 2}
    line = attempt_line(a, 600, 0.01, 10.0)
    assert "\n" not in line
    assert "preempted" in line and "g5.xlarge in use1-az1 (spot)" in line and "after 4.5 s" in line
    assert "35 steps kept (next try resumes from step 55), 2 lost" in line


def test_a_completed_segment_line_has_progress_rate_cost_and_eta():
    a = {"segment_index": 1, "instance_type": "g4dn.xlarge", "zone": "z", "market": "spot", "started_at": 0.0,
         "ended_at": 10.0, "outcome": "completed", "preemption": False, "resume_step": 200, "steps_done": 200}
    line = attempt_line(a, 600, 0.0153, 20.0, eta_seconds=12.0)
    assert "steps 200->400" in line and "66.7 % of the job" in line and "20.0 steps/s" in line
    assert "cost so far $0.0153" in line and "ETA 12 s" in line


def test_quiet_output_sends_this_process_and_its_children_to_the_log(tmp_path):
    log = tmp_path / "demo.log"
    with quiet_output(log) as console:
        os.write(1, b"airflow says hello\n")  # fd 1, where Airflow's stdout goes (pytest swaps sys.stdout)
        print("to the terminal", file=console)
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('Traceback', file=sys.stderr)"],
                       check=True)
    text = log.read_text()
    assert "airflow says hello" in text and "child out" in text and "Traceback" in text
    assert "to the terminal" not in text


def test_progress_printer_prints_each_ended_attempt_once(tmp_path):
    jobs = tmp_path / "jobs" / "dag"
    jobs.mkdir(parents=True)
    out = io.StringIO()
    printer = ProgressPrinter(jobs, out)  # directories present before the run are not this run's
    run = jobs / "run1"
    store = open_store(f"file://{run}")
    for aid, outcome, kept in (("s0.try1", "preempted", 10), ("s0.try2", "completed", 90)):
        LedgerStore(store).write(LedgerRow(aid, "i-" + aid, "g5.xlarge", "z", "spot", 0.36, 1.0, 0.0, 5.0, kept,
                                           outcome, step_seconds=0.05))
    printer.poll()
    printer.poll()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "preemption" in lines[0] and "segment 0" in lines[1]


def test_the_48h_trace_figure_is_computed_by_the_simulator():
    sim = simulated_savings()
    assert "error" not in sim, sim
    assert sim["completed"] and 0 < sim["cost"] < sim["on_demand_cost"]
    assert sim["savings_fraction"] == 1 - sim["cost"] / sim["on_demand_cost"]
    # every hourly start, so one lucky or unlucky start is not the figure a user takes away
    assert sim["starts"] > 100 and 0 < sim["best_ratio"] <= sim["mean_ratio"] <= sim["worst_ratio"] < 1
    assert sim["best_ratio"] <= sim["cost"] / sim["on_demand_cost"] <= sim["worst_ratio"]
    assert sim["deadlines_met"] == sim["starts"]


@pytest.mark.parametrize("argv, message", [
    (["--mtbf", "-1"], "--mtbf is the mean seconds between random preemptions and must be > 0"),
    (["--mtbf", "0"], "--mtbf is the mean seconds between random preemptions and must be > 0"),
    (["--mtbf", "30", "--preempt-after", "5,5"], "--mtbf (random preemptions) and --preempt-after (a schedule)"),
    (["--step-sleep", "-1"], "--step-sleep is seconds per step and must be between 0 and 10"),
    (["--moto"], "--moto plays EC2 and applies to --backend ec2 only"),
    (["--mtbf", "inf"], "must be > 0 and finite"),
    (["--step-sleep", "inf"], "--step-sleep is seconds per step and must be between 0 and 10"),
    (["--step-sleep", "nan"], "--step-sleep is seconds per step and must be between 0 and 10"),
    (["--total-steps", "0"], "--total-steps must be between 1 and 1000000"),
    (["--total-steps", "10000000"], "--total-steps must be between 1 and 1000000"),
    (["--steps-per-segment", "-5"], "--steps-per-segment must be between 1 and 1000000"),
])
def test_bad_demo_arguments_fail_before_anything_runs(tmp_path, capsys, argv, message):
    from airflow_spot.cli import main

    assert main(["demo", "--out", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing was set up


def test_a_failed_attempt_line_says_where_its_output_is():
    line = attempt_line({"outcome": "failed", "segment_index": 1, "instance_type": "g4dn.xlarge", "zone": "z",
                         "market": "spot", "started_at": 0.0, "ended_at": 2.0, "instance_id": "local-0003",
                         "attempt_id": "train.segment_001.try1"}, 600, 0.0, None)
    assert "instances/local-0003/attempts/train.segment_001.try1.log" in line


def test_an_attempt_being_accounted_waits_for_its_row_so_its_line_holds_its_cost(tmp_path):
    """Its status is written before its ledger row: printed then, its line's "cost so far" left out its own
    cost (the demo printed the same figure for two segments, and the summary came out above the last)."""
    from airflow_spot.storage.protocol import AttemptStatus, JobLayout

    jobs = tmp_path / "jobs" / "dag"
    jobs.mkdir(parents=True)
    out = io.StringIO()
    printer = ProgressPrinter(jobs, out)
    store = open_store(f"file://{jobs / 'run1'}")
    JobLayout(store).write_status(AttemptStatus("s0.try1", "completed", 0, 0.0, 3600.0, 90))
    printer.poll()
    assert out.getvalue() == ""  # not yet: no row
    LedgerStore(store).write(LedgerRow("s0.try1", "i-1", "g5.xlarge", "z", "spot", 0.36, 1.0, 0.0, 3600.0, 90,
                                       "completed", step_seconds=0.05))
    printer.poll()
    assert "cost so far $0.3600" in out.getvalue()
    JobLayout(store).write_status(AttemptStatus("s1.try1", "completed", 0, 3600.0, 3700.0, 100))
    printer.poll(final=True)  # the run is over: printed all the same
    assert len(out.getvalue().splitlines()) == 2


def test_the_demos_thrown_away_seconds_follow_the_savings_rule():
    """Savings credit a completed attempt that restarted its segment after a preemption only its kept steps
    (its boot and restore are the preemption's cost); the demo's "thrown away" seconds, which explain the
    gap between savings and the spot discount, left that restart out."""
    from airflow_spot.demo import report
    from airflow_spot.policy.ledger import summarize

    def row(aid, seg, start, end, steps, outcome):
        return LedgerRow(aid, "i-" + aid, "g5.xlarge", "z", "spot", 0.3, 1.0, start, end, steps, outcome,
                         segment_index=seg, step_seconds=60.0)

    rows = [row("s0.try1", 0, 0.0, 600.0, 5, "preempted"),      # 300 s kept, 300 s thrown
            row("s0.try2", 0, 600.0, 1800.0, 10, "completed"),   # the restart: 600 s kept, 600 s thrown
            row("s1.try1", 1, 1800.0, 2400.0, 8, "completed")]   # first try: its whole time credited
    s = {**summarize(rows).to_dict(), "rows": [r.to_dict() for r in rows]}
    out = report("success", s, wall=2400.0, total=2400.0)
    assert "900 s of paid time that kept no work" in out
    assert "ran shorter than" not in out  # every attempt outlasted the 60 s minimum
    short = LedgerRow("s2.try1", "i-s", "g5.xlarge", "z", "spot", 0.3, 1.0, 2400.0, 2420.0, 1, "completed",
                      segment_index=2, step_seconds=10.0)
    rows.append(short)
    s = {**summarize(rows).to_dict(), "rows": [r.to_dict() for r in rows]}
    assert "1 of the 4 attempts ran shorter than the 60 s AWS bills" in report("success", s, wall=2420.0, total=2420.0)


@pytest.mark.parametrize("value", ["nan", "inf", "4,inf", "-1"])
def test_a_preemption_schedule_must_be_finite_seconds(tmp_path, capsys, value):
    from airflow_spot.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", "--out", str(tmp_path / "out"), "--preempt-after", value])
    assert exc.value.code == 2 and "seconds must be finite and >= 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_out_folder_under_a_file_is_a_usage_error_not_a_traceback(tmp_path, capsys):
    from airflow_spot.cli import main

    (tmp_path / "afile").write_text("x")
    assert main(["demo", "--out", str(tmp_path / "afile" / "demo")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "cannot create" in err and "Traceback" not in err
    assert (tmp_path / "afile").read_text() == "x"
