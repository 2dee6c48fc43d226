"""A planning review of the ``airflow-spot`` command line (simulate, estimate), as an ML engineer uses it before
spending money: each test names one defect found, fails while it is there and passes once it is fixed.

What a user is promised (README, "Commands"): bad input gets exit code 2 and one line on stderr that says what
is wrong and how to fix it, never a traceback nor a hang; nothing is silently ignored; the figures printed are
the figures of what was replayed."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_spot.cli import main


def run(capsys, *argv: str) -> tuple[object, str, str]:
    """``(exit code, stdout, stderr)`` of ``airflow-spot argv`` in this process; an exception that escapes the
    command (a traceback for a user) is returned as the code ``"raised <type>: <message>"``."""
    try:
        rc: object = main(list(argv))
    except SystemExit as exc:  # argparse's own errors exit 2 with a usage line
        rc = exc.code
    except Exception as exc:  # noqa: BLE001 - what the user would see as a traceback
        rc = f"raised {type(exc).__name__}: {exc}"
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def cli(*argv: str, timeout: float = 15.0) -> subprocess.CompletedProcess:
    """``airflow-spot argv`` in a subprocess, so that a hang fails the test instead of the suite."""
    try:
        return subprocess.run([sys.executable, "-m", "airflow_spot.cli", *argv], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"airflow-spot {' '.join(argv)} still ran after {timeout:g} s (a hang, not an error message)")


def write_trace(d: Path, zone: str, values: list, gap: object = 60) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{zone}_v100_1.json"
    # json.dumps writes float('nan') / float('inf') as NaN / Infinity, as a user's conversion script does
    p.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": values}))
    return p


def two_zones(d: Path) -> Path:
    """Two zones, six hours of one-minute ticks."""
    write_trace(d, "us-west-2b", ([1] * 50 + [0] * 10) * 6)
    write_trace(d, "us-west-2c", ([0] * 20 + [1] * 40) * 6)
    return d


JOB = ["--work-hours", "1", "--deadline-hours", "1.5", "--restart-overhead-hours", "0.05"]


def _table(out: str) -> str:
    return out[out.index("job:"):]


# ---- estimate ------------------------------------------------------------------------------------------------

_PROFILED = """\
import sys, time
from airflow_spot.training import SpotSession

class State:
    def __init__(self): self.v = 0
    def state_dict(self): return {{"v": self.v}}
    def load_state_dict(self, d): self.v = d["v"]

{noise}
with SpotSession.from_env(total_steps=60) as spot:
    spot.track(state=State())
    for step in spot.steps():
        time.sleep(0.01)
"""


def _training_script(tmp_path: Path, noise: str = "") -> str:
    script = tmp_path / "train.py"
    script.write_text(_PROFILED.format(noise=noise))
    return f"{sys.executable} {script}"


def test_a_profiled_script_that_writes_much_to_stderr_is_measured_not_deadlocked(tmp_path, capsys):
    """Mechanism: ``simulate/estimate_command.py:profile_step_seconds`` starts the profiling run with
    ``stderr=subprocess.PIPE`` and reads that pipe only after the process has exited. A training script that
    writes more than the pipe's buffer (64 KiB) to stderr -- Python's logging, warnings, tqdm progress bars
    all write there; ``examples/train_tiny.py`` itself logs at INFO to stderr -- blocks in ``write`` forever,
    and ``estimate`` reports, after ``--profile-timeout`` (600 s by default), "ran longer than
    --profile-timeout", blaming the user's script. The same script without the logging takes ~3 s.

    Expected: stderr is drained while the run goes on (a thread, ``communicate``-style reads, or a temporary
    file), keeping its tail for the error message; the run is measured and ``estimate`` exits 0."""
    noise = 'sys.stderr.write("UserWarning: something chatty a library says\\n" * 8000); sys.stderr.flush()'
    rc, out, err = run(capsys, "estimate", "--steps", "1000", "--profile-command", _training_script(tmp_path, noise),
                       "--profile-as", "T4", "--profile-steps", "60", "--profile-timeout", "15", "--top", "1")
    assert rc == 0, err[-500:]
    assert out.startswith("step time fit: t = "), out


def test_a_measured_figure_for_the_profiled_gpu_is_not_silently_dropped(tmp_path, capsys):
    """Mechanism: ``simulate/estimate_command.py:rank`` parses ``--measured`` (which refuses two figures for one
    GPU: "give one figure per GPU model") and then sets ``measured[profile_as] = profile_step_seconds(...)``,
    overwriting a ``--measured`` figure for the same GPU without a word. ``--measured T4=5 --profile-as T4
    --profile-command ...`` ranks by the profile alone; the 5 s the user typed count for nothing.

    Expected: refused as two figures for one GPU are (exit 2 naming ``--measured`` and ``--profile-as``), or
    both counted (their log-mean, as two GPUs of one throughput are); never one dropped silently."""
    rc, out, err = run(capsys, "estimate", "--steps", "1000", "--measured", "T4=5",
                       "--profile-command", _training_script(tmp_path), "--profile-as", "T4",
                       "--profile-steps", "60", "--profile-timeout", "60", "--top", "1")
    if rc == 2:
        assert "--measured" in err and "--profile-as" in err and "Traceback" not in err, err
        return
    assert rc == 0, err
    # the profile alone measures ~0.01 s a step on this "T4" (~0.004 s on a V100); with the 5 s counted the
    # V100 figure of the fit is far above 0.05 s
    fit = float(re.search(r"step time fit: t = ([0-9.]+) s on a V100", out).group(1))
    assert fit > 0.05, f"--measured T4=5 was dropped: the fit is the profile's alone ({out.splitlines()[0]})"


# ---- simulate: trace files -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "gap, values, names",
    [
        (float("inf"), [1, 1, 1] * 200, "gap_seconds"),  # passes `gap > 0`; the replay then never ends
        (60, [1, float("nan"), 1] * 200, "data[1]"),  # "cannot convert float NaN to integer", no file named
        (60, [1, float("inf"), 1] * 200, "data[1]"),  # OverflowError traceback from int(inf)
    ],
    ids=["gap-Infinity-hangs", "data-NaN-unnamed", "data-Infinity-traceback"],
)
def test_a_trace_with_json_nan_or_infinity_is_refused_naming_the_file(tmp_path, gap, values, names):
    """Mechanism: ``market/traces.py:parse_trace`` validates with ``gap > 0`` and ``v != int(v)``, but Python's
    ``json`` reads the non-standard ``NaN`` / ``Infinity`` that ``json.dump`` writes for a float nan / inf (a
    pandas gap in a converted trace): an infinite ``gap_seconds`` passes and ``simulate`` hangs in the replay
    (``policy/deadline.py:on_demand_only`` loops); a NaN value raises ``ValueError('cannot convert float NaN to
    integer')``, printed without the file or the value; an infinite value raises ``OverflowError``, which
    ``simulate`` does not catch: a traceback.

    Expected: exit 2 and one line naming the file and the bad field (``metadata.gap_seconds`` must be a finite
    positive number; ``data[i]`` is not 0/1), as for any other bad value."""
    d = tmp_path / "traces"
    path = write_trace(d, "us-west-2b", values, gap=gap)
    proc = cli("simulate", *JOB, "--traces", str(d), "--spot-price", "1", "--on-demand-price", "3",
               "--policies", "ours")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-800:])
    assert "Traceback" not in proc.stderr, proc.stderr[-800:]
    assert str(path) in proc.stderr and names in proc.stderr, proc.stderr


def test_a_one_node_trace_of_a_zone_that_never_had_capacity_is_no_nodes_error(tmp_path, capsys):
    """Mechanism: ``market/traces.py:check_node_count`` (called by ``simulate/command.py:run`` with the default
    ``--nodes 1``) refuses every trace whose ``max_count`` -- ``max(values)`` -- is below ``nodes``. A one-node
    trace of a zone that had no capacity over the window (all 0: a real observation, e.g. a window of a
    SkyPilot ``full.json``) has ``max_count`` 0, so the whole replay is refused with "--nodes 1: the traces of
    ['us-west-2c'] never show that many instances up (a 1-node trace holds 0/1); use multi-node availability
    traces or fewer nodes" -- blaming ``--nodes`` and asking for fewer than one node.

    Expected: the zone is replayed as a pool that is always down (the other zone is used), or, if refused,
    the line says the zone's trace is never up (and how to leave it out, ``--zones``), not ``--nodes``."""
    d = tmp_path / "traces"
    write_trace(d, "us-west-2b", ([1] * 50 + [0] * 10) * 6)
    write_trace(d, "us-west-2c", [0] * 360)
    rc, out, err = run(capsys, "simulate", *JOB, "--traces", str(d), "--spot-price", "1", "--on-demand-price", "3",
                       "--policies", "ours,on-demand")
    if rc == 0:
        assert "zones us-west-2b, us-west-2c" in out, out
        return
    assert rc == 2, (rc, err)
    assert "fewer nodes" not in err and "--nodes" not in err, f"blames --nodes for a zone with no capacity: {err}"
    assert "us-west-2c" in err, err


def test_the_same_trace_file_given_twice_is_read_once_or_the_hint_works(tmp_path, capsys):
    """Mechanism: ``market/traces.py:load_traces`` loads every path it is given, so one file named twice
    (``--traces DIR DIR/us-west-2c_v100_1.json``, a glob overlapping a folder, a path repeated in a script) is
    two pools of one zone; ``_one_pool_per_zone_message`` then says "pass the files of one kind, e.g. --traces
    DIR/us-west-2b_v100_1.json,DIR/us-west-2c_v100_1.json,DIR/us-west-2c_v100_1.json" -- the same duplicate, so
    the fix the message gives fails with the same message.

    Expected: one file given twice is read once (paths compared resolved), or the hint names each file once,
    so that running what it suggests works."""
    d = two_zones(tmp_path / "traces")
    base = ["simulate", *JOB, "--spot-price", "1", "--on-demand-price", "3", "--policies", "ours"]
    rc, out, err = run(capsys, *base, "--traces", str(d), str(d / "us-west-2c_v100_1.json"))
    if rc == 0:
        assert "zones us-west-2b, us-west-2c," in out, out
        return
    assert rc == 2 and "Traceback" not in err, (rc, err)
    hint = re.search(r"--traces (\S+)", err)
    assert hint, f"no --traces to try in: {err}"
    rc, out, err = run(capsys, *base, "--traces", hint.group(1))
    assert rc == 0, f"the suggested --traces {hint.group(1)} fails too: {err}"


# ---- simulate: zones, prices, history ----------------------------------------------------------------------------

def test_a_zone_listed_twice_in_zones_is_one_pool(tmp_path, capsys):
    """Mechanism: ``simulate/command.py:run`` keeps ``[t for z in wanted for t in traces if t.zone == z]`` for
    ``--zones``, so ``--zones us-west-2b,us-west-2b`` replays two pools of one zone, although ``load_traces``
    refuses two traces of one zone ("a replay takes one pool per zone"). The header lists the zone twice and
    ``ours`` probes it twice while on on-demand, each probe billed: on the bundled traces from hour 20 (8 h of
    work, 10 h deadline) it costs $19.41 instead of $19.28 -- a typo changes the figures a plan rests on.

    Expected: a zone given twice is kept once (the same figures as ``--zones us-west-2b``), or refused with
    exit 2 naming it."""
    base = ["simulate", "--work-hours", "8", "--deadline-hours", "10", "--spot-price", "1", "--on-demand-price", "3",
            "--start-hour", "20", "--policies", "ours"]
    once, twice = tmp_path / "once.json", tmp_path / "twice.json"
    rc, out, err = run(capsys, *base, "--zones", "us-west-2b", "--json", str(once))
    assert rc == 0, err
    rc, out, err = run(capsys, *base, "--zones", "us-west-2b,us-west-2b", "--json", str(twice))
    if rc == 2:
        assert "us-west-2b" in err and "Traceback" not in err, err
        return
    assert rc == 0, err
    assert "zones us-west-2b, us-west-2b" not in out, out.splitlines()[0]
    assert json.loads(twice.read_text())["runs"] == json.loads(once.read_text())["runs"]


@pytest.mark.parametrize(
    "text",
    ["\ufeffzone,spot,on_demand\nus-west-2b,1,3\nus-west-2c,1.1,3\n",  # Excel's "CSV UTF-8" starts with a BOM
     "# on-demand from the AWS price list, 2026-11\nzone,spot,on_demand\nus-west-2b,1,3\nus-west-2c,1.1,3\n"],
    ids=["utf8-bom", "comment-before-header"],
)
def test_a_prices_file_header_is_skipped_with_a_bom_or_after_a_comment(tmp_path, capsys, text):
    """Mechanism: ``simulate/report.py:read_prices`` ("a header line is allowed") skips a header only when it
    is line 1 and its first cell is exactly ``zone``. A file saved by Excel as "CSV UTF-8" starts with a BOM
    (first cell ``'\\ufeffzone'``), and a file whose first line is a ``#`` comment (which the reader skips)
    has its header on line 2: both are refused with "line N: prices must be numbers ($/h), got 'spot',
    'on_demand'", an error about the header the docs allow.

    Expected: the header is recognised there too (the file read as ``utf-8-sig``; the first non-comment line
    may be the header), and the replay is the one a header-less file gives."""
    d = two_zones(tmp_path / "traces")
    plain, given = tmp_path / "plain.csv", tmp_path / "given.csv"
    plain.write_text("us-west-2b,1,3\nus-west-2c,1.1,3\n")
    given.write_text(text, encoding="utf-8")
    base = ["simulate", *JOB, "--traces", str(d), "--policies", "ours,on-demand"]
    rc, out, err = run(capsys, *base, "--prices", str(plain))
    assert rc == 0, err
    expected = _table(out)
    rc, out, err = run(capsys, *base, "--prices", str(given))
    assert rc == 0, err
    assert _table(out) == expected


def test_history_hours_the_traces_do_not_hold_is_said_and_never_a_traceback(tmp_path, capsys):
    """Mechanism: ``simulate/history.py:deployment_history`` starts the earlier job at
    ``max(0, offset_ticks - round(hours * 3600 / gap))``: at ``--start-hour 0`` (the default) there is no
    history at all, at ``--start-hour 2`` at most 2 h; yet ``simulate/command.py:run`` prints the header "1
    job(s) after 24 h of history" with figures identical to an empty log, and says nothing. And
    ``--history-hours`` has no upper bound (``_UPPER_BOUNDS`` bounds every other float flag): ``1e306`` makes
    ``round(inf)`` raise ``OverflowError`` inside the replay, outside the command's ``try``: a traceback.

    Expected: the header (or a ``note:``) gives the hours of history actually replayed, or the flag is refused
    past the start hour; a huge value is refused with exit 2 naming ``--history-hours`` and its bound."""
    d = two_zones(tmp_path / "traces")
    base = ["simulate", *JOB, "--traces", str(d), "--spot-price", "1", "--on-demand-price", "3",
            "--policies", "ours"]
    rc, out, err = run(capsys, *base, "--history-hours", "24")
    if rc == 2:
        assert "--history-hours" in err and "Traceback" not in err, err
    else:
        assert rc == 0, err
        said = [line for line in (out + err).splitlines()
                if "history" in line and not line.startswith("job:")]
        header = next(line for line in out.splitlines() if line.startswith("job:"))
        assert said or "after 24 h of history" not in header, (
            f"claims 24 h of history where the traces hold none before the start: {header}")
    rc, out, err = run(capsys, *base, "--history-hours", "1e306")
    assert rc == 2, rc
    assert "--history-hours" in err and "Traceback" not in err, err
