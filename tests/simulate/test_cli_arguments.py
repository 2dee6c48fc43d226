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
        (["--segment-minutes", "0"], "--segment-minutes is the wall-clock length of one segment and must be at least 1"),
        (["--segment-minutes", "0.0001"], "--segment-minutes is the wall-clock length of one segment and must be at "
                                          "least 1"),
        (["--history-hours", "-24"], "--history-hours is how long an earlier job ran before the replayed one and must "
                                     "be >= 0, got -24.0"),
        (["--zones", "mars-1a"], "--zones: zones ['mars-1a'] have no trace"),
        (["--store-region", "mars-1"], "'mars-1' is not a region name like 'us-west-2' (AWS) or 'us-central1' (GCP)"),
        (["--policies", "cheapest"], "unknown simulated controller policy 'cheapest'"),
        # the job's own checks, worded with the flags (JobSpec's field names are for API users)
        (["--deadline-hours", "-5"], "--deadline-hours must be a positive number of hours"),
        (["--deadline-hours", "nan"], "--deadline-hours must be a positive number of hours"),
        (["--work-hours", "0"], "--work-hours must be positive"),
        (["--notice-seconds", "-1"], "--notice-seconds must be >= 0, got -1.0"),
        (["--save-cost-seconds", "-1"], "--save-cost-seconds must be >= 0, got -1.0"),
        (["--restart-overhead-hours", "-1"], "--restart-overhead-hours must be >= 0, got -1.0"),
        (["--nodes", "0"], "--nodes must be a whole number >= 1, got 0"),
        (["--probe-miss", "1"], "--probe-miss is a probability in [0, 1)"),
        # the work (1 h) and one restart (0.2 h, the default) do not fit in the deadline
        (["--deadline-hours", "1.1"], "--deadline-hours 1.1 cannot be met by any policy: the work (--work-hours 1) "
                                      "and one restart (--restart-overhead-hours 0.2) take 1.2 h; the smallest "
                                      "feasible deadline is --deadline-hours 1.2"),
        (["--prices", "p.csv", "--spot-price", "1"], "--prices gives every zone its spot and on-demand price, so "
                                                     "--spot-price would be ignored"),
        (["--prices", "p.csv", "--on-demand-price", "3"], "so --on-demand-price would be ignored"),
        # infinities: no quantity (before, tracebacks, a cryptic "cannot convert float NaN", or silent garbage)
        (["--history-hours", "inf"], "--history-hours must be a finite number, got inf"),
        (["--offsets", "--offset-step-hours", "inf"], "--offset-step-hours must be a finite number, got inf"),
        (["--start-hour", "inf"], "--start-hour must be a finite number, got inf"),
        (["--segment-minutes", "inf"], "--segment-minutes must be a finite number, got inf"),
        (["--spot-price", "inf", "--on-demand-price", "3"], "--spot-price must be a finite number, got inf"),
        (["--transfer-dollars", "inf"], "--transfer-dollars must be a finite number, got inf"),
        (["--checkpoint-gib", "inf", "--transfer-dollars-per-gib", "0.02"], "--checkpoint-gib must be a finite number"),
        # absurd but finite figures: refused naming the flag (1e300 printed 300-digit costs, or was ignored)
        (["--spot-price", "1e300"], "--spot-price is $/h of an instance and must be at most 10,000"),
        (["--on-demand-price", "1e300"], "--on-demand-price is $/h of an instance and must be at most 10,000"),
        (["--spot-price", "10001", "--on-demand-price", "3"], "--spot-price is $/h of an instance and must be at "
                                                               "most 10,000"),
        (["--transfer-dollars", "1e300"], "--transfer-dollars is $ per checkpoint moved across regions and must be "
                                          "at most 10,000, got 1e+300"),
        (["--transfer-dollars-per-gib", "1e300", "--checkpoint-gib", "1"], "--transfer-dollars-per-gib is "
                                                                           "inter-region $ per GiB"),
        # before: "--transfer-seconds must be >= 0, got nan", the wrong flag
        (["--checkpoint-gib", "1e300", "--transfer-dollars-per-gib", "1", "--store-region", "us-east-1"],
         "--checkpoint-gib is the checkpoint's size in GiB (a PiB at most) and must be at most 1,048,576"),
        (["--transfer-seconds-per-gib", "1e300", "--checkpoint-gib", "1"], "--transfer-seconds-per-gib is restore "
                                                                           "seconds per GiB"),
        (["--transfer-seconds", "1e300"], "--transfer-seconds is the extra restart seconds"),
        (["--save-cost-seconds", "1e300"], "--save-cost-seconds is the training stall per checkpoint in seconds"),
        (["--notice-seconds", "1e300"], "--notice-seconds is the preemption notice window in seconds"),
        (["--restart-overhead-hours", "1e300"], "--restart-overhead-hours is the paid hours without progress"),
        (["--segment-minutes", "1e300"], "--segment-minutes is the wall-clock minutes of one segment (a week at "
                                         "most) and must be at most 10,080"),
        (["--jobs", "1000000"], "--jobs is how many jobs of one deployment start together and must be at most 100"),
        # lists that name nothing
        (["--policies", ","], "--policies ',' names no policy; give one or more of: adrs-gepa, fixed-one-zone"),
        (["--zones", ","], "--zones ',' names no zone; give some of us-east-1c"),
        # a job whose replay would run almost wholly past the traces (1e9 h ran for hours)
        (["--work-hours", "1e9"], "--work-hours 1e+09 is more than twice the 177.4 h of traces left from "
                                  "--start-hour 0"),
    ],
)
def test_simulate_rejects_bad_arguments_without_a_traceback(capsys, argv, message):
    if argv[0] == "--work-hours":  # the flag's own value, not the default's
        argv, base = argv[2:], argv[:2]
    else:
        base = ["--work-hours", "1"]
    rc, text = run(capsys, "simulate", *base, *argv)
    assert rc == 2, text
    assert message in text and "Traceback" not in text, text
    assert "_hours" not in text and "_seconds" not in text and "probe_miss" not in text, text  # no Python names
    assert "shorter than the work" not in text, text  # -5 h is not a deadline at all


def test_simulate_unknown_policy_lists_every_valid_one(capsys):
    rc, text = run(capsys, "simulate", "--work-hours", "1", "--policies", "ours,cheapest")
    assert rc == 2 and "unknown simulated controller policy 'cheapest'" in text, text
    valid = text[text.index("valid"):]
    for name in ("hindsight", "on-demand", "ours", "greedy", "rc-cr"):
        assert name in valid, text


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


def test_simulate_names_a_prices_file_it_cannot_use(capsys, tmp_path):
    base = ["simulate", "--work-hours", "1", "--policies", "ours"]
    rc, text = run(capsys, *base, "--prices", str(tmp_path))
    assert rc == 2 and f"--prices {tmp_path} is a folder; give a CSV file" in text, text  # was "does not exist"
    binary = tmp_path / "p.csv"
    binary.write_bytes(b"\xff\xfe\x00")
    rc, text = run(capsys, *base, "--prices", str(binary))
    assert rc == 2 and f"--prices {binary} cannot be read as a CSV text file" in text, text
    zones = ("us-east-1c", "us-east-1f", "us-west-2b", "us-west-2c")
    binary.write_text("".join(f"{z},{'inf' if z == zones[0] else 1},3\n" for z in zones))
    rc, text = run(capsys, *base, "--prices", str(binary))
    assert rc == 2 and "prices must be positive and finite ($/h), got spot inf" in text, text


def test_simulate_refuses_an_implausible_price_in_the_prices_file(capsys, tmp_path):
    prices = tmp_path / "p.csv"
    prices.write_text("zone,spot,on_demand\nus-east-1c,1e300,3\nus-east-1f,1,3\n")
    rc, text = run(capsys, "simulate", "--work-hours", "1", "--policies", "ours", "--prices", str(prices))
    assert rc == 2 and "Traceback" not in text, text
    assert (f"--prices {prices}: zone us-east-1c's spot price is $/h of one instance and must be at most 10,000"
            in text and "fix that zone's line in the file" in text), text
    prices.write_text("zone,spot,on_demand\nus-east-1c,1,20000\n")
    rc, text = run(capsys, "simulate", "--work-hours", "1", "--policies", "ours", "--prices", str(prices))
    assert rc == 2 and "zone us-east-1c's on-demand price is $/h of one instance and must be at most 10,000" in text


def test_simulate_takes_the_largest_plausible_price(capsys):
    rc, text = run(capsys, "simulate", "--work-hours", "1", "--policies", "ours", "--spot-price", "10000",
                   "--on-demand-price", "3")
    assert rc == 0 and "ours" in text, text
