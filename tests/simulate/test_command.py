from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from airflow_spot.cli import main

PREEMPTION = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "spot-traces" / "preemption" / "1-node" / "aws-04-22-2023"


def write_trace(d: Path, zone: str, values: list[int]) -> Path:
    p = d / f"{zone}_v100_1.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": values}))
    return p


def test_simulate_prints_table_distribution_png_and_json(tmp_path, capsys):
    write_trace(tmp_path, "us-west-2b", ([1] * 50 + [0] * 10) * 6)
    write_trace(tmp_path, "us-west-2c", ([0] * 20 + [1] * 40) * 6)
    png, js = tmp_path / "out.png", tmp_path / "out.json"
    rc = main(["simulate", "--work-hours", "1", "--deadline-hours", "1.5", "--restart-overhead-hours", "0.05",
               "--traces", str(tmp_path), "--spot-price", "1", "--on-demand-price", "3", "--offsets",
               "--offset-step-hours", "0.5", "--png", str(png), "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("ours", "greedy", "on-demand", "fixed-one-zone", "up-any-zone", "rc-cr"):
        assert name in out
    assert "start offsets" in out and png.stat().st_size > 1000
    data = json.loads(js.read_text())
    assert {d["policy"] for d in data["distributions"]} >= {"ours", "on-demand"}
    assert all(d["deadline_met"] == d["runs"] for d in data["distributions"] if d["policy"] == "on-demand")


def test_simulate_reports_bad_input(tmp_path, capsys):
    (tmp_path / "us-west-2b_v100_1.json").write_text('{"metadata": {"gap_seconds": 60}, "data": [1, 1.5]}')
    assert main(["simulate", "--work-hours", "1", "--traces", str(tmp_path), "--spot-price", "1",
                 "--on-demand-price", "3"]) == 2
    assert "data[1] is 1.5" in capsys.readouterr().err  # counts 0..N are valid (multi-node), fractions not
    assert main(["simulate", "--work-hours", "2", "--deadline-hours", "1", "--traces", str(tmp_path)]) == 2
    assert "cannot be met by any policy" in capsys.readouterr().err


def test_simulate_says_when_a_replay_runs_past_the_traces_or_its_store_has_no_zone(tmp_path, capsys):
    # two hours of an always-up pool: a 1 h job fits, a 3 h job's last hour is past the traces (every pool
    # counts as down there), and the note says so instead of passing that hour off as the policy's choice
    (tmp_path / "us-west-2b_v100_1.json").write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [1] * 120}))
    base = ["simulate", "--traces", str(tmp_path), "--spot-price", "1", "--on-demand-price", "3",
            "--policies", "ours,on-demand", "--restart-overhead-hours", "0"]
    assert main(base + ["--work-hours", "1"]) == 0
    assert "note:" not in capsys.readouterr().out
    assert main(base + ["--work-hours", "3", "--deadline-hours", "3.5"]) == 0
    out = capsys.readouterr().out
    # on-demand reads no trace, so only ours is named
    assert "note: ours ran past the end of the traces (hour 2.0; this job started at hour 0)" in out
    spot_h, od_h = (float(x) for x in next(x for x in out.splitlines() if x.startswith("ours")).split()[-2:])
    assert spot_h == pytest.approx(2.0, abs=0.1) and od_h > 0.9  # the hour past the end ran on-demand
    assert main(base + ["--work-hours", "3"]) == 0  # without a deadline it waits there for spot: unfinished
    assert "ours ran past the end" in capsys.readouterr().out
    assert main(base + ["--work-hours", "1", "--store-region", "us-east-1"]) == 0
    assert "no zone of the traces is in the store's region us-east-1" in capsys.readouterr().out


@pytest.mark.skipif(not PREEMPTION.is_dir(), reason=f"shared spot traces not found at {PREEMPTION}")
def test_reference_job_on_the_real_traces(capsys):
    rc = main(["simulate", "--work-hours", "48", "--deadline-hours", "52", "--restart-overhead-hours", "0.2",
               "--spot-price", "0.9731", "--on-demand-price", "3.06", "--policies", "ours,greedy,on-demand"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "MISSED" not in out


def test_simulate_replays_gcp_traces_and_asks_for_prices_the_catalog_lacks(tmp_path, capsys):
    # the GCP traces of skypilot-org/spot-traces are named '<zone>_<machine type>.json'
    for zone, values in (("us-central1-a", [1] * 100 + [0] * 20), ("us-east1-b", [0] * 30 + [1] * 90)):
        (tmp_path / f"{zone}_c3-88.json").write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": values}))
    argv = ["simulate", "--work-hours", "1", "--deadline-hours", "1.8", "--restart-overhead-hours", "0.05",
            "--traces", str(tmp_path), "--policies", "ours,rc-cr,hindsight"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "us-central1" in err and "--on-demand-price" in err and "--prices" in err
    assert main(argv + ["--spot-price", "1", "--on-demand-price", "3"]) == 0
    out = capsys.readouterr().out
    assert "zones us-central1-a, us-east1-b" in out and "MISSED" not in out


def test_simulate_replays_the_skypilot_simulators_traces_at_their_own_prices(tmp_path, capsys):
    # the SkyNomad artifact's layout: <pool>/full.json, 1 = preempted, prices in metadata.price_info
    pools = {"us-central1-a_h100_16": ([0] * 100 + [1] * 20, 18.98, 82.53),
             "asia-south2-b_h100_16": ([0] * 120, 69.91, 99.12)}
    for pool, (values, spot, od) in pools.items():
        (tmp_path / pool).mkdir()
        (tmp_path / pool / "full.json").write_text(json.dumps({
            "metadata": {"gap_seconds": 60, "price_info": {"price": spot, "on_demand_price": od}}, "data": values}))
    argv = ["simulate", "--work-hours", "1", "--deadline-hours", "1.8", "--restart-overhead-hours", "0.05",
            "--traces", str(tmp_path), "--policies", "ours,rc-cr,hindsight"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1 = preempted" in out and "asia-south2-b 69.91 / 99.12" in out and "MISSED" not in out
    table = out[out.index("job:"):]
    # the same figures as a prices file with the files' prices
    prices = tmp_path / "prices.csv"
    prices.write_text("us-central1-a,18.98,82.53\nasia-south2-b,69.91,99.12\n")
    assert main(argv + ["--prices", str(prices)]) == 0
    again = capsys.readouterr().out
    assert again[again.index("job:"):] == table


def _traces(d: Path) -> Path:
    """Two zones, ten hours of one-minute ticks."""
    d.mkdir(exist_ok=True)
    write_trace(d, "us-west-2b", ([1] * 50 + [0] * 10) * 10)
    write_trace(d, "us-west-2c", ([0] * 20 + [1] * 40) * 10)
    return d


def _no_replay(monkeypatch):
    """Fail the test if a replay starts: the checks must come first."""
    import airflow_spot.simulate.command as command

    def replay(*args, **kwargs):
        raise AssertionError("replayed before the arguments were checked")

    for name in ("run_policies", "run_one", "distribution", "hindsight_distribution"):
        monkeypatch.setattr(command, name, replay)


def test_output_paths_are_checked_before_the_replay_and_json_and_png_alike(tmp_path, capsys, monkeypatch):
    traces = _traces(tmp_path / "traces")
    base = ["simulate", "--work-hours", "1", "--deadline-hours", "1.5", "--restart-overhead-hours", "0.05",
            "--traces", str(traces), "--spot-price", "1", "--on-demand-price", "3", "--policies", "ours,on-demand"]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with monkeypatch.context() as m:
        _no_replay(m)
        for flag, name in (("--json", "x.json"), ("--png", "x.png")):
            # a parent that is a file: refused at once (rc 2, one line), nothing replayed or written
            assert main(base + ["--offsets", flag, str(blocker / "sub" / name)]) == 2
            err = capsys.readouterr().err
            assert f"{flag} {blocker / 'sub' / name} cannot be written: {blocker} is a file, not a folder" in err
            assert "Traceback" not in err
            assert main(base + [flag, str(tmp_path)]) == 2  # a folder is no file
            assert f"{flag} {tmp_path} is a folder; give a file path" in capsys.readouterr().err
        assert main(base + ["--json", str(tmp_path / "x"), "--png", str(tmp_path / "x")]) == 2
        assert "--png and --json both name" in capsys.readouterr().err
    assert blocker.read_text() == ""
    # missing folders are created for both, and both say where they wrote
    js, png = tmp_path / "new" / "deep" / "x.json", tmp_path / "other" / "x.png"
    assert main(base + ["--json", str(js), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {js}" in out and f"wrote {png}" in out
    assert json.loads(js.read_text())["runs"] and png.stat().st_size > 1000
    assert main(base + ["--json", str(tmp_path / "only" / "y.json")]) == 0
    assert f"wrote {tmp_path / 'only' / 'y.json'}" in capsys.readouterr().out


def test_an_offsets_window_longer_than_the_traces_is_refused_before_the_replay(tmp_path, capsys, monkeypatch):
    traces = _traces(tmp_path / "traces")
    _no_replay(monkeypatch)
    assert main(["simulate", "--work-hours", "9", "--deadline-hours", "12", "--traces", str(traces),
                 "--spot-price", "1", "--on-demand-price", "3", "--offsets"]) == 2
    assert "are shorter than the job's window" in capsys.readouterr().err


def test_a_deadline_no_policy_can_meet_is_refused_with_the_smallest_feasible_one(tmp_path, capsys, monkeypatch):
    traces = _traces(tmp_path / "traces")
    base = ["simulate", "--work-hours", "2", "--restart-overhead-hours", "0.05", "--traces", str(traces),
            "--spot-price", "1", "--on-demand-price", "3", "--policies", "ours,on-demand,hindsight"]
    with monkeypatch.context() as m:
        _no_replay(m)
        # deadline = the work: every policy would miss it and the optimum would cost `inf`
        assert main(base + ["--deadline-hours", "2"]) == 2
        err = capsys.readouterr().err
        assert ("--deadline-hours 2 cannot be met by any policy: the work (--work-hours 2) and one restart "
                "(--restart-overhead-hours 0.05) take 2.05 h; the smallest feasible deadline is --deadline-hours 2.05"
                in err), err
    # the work and one restart fit, but not the checkpoint stalls: on-demand from the start misses it, which
    # is said (the optimum leaves the stalls out); not refused, since a policy saving less often may still fit
    assert main(base + ["--deadline-hours", "2.05"]) == 0
    err = capsys.readouterr().err
    assert "warning: on-demand from the start, never preempted, finishes at" in err, err
    assert "after --deadline-hours 2.05" in err and "--save-cost-seconds 10" in err, err
    least = float(err.rsplit("--deadline-hours ", 1)[1].split()[0])
    assert 2.05 < least < 2.1
    assert main(base + ["--deadline-hours", str(least)]) == 0
    out = capsys.readouterr().out
    assert "MISSED" not in next(line for line in out.splitlines() if line.startswith("on-demand"))


def _no_inf_or_nan(text: str) -> None:
    assert not re.search(r"\b(inf|nan|None)\b", text, re.IGNORECASE), text


def test_the_hindsight_optimum_never_prints_inf_or_nan_nor_claims_an_infeasible_deadline(tmp_path, capsys):
    traces = _traces(tmp_path / "traces")
    base = ["simulate", "--traces", str(traces), "--spot-price", "1", "--on-demand-price", "3",
            "--policies", "ours,on-demand,hindsight", "--offsets", "--offset-step-hours", "2"]
    # feasible: the hindsight row shows its cost, and '-' where it has no figure (no nan)
    assert main(base + ["--work-hours", "1", "--deadline-hours", "1.5", "--restart-overhead-hours", "0.05"]) == 0
    out = capsys.readouterr().out
    _no_inf_or_nan(out)
    row = next(line for line in out.splitlines() if line.startswith("hindsight")).split()
    assert row[3] == "1.000" and row[5] == "met" and row[-4:] == ["-", "-", "-", "-"]
    # on-demand meets a 1.14 h deadline for 1.06 h of work, but the optimum's 0.1 h grid rounds the work
    # and the restart up (1.1 h + 0.1 h) past the deadline (1.1 h): it finds no schedule
    js = tmp_path / "out.json"
    assert main(base + ["--work-hours", "1.06", "--deadline-hours", "1.14", "--restart-overhead-hours", "0.01",
                        "--json", str(js)]) == 0
    out = capsys.readouterr().out
    _no_inf_or_nan(out)
    assert "hindsight optimum: infeasible" in out and "found no schedule meeting the deadline" in out
    row = next(line for line in out.splitlines() if line.startswith("hindsight")).split()
    assert row[1] == "infeasible" and "met" not in row, row
    assert "x hindsight" not in out  # nothing to divide by
    assert "met" in next(line for line in out.splitlines() if line.startswith("on-demand")).split()
    dist = next(line for line in out.split("start offsets")[1].splitlines() if line.startswith("hindsight")).split()
    assert dist[2] == "-" and dist[-3] == f"0/{dist[1]}", dist  # no mean, and no deadline claimed met
    run = next(r for r in json.loads(js.read_text())["runs"] if r["policy"] == "hindsight")  # strict JSON
    assert run["cost"] is None and run["deadline_met"] is None


def test_without_a_deadline_the_header_says_so_and_hindsight_asks_for_one(tmp_path, capsys):
    traces = _traces(tmp_path / "traces")
    base = ["simulate", "--work-hours", "1", "--traces", str(traces), "--spot-price", "1", "--on-demand-price", "3"]
    assert main(base + ["--policies", "ours,on-demand", "--offsets", "--offset-step-hours", "2"]) == 0
    out = capsys.readouterr().out
    assert "no deadline" in out and "hindsight" not in out
    _no_inf_or_nan(out)
    assert main(base + ["--policies", "ours,hindsight"]) == 2
    assert "the hindsight optimum needs a deadline: pass --deadline-hours" in capsys.readouterr().err


def test_prices_file_zones_without_a_trace_are_named_on_stderr(tmp_path, capsys):
    traces = _traces(tmp_path / "traces")
    prices = tmp_path / "prices.csv"
    prices.write_text("us-west-2b,1,3\nus-west-2c,1.1,3\nus-west-2a,0.5,3\neu-west-1a,0.4,3\n")
    argv = ["simulate", "--work-hours", "1", "--traces", str(traces), "--prices", str(prices),
            "--policies", "ours,on-demand"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "no trace covers" in line]
    assert len(warning) == 1 and "eu-west-1a, us-west-2a" in warning[0], err
    # zones the traces have but --zones leaves out are not the file's mistake
    prices.write_text("us-west-2b,1,3\nus-west-2c,1.1,3\n")
    assert main(argv + ["--zones", "us-west-2b"]) == 0
    assert "no trace covers" not in capsys.readouterr().err
    assert main(argv + ["--spot-price", "2"]) == 2
    assert "--spot-price would be ignored" in capsys.readouterr().err


def test_spot_priced_above_on_demand_warns_on_stderr(tmp_path, capsys):
    traces = _traces(tmp_path / "traces")
    base = ["simulate", "--work-hours", "1", "--traces", str(traces), "--policies", "ours,on-demand"]
    assert main(base + ["--spot-price", "5", "--on-demand-price", "3"]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "spot is priced above on-demand" in line]
    assert len(warning) == 1 and "us-west-2b, us-west-2c (spot $5/h, on-demand $3/h)" in warning[0], err
    assert main(base + ["--spot-price", "1", "--on-demand-price", "3"]) == 0
    assert "above on-demand" not in capsys.readouterr().err
    prices = tmp_path / "prices.csv"
    prices.write_text("us-west-2b,1,3\nus-west-2c,4,3\n")
    assert main(base + ["--prices", str(prices)]) == 0
    err = capsys.readouterr().err
    assert "above on-demand for zones us-west-2c (spot $4/h" in err and "us-west-2b" not in err, err
