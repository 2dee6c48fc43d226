"""``airflow-spot offers``: ranked offers with $/h, on-demand $/h, $/step and risk, for ec2 (moto) and local."""
from __future__ import annotations

import json

import pytest

from airflow_spot.cli import main
from airflow_spot.testing import moto_ec2


@pytest.fixture(scope="module")
def endpoint():
    with moto_ec2.moto_ec2() as url:
        yield url


def rows(out: str) -> list[list[str]]:
    lines = out.strip().splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("type ")):]  # after Airflow's log lines
    assert lines[0].split() == ["type", "zone", "market", "gpu", "$/h", "od", "$/h", "$/step", "risk/h"]
    return [line.split() for line in lines[1:] if not line.startswith("...")]


def test_ec2_offers_are_ranked_by_cost_per_step_across_regions(endpoint, capsys):
    prices = {"g5.xlarge@us-west-2b": 0.05}  # the then-cheapest pool, whatever the catalog says
    options = json.dumps({"spot_prices": "catalog", "price_overrides": prices})
    code = main(["offers", "--backend", "ec2", "--gpus", "1", "--min-memory", "16", "--regions", "us-east-1,us-west-2",
                 "--market-options", options, "--limit", "50"])
    assert code == 0
    table = rows(capsys.readouterr().out)
    assert table[0][:3] == ["g5.xlarge", "us-west-2b", "spot"] and float(table[0][4]) == 0.05
    assert {r[1][:9] for r in table} == {"us-east-1", "us-west-2"}
    per_step = [float(r[7]) for r in table]
    assert per_step == sorted(per_step)  # best $/step first


def test_local_offers_come_from_the_bundled_catalog(capsys):
    assert main(["offers", "--gpus", "1", "--gpu-names", "V100", "--regions", "us-east-1", "--spot-only"]) == 0
    table = rows(capsys.readouterr().out)
    assert table and all(r[0] == "p3.2xlarge" and r[2] == "spot" and r[3] == "1xV100" for r in table)


def test_no_match_says_which_constraint_to_relax(endpoint, capsys):
    assert main(["offers", "--backend", "ec2", "--gpus", "1", "--max-price", "0.001",
                 "--market-options", json.dumps({"spot_prices": "catalog"})]) == 1
    err = capsys.readouterr().err
    assert "no offer is left after the price cap filter" in err and "cheapest otherwise matching offer" in err


def test_local_no_match_names_what_the_market_does_have(capsys):
    assert main(["offers", "--gpu-names", "NOPE"]) == 1
    err = capsys.readouterr().err
    assert "after the gpu names filter (names=['NOPE'])" in err and "'A10G'" in err and "'V100'" in err
    assert main(["offers", "--gpus", "3", "--regions", "us-east-1"]) == 1
    err = capsys.readouterr().err
    assert "nothing with 3 GPU(s) per instance in regions ['us-east-1']" in err and "[1, 4, 8] GPUs" in err  # 2: Graviton only
    assert main(["offers", "--regions", "mars-1"]) == 1
    err = capsys.readouterr().err
    assert "nothing in regions ['mars-1']; its regions: [" in err and "'us-west-2'" in err


def test_bad_inputs_are_refused(endpoint, capsys):
    assert main(["offers", "--backend", "ec2", "--regions", "mars-1"]) == 2
    assert "unknown AWS region" in capsys.readouterr().err
    assert main(["offers", "--backend", "ec2", "--aws-conn-id", "missing"]) == 2
    assert "'missing' is not defined" in capsys.readouterr().err
