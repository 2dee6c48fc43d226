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
    assert main(["offers", "--gpu-names", "K80"]) == 1  # a GPU the markets know, but the catalog does not sell
    err = capsys.readouterr().err
    assert "after the gpu names filter (--gpu-names ['K80'])" in err and "'A10G'" in err and "'V100'" in err
    assert main(["offers", "--gpus", "3", "--regions", "us-east-1"]) == 1
    err = capsys.readouterr().err
    assert "nothing with 3 GPU(s) per instance in regions ['us-east-1']" in err and "[1, 4, 8] GPUs" in err  # 2: Graviton only
    assert main(["offers", "--regions", "mars-1"]) == 2  # a usage error, as in `estimate`: see below


def test_an_unknown_region_is_a_usage_error_as_in_estimate(capsys):
    # offers exited 1 here ("no offer matches") where estimate exits 2 for the same mistake
    assert main(["offers", "--regions", "mars-1"]) == 2
    err = capsys.readouterr().err
    assert "--regions: regions ['mars-1'] are not in the local backend's catalog; its regions: " in err
    assert "us-west-2" in err and "Traceback" not in err
    assert main(["estimate", "--steps", "100", "--measured", "V100=0.2", "--regions", "mars-1"]) == 2
    assert "estimate: --regions: regions ['mars-1'] are not in the catalog" in capsys.readouterr().err


@pytest.mark.parametrize("zone", ["us-east-1z", "use1-az9"])
def test_an_unknown_zone_is_refused_listing_the_zones(zone, capsys):
    # before: the zone matched no spot offer and the region's on-demand offers were listed, exit 0
    assert main(["offers", "--zones", zone]) == 2
    captured = capsys.readouterr()
    assert "on-demand" not in captured.out and "type " not in captured.out
    assert f"--zones: zones ['{zone}'] are not zones of the local backend's catalog" in captured.err
    assert "'use1-az1'" in captured.err and "leave out --zones to see the zone of each offer" in captured.err


def test_a_zone_outside_the_regions_asked_is_refused(capsys):
    assert main(["offers", "--zones", "use1-az1", "--regions", "us-west-2"]) == 2
    err = capsys.readouterr().err
    assert "--zones: no offer of 1 GPU(s) per instance is in zone(s) ['use1-az1'] in --regions us-west-2" in err
    assert "usw2-az1" in err


def test_a_known_zone_lists_its_spot_offers(capsys):
    assert main(["offers", "--zones", "use1-az4", "--gpus", "8", "--limit", "100"]) == 0
    table = rows(capsys.readouterr().out)
    assert table and {r[1] for r in table if r[2] == "spot"} == {"use1-az4"}


def test_an_ec2_zone_the_market_does_not_have_is_refused(endpoint, capsys):
    options = json.dumps({"spot_prices": "catalog"})
    assert main(["offers", "--backend", "ec2", "--regions", "us-east-1", "--zones", "us-east-1z",
                 "--market-options", options]) == 2
    captured = capsys.readouterr()
    assert "type " not in captured.out
    assert "--zones: no offer of 1 GPU(s) per instance is in zone(s) ['us-east-1z']" in captured.err
    assert "us-east-1a" in captured.err
    assert main(["offers", "--backend", "ec2", "--regions", "us-east-1", "--zones", "us-east-1a",
                 "--market-options", options, "--spot-only"]) == 0
    assert {r[1] for r in rows(capsys.readouterr().out)} == {"us-east-1a"}


def test_bad_inputs_are_refused(endpoint, capsys):
    assert main(["offers", "--backend", "ec2", "--regions", "mars-1"]) == 2
    assert "unknown AWS region" in capsys.readouterr().err
    assert main(["offers", "--backend", "ec2", "--aws-conn-id", "missing"]) == 2
    assert "'missing' is not defined" in capsys.readouterr().err


def test_ec2_offers_print_only_the_table_on_stdout(endpoint, capsys):
    # Airflow's log line of the connection ("credentials retrieved ...") came first on stdout, before the table
    options = json.dumps({"spot_prices": "catalog"})
    assert main(["offers", "--backend", "ec2", "--regions", "us-east-1", "--market-options", options,
                 "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["type", "zone", "market"], out
    assert "credentials retrieved" not in out, out


def test_an_undefined_connection_names_the_flag_for_the_default_chain(endpoint, capsys):
    assert main(["offers", "--backend", "ec2", "--aws-conn-id", "missing"]) == 2
    err = capsys.readouterr().err
    assert "'missing' is not defined" in err and "--aws-conn-id none" in err and "aws_conn_id=None" not in err


def test_aws_conn_id_none_uses_boto3s_default_credential_chain(endpoint, monkeypatch, capsys):
    monkeypatch.delenv("AIRFLOW_CONN_AWS_DEFAULT")  # no connection: the environment alone leads to the server
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # the endpoint fixture sets fake credentials and a region
    options = json.dumps({"spot_prices": "catalog"})
    assert main(["offers", "--backend", "ec2", "--aws-conn-id", "none", "--regions", "us-east-1",
                 "--market-options", options, "--limit", "3"]) == 0
    assert {r[1][:9] for r in rows(capsys.readouterr().out)} == {"us-east-1"}
    assert "'none'" in subcommand_help("offers", capsys)  # documented


def subcommand_help(name: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([name, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["offers", "reap"])
def test_an_empty_connection_id_is_refused(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--backend", "ec2", "--aws-conn-id", ""])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--aws-conn-id must name an Airflow AWS connection" in err and "'none'" in err
    assert "is not defined" not in err


def test_min_memory_has_both_spellings_and_help_shows_one(capsys):
    tables = {}
    for flag in ("--min-memory", "--min-memory-gib"):
        assert main(["offers", flag, "40", "--regions", "us-east-1", "--limit", "1000"]) == 0
        tables[flag] = rows(capsys.readouterr().out)
    assert tables["--min-memory"] == tables["--min-memory-gib"]
    gpus = {r[3].split("x", 1)[1] for r in tables["--min-memory"]}
    assert gpus and gpus.isdisjoint({"T4", "V100", "A10G", "L4"})  # 16-24 GiB GPUs
    text = subcommand_help("offers", capsys)
    assert "--min-memory-gib GIB" in text and "--min-memory GIB" not in text


def test_gpu_names_are_matched_case_insensitively(capsys):
    assert main(["offers", "--gpu-names", "v100", "--regions", "us-east-1", "--spot-only"]) == 0
    table = rows(capsys.readouterr().out)
    assert table and all(r[3] == "1xV100" for r in table)
    assert main(["offers", "--exclude-gpus", "t4,T4G,a10g,l4,l40s", "--regions", "us-east-1", "--limit", "100"]) == 0
    assert {r[3].split("x", 1)[1] for r in rows(capsys.readouterr().out)}.isdisjoint({"T4", "T4g", "A10G", "L4", "L40S"})


@pytest.mark.parametrize("flag", ["--gpu-names", "--exclude-gpus"])
def test_an_unknown_gpu_name_is_a_usage_error_listing_the_valid_ones(flag, capsys):
    assert main(["offers", flag, "FOO"]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: unknown GPU 'FOO'" in err and "valid GPU names: K80, T4," in err and "H200" in err
    assert main(["offers", flag, "V10"]) == 2
    assert "did you mean 'V100'" in capsys.readouterr().err


def test_a_gpu_of_the_markets_throughput_overrides_is_known(capsys):
    options = json.dumps({"throughput_overrides": {"B200": 8.0}})
    assert main(["offers", "--gpu-names", "b200", "--market-options", options]) == 1  # known, but not sold
    assert "(--gpu-names ['B200'])" in capsys.readouterr().err


def test_an_unknown_market_option_names_the_valid_ones(capsys):
    assert main(["offers", "--market-options", '{"nope": 1}']) == 2
    err = capsys.readouterr().err
    assert "--market-options: unknown keys ['nope']" in err and "valid: " in err and "throughput_overrides" in err
    assert "__init__()" not in err


@pytest.mark.parametrize(("argv", "flag", "other"), [
    (["--limit", "0"], "--limit", "--step-seconds"),
    (["--step-seconds", "0"], "--step-seconds", "--limit"),
    (["--step-seconds", "nan"], "--step-seconds", "--limit"),
    (["--step-seconds", "inf"], "--step-seconds", "--limit"),
    (["--step-seconds", "1e300"], "--step-seconds", "--limit"),  # before: $/step of 4.5e+295
])
def test_each_flag_has_its_own_message(argv, flag, other, capsys):
    assert main(["offers", *argv]) == 2
    err = capsys.readouterr().err
    assert f"offers: {flag} " in err and other not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--gpus", "0"], "--gpus is the GPUs per instance and must be at least 1, got 0"),
    (["--min-memory-gib", "-5"], "--min-memory-gib is the GiB of memory per GPU and must be a finite number >= 0"),
    (["--min-memory", "nan"], "--min-memory-gib is the GiB of memory per GPU and must be a finite number >= 0"),
    (["--max-price", "0"], "--max-price is a cap on $/h and must be a finite number > 0 (leave it out for no cap)"),
    (["--max-price", "inf"], "--max-price is a cap on $/h and must be a finite number > 0"),
    (["--max-price", "1e300"], "--max-price is a cap on $/h and must be at most 10,000"),
    (["--step-seconds", "1e300"], "--step-seconds is the seconds one step takes on one V100 and must be at most "
                                  "86,400 (a day), got 1e+300"),
    (["--gpu-names", "V100", "--exclude-gpus", "v100"], "['V100'] are both in --gpu-names and in --exclude-gpus"),
])
def test_request_errors_name_the_flags_not_the_python_fields(argv, message, capsys):
    # GpuRequest's own messages speak of count=, min_memory_gib=, max_price_per_hour=, exclude_names
    assert main(["offers", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "GpuRequest" not in err and "_gib=" not in err and "_per_hour" not in err, err


def test_no_match_names_the_flag_to_relax(capsys):
    assert main(["offers", "--max-price", "0.01"]) == 1
    err = capsys.readouterr().err
    assert "after the price cap filter (--max-price 0.01)" in err and "max_price_per_hour" not in err, err
    assert main(["offers", "--min-memory-gib", "500"]) == 1
    assert "after the gpu memory filter (--min-memory-gib 500.0)" in capsys.readouterr().err
