from __future__ import annotations

import json
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
    assert "shorter than the work" in capsys.readouterr().err


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
