from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_spot.market.traces import TraceError, load_trace, load_traces, parse_trace

SHARED_TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "spot-traces"
PREEMPTION = SHARED_TRACES / "preemption" / "1-node" / "aws-04-22-2023"


def write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


@pytest.mark.parametrize(
    "doc, message",
    [
        ([0, 1], "JSON object"),
        ({"data": [0, 1]}, "gap_seconds"),
        ({"metadata": {"gap_seconds": 0}, "data": [0, 1]}, "positive"),
        ({"metadata": {"gap_seconds": "32"}, "data": [0, 1]}, "positive"),
        ({"metadata": {"gap_seconds": 32}, "data": "0101"}, "list"),
        ({"metadata": {"gap_seconds": 32}, "data": [1]}, "at least 2"),
        ({"metadata": {"gap_seconds": 32}, "data": [0, 1, 2]}, r"data\[2\] is 2"),
        ({"metadata": {"gap_seconds": 32}, "data": [0, True]}, r"data\[1\]"),
    ],
)
def test_bad_trace_files_get_a_clear_error(tmp_path, doc, message):
    p = write(tmp_path, "us-west-2b_v100_1.json", doc)
    with pytest.raises(TraceError, match=message) as exc:
        load_trace(p)
    assert "us-west-2b_v100_1" in str(exc.value)


def test_not_json_missing_file_and_unknown_zone(tmp_path):
    p = tmp_path / "us-west-2b_v100_1.json"
    p.write_text("{nope")
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(p)
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "absent.json")
    q = write(tmp_path, "mytrace.json", {"metadata": {"gap_seconds": 60}, "data": [1, 0]})
    with pytest.raises(TraceError, match="cannot tell the zone"):
        load_trace(q)
    assert load_trace(q, zone="eu-west-1a").region == "eu-west-1"


def test_gcp_and_govcloud_zone_names_give_their_region(tmp_path):
    # skypilot-org/spot-traces also holds GCP preemption traces, named '<zone>_<machine type>.json'
    p = write(tmp_path, "us-central1-a_c3-88.json", {"metadata": {"gap_seconds": 30}, "data": [1, 1, 0]})
    t = load_trace(p)
    assert (t.zone, t.region, t.gpu_count, t.instance_type) == ("us-central1-a", "us-central1", 0, None)
    assert load_trace(p, zone="europe-west4-b").region == "europe-west4"
    assert load_trace(p, zone="us-gov-west-1a").region == "us-gov-west-1"  # AWS GovCloud
    with pytest.raises(TraceError, match="not a zone name like 'us-west-2b'"):
        load_trace(p, zone="uscentral1")


def test_a_directory_with_several_pools_per_zone_says_which_and_how_to_pick_one(tmp_path):
    # like availability/1-node/aws-10-26-2022: K80 and V100, one and eight GPUs, in each zone
    for zone in ("us-west-2a", "us-west-2b"):
        for kind in ("k80_1", "v100_1"):
            write(tmp_path, f"{zone}_{kind}.json", {"metadata": {"gap_seconds": 60}, "data": [1, 0]})
    with pytest.raises(TraceError) as exc:
        load_traces(tmp_path)
    msg = str(exc.value)
    assert "us-west-2a: k80_1, v100_1" in msg and "one pool per zone" in msg
    example = msg.split("--traces ")[1]
    assert [t.zone for t in load_traces(example.split(","))] == ["us-west-2a", "us-west-2b"]


def test_parse_counts_preemptions_and_mtbf():
    t = parse_trace({"metadata": {"gap_seconds": 60}, "data": [1, 1, 0, 1, 1, 1, 0, 0, 1, 1]}, "us-east-1c_v100_1.json")
    assert (t.zone, t.region, t.instance_type) == ("us-east-1c", "us-east-1", "p3.2xlarge")
    assert t.preemptions() == 2
    assert t.mtbf_seconds() == 300.0
    assert t.mean_up_seconds() == 150.0
    assert t.up_fraction() == 0.7
    assert t.up_at(0) and not t.up_at(120) and not t.up_at(10_000)


def test_directory_needs_one_gap_and_one_trace_per_zone(tmp_path):
    write(tmp_path, "us-east-1c_v100_1.json", {"metadata": {"gap_seconds": 60}, "data": [1, 0]})
    write(tmp_path, "us-east-1f_v100_1.json", {"metadata": {"gap_seconds": 30}, "data": [1, 0]})
    with pytest.raises(TraceError, match="different gap_seconds"):
        load_traces(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match="no \\*.json"):
        load_traces(empty)


@pytest.mark.skipif(not PREEMPTION.is_dir(), reason=f"shared spot traces not found at {PREEMPTION}")
def test_real_preemption_traces_match_the_data_readme():
    traces = load_traces(PREEMPTION)
    assert sorted(t.zone for t in traces) == ["us-east-1c", "us-east-1f", "us-west-2b", "us-west-2c"]
    for t in traces:
        assert t.gap_seconds == 32 and len(t.values) == 19961
        assert 2.95 * 3600 <= t.mtbf_seconds() <= 4.35 * 3600  # README: 3.0-4.3 h (rounded)
        assert 0.31 <= t.up_fraction() <= 0.80


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason=f"shared spot traces not found at {SHARED_TRACES}")
def test_bundled_traces_are_the_shared_ones_and_load():
    from airflow_spot.market.traces import PREEMPTION_TRACES_SUBDIR, default_traces_dir

    bundled = default_traces_dir()
    shared = sorted(p.relative_to(SHARED_TRACES) for p in SHARED_TRACES.rglob("*.json"))
    assert sorted(p.relative_to(bundled) for p in bundled.rglob("*.json")) == shared
    assert all((bundled / rel).read_bytes() == (SHARED_TRACES / rel).read_bytes() for rel in shared)
    zones = sorted(t.zone for t in load_traces(bundled / PREEMPTION_TRACES_SUBDIR))
    assert zones == ["us-east-1c", "us-east-1f", "us-west-2b", "us-west-2c"]
