"""``benchmarks/bench_adrs.py``, the ADRS leaderboard's scenarios replayed, on synthetic trace windows laid
out as the leaderboard ships them (its traces are not in this repository)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_adrs.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_adrs", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_windows(root: Path, bench) -> None:
    # 60 h at 195 s ticks, the SkyPilot simulator's convention (1 = preempted): each zone down for a
    # stretch that depends on the zone and the window, so scenarios differ
    zones = sorted({z for _, zs, _ in bench.SCENARIOS for z in zs})
    for k, zone in enumerate(zones):
        folder = root / f"{zone}_v100_1"
        folder.mkdir(parents=True)
        for w in range(8):
            start = 40 + 37 * ((k + w) % 9)
            data = [1 if start <= i < start + 60 + 10 * w else 0 for i in range(1107)]
            (folder / f"{w}.json").write_text(json.dumps({"metadata": {"gap_seconds": 195}, "data": data}))


def test_score_is_the_leaderboards_formula(bench):
    assert bench.score(bench.OD_ANCHOR) == 0 and bench.score(bench.SPOT_ANCHOR) == 100
    assert bench.score((bench.OD_ANCHOR + bench.SPOT_ANCHOR) / 2) == pytest.approx(50)
    assert bench.score(200.0) == 0  # clipped, as the leaderboard does


def test_missing_windows_are_named(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_adrs.py", "--traces-root", str(tmp_path)])
    with pytest.raises(SystemExit, match="lacks 106 trace windows .*us-east-1a_v100_1/0.json"):
        bench.main()


def test_replays_the_34_jobs_and_writes_each_policys_figures(bench, tmp_path, monkeypatch, capsys):
    write_windows(tmp_path / "traces", bench)
    out = tmp_path / "adrs.json"
    monkeypatch.setattr(sys, "argv", ["bench_adrs.py", "--traces-root", str(tmp_path / "traces"),
                                      "--policies", "ours,adrs-gepa,rc-cr", "--json", str(out)])
    bench.main()
    figures = json.loads(out.read_text())
    assert set(figures["overall"]) == {"ours", "adrs-gepa", "rc-cr", "hindsight"}
    for name, row in figures["overall"].items():
        assert row["jobs"] == 34 and row["deadlines_met"] == 34
        assert row["score"] == pytest.approx(bench.score(row["mean_cost"]))
    for scen, _, n in bench.SCENARIOS:
        by = figures["scenarios"][scen]
        assert all(len(v["costs"]) == n for v in by.values())
        # the optimum knows the future: no policy is cheaper on any job
        for name in ("ours", "adrs-gepa", "rc-cr"):
            assert all(c >= h - 1e-6 for c, h in zip(by[name]["costs"], by["hindsight"]["costs"]))
    assert "adrs-gepa" in capsys.readouterr().out
