"""Bad arguments of ``simulate`` and ``reap``, tried as a new user would: exit code 2 and one line that says
what is wrong and how to fix it, never a traceback, and nothing touched."""
from __future__ import annotations

import json

import pytest

from airflow_spot.cli import main


def run(capsys, *argv: str) -> tuple[int | None, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's own errors (a bad type) exit 2 with a usage line
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.err + captured.out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--spot-price", "-1"], "--spot-price is $/h of an instance and must be > 0, got -1.0"),
        (["--on-demand-price", "nan"], "--on-demand-price is $/h of an instance and must be > 0, got nan"),
        (["--start-hour", "-3"], "--start-hour must be >= 0"),
        (["--start-hour", "100000"], "--start-hour 100000 is past the end of the traces"),
        (["--offsets", "--offset-step-hours", "0"], "--offset-step-hours must be > 0"),
        (["--segment-minutes", "0"], "--segment-minutes is the wall-clock length of one segment and must be > 0"),
        (["--history-hours", "-24"], "--history-hours is how long an earlier job ran before the replayed one and must "
                                     "be >= 0, got -24.0"),
        (["--zones", "mars-1a"], "zones ['mars-1a'] have no trace"),
        (["--store-region", "mars-1"], "'mars-1' is not a region name like 'us-west-2' (AWS) or 'us-central1' (GCP)"),
        (["--policies", "cheapest"], "unknown simulated controller policy 'cheapest'"),
    ],
)
def test_simulate_rejects_bad_arguments_without_a_traceback(capsys, argv, message):
    rc, text = run(capsys, "simulate", "--work-hours", "1", *argv)
    assert rc == 2, text
    assert message in text and "Traceback" not in text, text


def test_reap_bad_durations_name_their_own_flag(capsys):
    rc, text = run(capsys, "reap", "--purge-older-than", "-5", "--dry-run")
    assert rc == 2 and "--purge-older-than must be >= 0 (a duration), got '-5'" in text, text
    rc, text = run(capsys, "reap", "--older-than", "a week", "--dry-run")
    assert rc == 2 and "--older-than wants a duration in seconds or with a unit (e.g. 3600, 90s, 30m" in text, text


def test_reap_accepts_durations_with_units(capsys, tmp_path):
    options = json.dumps({"state_dir": str(tmp_path / "state")})
    rc, text = run(capsys, "reap", "--backend-options", options, "--older-than", "2h", "--dry-run")
    assert rc == 0 and "no live instances match" in text, text


def test_reap_unknown_backend_option_lists_the_valid_ones(capsys, tmp_path):
    rc, text = run(capsys, "reap", "--backend-options", json.dumps({"state-dir": str(tmp_path)}), "--dry-run")
    assert rc == 2 and "Traceback" not in text, text
    assert "backend 'local' takes no option(s) ['state-dir']; its options are:" in text and "state_dir" in text, text
