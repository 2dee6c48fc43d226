from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_spot.market.traces import TraceError, load_trace, load_traces, parse_trace, read_notes

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


def sim_trace(folder: Path, values, price=None, on_demand=None, prices=None, name="full.json", meta=None):
    """A trace in the SkyPilot simulator's layout: ``<pool>/full.json``, 1 = preempted."""
    folder.mkdir(parents=True, exist_ok=True)
    md = {"gap_seconds": 600, **(meta or {})}
    if price is not None:
        md["price_info"] = {"price": price, "on_demand_price": on_demand}
    doc = {"metadata": md, "data": values}
    if prices is not None:
        doc["prices"] = prices
    return write(folder, name, doc)


def test_the_skypilot_simulators_layout_is_read_flipped_and_priced(tmp_path):
    # the SkyNomad artifact's data/converted_multi_region_aligned*: a folder per pool with full.json and
    # numbered windows; values 1 = preempted; price_info prices the pool
    sim_trace(tmp_path / "us-central1-a_h100_16", [1, 0, 0, 1], price=18.98, on_demand=82.53,
              meta={"zone": "us-central1-a"})
    sim_trace(tmp_path / "us-central1-a_h100_16", [0, 0], price=18.98, on_demand=82.53, name="0.json")
    sim_trace(tmp_path / "us-east-1f_v100_1", [0, 1, 1, 0], price=1.2, on_demand=3.06,
              prices=[1.0, 1.0, 1.2, 1.6])
    a, b = load_traces(tmp_path)  # the pools' full.json, not their windows
    assert (a.zone, a.region, a.values, a.flipped) == ("us-central1-a", "us-central1", (0, 1, 1, 0), True)
    assert (a.spot_price, a.on_demand_price, a.spot_price_range) == (18.98, 82.53, None)
    assert (b.zone, b.instance_type, b.values) == ("us-east-1f", "p3.2xlarge", (1, 0, 0, 1))
    # a per-tick series that varies is kept for the replay, its mean as the pool's price, and said so
    assert b.spot_price == pytest.approx(1.2) and b.spot_price_range == (1.0, 1.6)
    assert b.prices == (1.0, 1.0, 1.2, 1.6) and a.prices is None
    window = load_trace(tmp_path / "us-central1-a_h100_16" / "0.json")
    assert window.values == (1, 1) and window.name == "us-central1-a_h100_16"
    notes = " | ".join(read_notes([a, b]))
    assert "1 = preempted" in notes and "us-central1-a 18.98 / 82.53" in notes and "$1-$1.6/h" in notes
    assert "the price of each tick" in notes
    assert "charges its mean" in " | ".join(read_notes([a, b], tick_prices=False))


def test_a_flat_file_with_price_info_is_the_simulators_convention_too(tmp_path):
    # price_info is what that simulator requires and spot-traces never has: such a file is read flipped
    # wherever it lies; a spot-traces file with a 'prices' series (aws-04-22-2023) is not
    p = write(tmp_path, "us-west-2a_v100_1.json", {"metadata": {"gap_seconds": 60, "price_info": {
        "price": 1.0, "on_demand_price": 3.06}}, "data": [1, 0, 0]})
    assert load_trace(p).values == (0, 1, 1)
    q = write(tmp_path, "us-west-2b_v100_1.json", {"metadata": {"gap_seconds": 60}, "data": [1, 0, 0],
                                                   "prices": [0.918, 0.918, 0.918]})
    t = load_trace(q)
    assert (t.values, t.flipped, t.spot_price) == ((1, 0, 0), False, None)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"metadata": {"gap_seconds": 600}, "data": [0, 2]}, r"1 \(preempted\) or 0 \(available\)"),
        ({"metadata": {"gap_seconds": 600, "price_info": {"price": -1, "on_demand_price": 3}}, "data": [0, 1]},
         "price_info.price must be a positive"),
        ({"metadata": {"gap_seconds": 600}, "data": [0, 1], "prices": [1.0]}, "one positive"),
    ],
)
def test_bad_simulator_traces_get_a_clear_error(tmp_path, doc, message):
    folder = tmp_path / "us-east-2a_v100_1"
    folder.mkdir()
    p = write(folder, "full.json", doc)
    with pytest.raises(TraceError, match=message) as exc:
        load_trace(p)
    assert "us-east-2a_v100_1" in str(exc.value)


def test_an_empty_directory_names_both_layouts(tmp_path):
    with pytest.raises(TraceError, match="full.json"):
        load_traces(tmp_path)
