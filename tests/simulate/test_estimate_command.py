from __future__ import annotations

import json
import sys

import pytest

from airflow_spot.cli import main
from airflow_spot.simulate.estimate_command import EstimateError, profile_step_seconds


def test_estimate_lists_offers_cheapest_first_with_an_uncertainty(capsys):
    assert main(["estimate", "--steps", "36000", "--measured", "V100=0.5", "--regions", "us-west-2", "--top", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step time fit: t = 0.5000 s")
    rows = out[2:7]
    costs = [float(line.split()[-2]) for line in rows]
    assert len(costs) == 5 and costs == sorted(costs)
    assert all(line.split()[-1].endswith("%") for line in rows)


def test_estimate_json_scales_the_measured_gpu_to_the_others(capsys):
    assert main(["estimate", "--steps", "3600", "--measured", "T4=1.0", "--json", "--top", "200"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    t4 = next(r for r in ranked if r["gpu_name"] == "T4")
    a10g = next(r for r in ranked if r["gpu_name"] == "A10G")
    assert t4["hours"] == pytest.approx(1.0) and t4["uncertainty"] == pytest.approx(0.05)
    assert a10g["hours"] == pytest.approx(0.40 / 0.90, rel=1e-4)  # relative throughputs of T4 and A10G
    assert a10g["uncertainty"] > t4["uncertainty"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "10", "--measured", "Z80=1"], "unknown GPU 'Z80'"),
        (["--steps", "10", "--measured", "V10=1"], "unknown GPU 'V10' (did you mean 'V100'?); valid GPU names: K80"),
        (["--steps", "10", "--profile-command", "python x.py", "--profile-as", "Z80"], "--profile-as: unknown GPU 'Z80'"),
        (["--steps", "10", "--measured", "V100"], "expected GPU=SECONDS"),
        (["--steps", "10", "--measured", "V100=fast"], "is not a number"),
        (["--steps", "10", "--measured", "V100=-1"], "must be a positive, finite number, got -1"),
        (["--steps", "10", "--measured", "V100=inf"], "must be a positive, finite number, got inf"),
        (["--steps", "10", "--measured", "V100=0.2", "--measured", "v100=0.3"], "--measured gives V100 twice (0.2 and "
                                                                                 "0.3 s); give one figure per GPU"),
        (["--steps", "10", "--measured", "V100=0.2", "--profile-as", "T4"], "no --profile-command was given"),
        (["--steps", "10", "--profile-command", " ", "--profile-as", "T4"], "--profile-command is empty"),
        (["--steps", "10", "--profile-command", "python 'x.py", "--profile-as", "T4"],
         "cannot be split into words (No closing quotation)"),
        (["--steps", "10", "--profile-command", "true", "--profile-as", "T4", "--profile-timeout", "nan"],
         "--profile-timeout is the seconds the profiling run may take and must be > 0, got nan"),
        (["--steps", "10", "--measured", "V100=1", "--restart-overhead-seconds", "inf"],
         "--restart-overhead-seconds is the time a new instance works for nothing and must be a finite number >= 0"),
        (["--steps", "0", "--measured", "V100=1"], "--steps must be a positive"),
        (["--steps", "10"], "give a step time"),
        (["--steps", "10", "--profile-command", "python x.py"], "needs --profile-as"),
        (["--steps", "10", "--profile-command", "no-such-program-xyz", "--profile-as", "T4"], "not found on PATH"),
        (["--steps", "10", "--measured", "V100=1", "--gpus", "0"], "--gpus must be at least 1"),
        (["--steps", "10", "--measured", "V100=1", "--top", "0"], "--top is how many offers to show and must be"),
        (["--steps", "10", "--measured", "V100=1", "--restart-overhead-seconds", "-5"],
         "--restart-overhead-seconds is the time a new instance works for nothing and must be a finite number >= 0, "
         "got -5.0"),
        (["--steps", "10", "--measured", "V100=1", "--min-memory-gib", "-1"], "--min-memory-gib must be >= 0"),
        # absurd but finite figures (before: costs and hours hundreds of digits long, exit 0)
        (["--steps", "10", "--measured", "V100=1e300"], "--measured 'V100=1e300': seconds per step must be at most "
                                                        "86,400 (a day), got 1e+300"),
        (["--steps", "10", "--measured", "V100=1", "--restart-overhead-seconds", "1e300"],
         "--restart-overhead-seconds is the time a new instance works for nothing and must be at most 86,400"),
        (["--steps", str(10 ** 30), "--measured", "V100=0.2"], "would take 2.78e+25 hours even on its fastest offer, "
                                                               "more than 100,000 (about 11 years): check --steps"),
        # what the catalog does have, so the user can choose what to loosen
        (["--steps", "10", "--measured", "V100=1", "--gpus", "3", "--regions", "us-east-1"],
         "no offer has 3 GPU(s) with >= 0 GiB each in regions ['us-east-1']; instances there have [1, 4, 8] GPUs"),
    ],
)
def test_estimate_bad_arguments_say_what_to_fix(capsys, argv, message):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_the_fit_line_spells_its_exponent_once(capsys):
    # equal step times on two GPUs fit an exponent of 0; a faster GPU measured slower, a positive one
    assert main(["estimate", "--steps", "10", "--measured", "V100=0.2", "--measured", "H100=0.2", "--top", "1"]) == 0
    out = capsys.readouterr()
    assert "x throughput^0.00" in out.out and "warning" not in out.err
    assert main(["estimate", "--steps", "10", "--measured", "V100=0.2", "--measured", "H100=0.5", "--top", "1"]) == 0
    out = capsys.readouterr()
    assert "x throughput^0.66" in out.out and "faster GPUs are slower" in out.err  # said, not silently ranked


def test_two_gpu_models_of_one_throughput_both_count(capsys):
    # T4 and T4g share a throughput figure: the fit takes both measurements (their log-mean), not the last
    assert main(["estimate", "--steps", "3600", "--measured", "T4=0.5", "--measured", "T4g=2.0", "--json",
                 "--top", "200"]) == 0
    t4 = next(r for r in json.loads(capsys.readouterr().out) if r["gpu_name"] == "T4")
    assert t4["hours"] == pytest.approx(1.0)  # sqrt(0.5 * 2.0) s x 3600 steps


def test_gpu_names_are_matched_case_insensitively(capsys):
    assert main(["estimate", "--steps", "3600", "--measured", "V100=0.5", "--json", "--top", "300"]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert main(["estimate", "--steps", "3600", "--measured", "v100=0.5", "--json", "--top", "300"]) == 0
    assert json.loads(capsys.readouterr().out) == exact
    # --profile-as is checked before the profiling run starts: a known name in any case gets that far
    assert main(["estimate", "--steps", "10", "--profile-command", "no-such-program-xyz", "--profile-as", "t4g"]) == 2
    assert "not found on PATH" in capsys.readouterr().err


def test_min_memory_has_both_spellings_and_help_shows_one(capsys):
    import argparse

    from airflow_spot.simulate import estimate_command

    # a real alias, not argparse's prefix matching (which another --min-memory-* flag would make ambiguous)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    estimate_command.add_arguments(parser)
    base = ["--steps", "10", "--measured", "V100=1"]
    assert parser.parse_args([*base, "--min-memory", "40"]).min_memory_gib == 40.0
    assert parser.parse_args([*base, "--min-memory-gib", "40"]).min_memory_gib == 40.0
    assert parser.parse_args(base).min_memory_gib == 0.0
    text = " ".join(parser.format_help().split())
    assert "--min-memory-gib GIB minimum memory per GPU" in text and "--min-memory GIB" not in text
    assert main(["estimate", *base, "--min-memory", "-1"]) == 2
    assert "--min-memory-gib must be >= 0" in capsys.readouterr().err


def test_profiling_measures_a_real_training_run_past_its_warm_up():
    cmd = [sys.executable, "-m", "airflow_spot.examples.train_tiny", "--total-steps", "120", "--step-sleep", "0.02"]
    seconds = profile_step_seconds(cmd, 120, warmup_steps=20, timeout=300)
    # 20 ms of sleep per step plus a tiny model's compute: well under 0.2 s on any machine
    assert 0.02 <= seconds < 0.2


def test_profiling_reports_a_failing_command():
    with pytest.raises(EstimateError, match="exited 3"):
        profile_step_seconds([sys.executable, "-c", "import sys; sys.exit(3)"], 50, timeout=60)
