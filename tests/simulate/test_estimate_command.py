from __future__ import annotations

from airflow_spot.cli import main


def test_estimate_lists_offers_cheapest_first(capsys):
    assert main(["estimate", "--steps", "36000", "--measured", "V100=0.5", "--regions", "us-west-2", "--top", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step time fit: t = 0.500 s")
    costs = [float(line.split()[-1]) for line in out[2:]]
    assert len(costs) == 5 and costs == sorted(costs)


def test_estimate_bad_input(capsys):
    assert main(["estimate", "--steps", "10", "--measured", "Z80=1"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert main(["estimate", "--steps", "10"]) == 2
    assert "at least one" in capsys.readouterr().err
