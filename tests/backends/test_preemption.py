"""The preemption injector: pure planning (schedule, rate, trace) and the notice -> window -> kill cycle."""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
from local_helpers import OFFER, request, spec, wait_for

from airflow_spot.backends.base import InstanceState, LaunchError, TerminationReason
from airflow_spot.backends.local_state import group_alive
from airflow_spot.backends.preemption import (
    PreemptionConfig,
    load_trace,
    next_trace_preemption,
    preemption_delay,
    spot_capacity_available,
    trace_preemption_times,
)
from airflow_spot.policy.offers import Market

TRACES = (Path(__file__).resolve().parents[3] / "shared" / "data" / "spot-traces" / "preemption" / "1-node"
          / "aws-04-22-2023")


def write_trace(path: Path, values: list[int], gap: float) -> str:
    path.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": values}))
    return str(path)


# ------------------------------------------------------------------------------------------ planning
def test_schedule_is_consumed_one_entry_per_launch():
    config = PreemptionConfig.from_kwargs({"mode": "schedule", "after_seconds": [6, None, 7.5]})
    delays = [preemption_delay(config, launch_index=i, seconds_since_job_start=100.0) for i in range(5)]
    assert delays == [6.0, None, 7.5, None, None]


def test_no_preemption_by_default():
    assert preemption_delay(PreemptionConfig.from_kwargs(None), launch_index=0, seconds_since_job_start=0) is None


def test_rate_mode_is_reproducible_and_has_the_requested_mean():
    config = PreemptionConfig.from_kwargs({"mode": "rate", "mtbf_seconds": 30, "seed": 1})
    draws = [preemption_delay(config, launch_index=i, seconds_since_job_start=0) for i in range(4000)]
    again = [preemption_delay(config, launch_index=i, seconds_since_job_start=0) for i in range(4000)]
    other_seed = PreemptionConfig.from_kwargs({"mode": "rate", "mtbf_seconds": 30, "seed": 2})
    assert draws == again
    assert draws[:10] != [preemption_delay(other_seed, launch_index=i, seconds_since_job_start=0) for i in range(10)]
    assert 27.0 < statistics.fmean(draws) < 33.0  # exponential: mean 30, standard error ~0.5
    assert 0.55 < sum(d < 30 for d in draws) / len(draws) < 0.71  # P(X < mean) = 1 - 1/e = 0.632


def test_offer_mode_uses_the_offers_risk_time_compressed():
    config = PreemptionConfig.from_kwargs({"mode": "offer", "time_scale": 600, "seed": 3})
    # 0.25 preemptions per hour, 600x faster: one every 24 s on average
    draws = [preemption_delay(config, launch_index=i, seconds_since_job_start=0, preemption_rate_per_hour=0.25)
             for i in range(4000)]
    assert 21.6 < statistics.fmean(draws) < 26.4
    assert preemption_delay(config, launch_index=0, seconds_since_job_start=0, preemption_rate_per_hour=0.0) is None


def test_trace_preemptions_are_the_one_to_zero_steps():
    assert trace_preemption_times([1, 1, 0, 0, 1, 1, 1, 0, 1], 10.0) == [20.0, 70.0]
    assert trace_preemption_times([0, 0, 1, 1], 10.0) == []


def test_next_trace_preemption_wraps_around():
    events, length = [20.0, 70.0], 90.0
    assert next_trace_preemption(events, 0.0, length) == 20.0
    assert next_trace_preemption(events, 20.0, length) == 70.0  # strictly after
    assert next_trace_preemption(events, 75.0, length) == 110.0  # next lap
    assert next_trace_preemption(events, 200.0, length) == 250.0  # lap 2, position 20 -> event at 70


def test_trace_mode_compresses_time_on_a_job_wide_clock(tmp_path):
    # up from tick 1; preempted at ticks 4 and 8 (60 s ticks): trace times 240 s and 480 s
    path = write_trace(tmp_path / "t.json", [0, 1, 1, 1, 0, 1, 1, 1, 0, 0], 60.0)
    config = PreemptionConfig.from_kwargs({"mode": "trace", "path": path, "time_scale": 60})
    # the job's clock starts at the first running tick (60 s): 180 trace s = 3 real s to the first event
    assert preemption_delay(config, launch_index=0, seconds_since_job_start=0.0) == pytest.approx(3.0)
    # an instance started 3.5 real s into the job (trace 270 s) is preempted at 480 s: 3.5 s later
    assert preemption_delay(config, launch_index=1, seconds_since_job_start=3.5) == pytest.approx(3.5)
    offset = PreemptionConfig.from_kwargs({"mode": "trace", "path": path, "time_scale": 60,
                                           "start_offset_seconds": 300})
    assert preemption_delay(offset, launch_index=0, seconds_since_job_start=0.0) == pytest.approx(3.0)


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared spot traces not present")
def test_real_trace_gives_hours_between_preemptions():
    for path in sorted(TRACES.glob("*.json")):
        trace = load_trace(str(path))
        events = trace_preemption_times(trace.values, trace.gap_seconds)
        values = trace.values
        assert events and all(values[int(t / trace.gap_seconds) - 1] == 1 and values[int(t / trace.gap_seconds)] == 0
                              for t in events)
        hours = trace.length_seconds / 3600 / len(events)
        assert 1.0 < hours < 10.0, (path.name, hours)  # the data README: mean 3.0-4.3 h between preemptions
        config = PreemptionConfig.from_kwargs({"mode": "trace", "path": str(path), "time_scale": 600})
        delays = [preemption_delay(config, launch_index=0, seconds_since_job_start=s) for s in range(0, 1000, 7)]
        assert all(d > 0 for d in delays)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mode": "schedule"}, "needs after_seconds"),
        ({"mode": "schedule", "after_seconds": [5, -1]}, "seconds >= 0 or null"),
        ({"mode": "schedule", "after_seconds": [5], "mtbf_seconds": 3}, "does not take \\['mtbf_seconds'\\]"),
        ({"mode": "rate", "mtbf_seconds": 0}, "mtbf_seconds > 0"),
        ({"mode": "rate", "mtbf_seconds": 10, "seed": "x"}, "seed must be an integer"),
        ({"mode": "offer", "time_scale": 0}, "time_scale must be > 0"),
        ({"mode": "trace", "path": "/nonexistent.json"}, "existing spot trace JSON file"),
        ({"mode": "trace", "path": __file__}, "is not a spot trace"),
        ("rate", "must be a dict"),
    ],
)
def test_bad_preemption_options_are_explained(options, message):
    with pytest.raises(ValueError, match=message):
        PreemptionConfig.from_kwargs(options)


def test_trace_without_preemptions_is_rejected(tmp_path):
    path = write_trace(tmp_path / "flat.json", [1, 1, 1], 32.0)
    with pytest.raises(ValueError, match="holds no preemption"):
        PreemptionConfig.from_kwargs({"mode": "trace", "path": path})


# ------------------------------------------------------------------------------------------ injection
NOTICE_AWARE = (
    "import os, sys, time\n"
    "path = os.environ['SPOT_NOTICE_FILE']\n"
    "print('training', flush=True)\n"
    "deadline = time.time() + 60\n"
    "while not os.path.exists(path) and time.time() < deadline:\n"
    "    time.sleep(0.05)\n"
    "print('notice seen: ' + open(path).read(), flush=True)\n"
    "sys.exit(75)\n"
)


def test_notice_then_kill_after_the_window(make_backend, job_uri, layout):
    # The notice comes 3 s after the start: time for the agent to start the command on a loaded machine
    # (a notice before that is answered without starting it: tests/training/test_handoff.py covers that).
    backend = make_backend(preemption={"mode": "schedule", "after_seconds": [3.0]}, notice_window_seconds=1.0)
    info = backend.launch(spec(job_uri))
    layout.write_request(info.instance_id, request(job_uri, "a1", NOTICE_AWARE))

    status = wait_for(lambda: layout.read_status("a1"), 20, "the command to see the notice")
    assert status.outcome == "preempted" and "notice seen" in status.error_tail and "preemption" in status.error_tail
    noticed = backend.describe([info.instance_id])[info.instance_id]
    assert noticed.notice_at is not None

    ended = wait_for(lambda: (i := backend.describe([info.instance_id])[info.instance_id]).state.is_terminal() and i,
                     20, "the kill after the notice window")
    assert ended.reason is TerminationReason.PREEMPTED
    assert ended.terminated_at - ended.notice_at >= 1.0  # the whole window was given
    assert ended.notice_at >= ended.launched_at + 3.0
    record = backend.record(info.instance_id)
    assert not group_alive(record.pgid)
    wait_for(lambda: not record.supervisor.alive(), 5, "the supervisor to exit")


def test_a_command_that_ignores_the_notice_is_killed_without_status(make_backend, job_uri, layout):
    backend = make_backend(preemption={"mode": "schedule", "after_seconds": [3.0]}, notice_window_seconds=0.5)
    info = backend.launch(spec(job_uri))
    layout.write_request(info.instance_id, request(job_uri, "a1", "import time; time.sleep(60)"))
    ended = wait_for(lambda: (i := backend.describe([info.instance_id])[info.instance_id]).state.is_terminal() and i,
                     20, "the preemption")
    assert ended.reason is TerminationReason.PREEMPTED
    assert layout.read_status("a1") is None  # killed mid-attempt: the trigger must call this preempted/lost
    assert not group_alive(backend.record(info.instance_id).pgid)


def test_schedule_counts_launches_job_wide_and_tokens_do_not_consume(make_backend, job_uri, tmp_path):
    config = {"preemption": {"mode": "schedule", "after_seconds": [60, None, 30]}}
    first = make_backend(**config).launch(spec(job_uri, token="t0"))
    # another backend object (another process, in real life) shares the job's counter
    other = make_backend(**config)
    assert other.launch(spec(job_uri, token="t0")).instance_id == first.instance_id
    second = other.launch(spec(job_uri, token="t1"))
    third = other.launch(spec(job_uri, token="t2"))
    another_job = other.launch(spec("file://" + str(tmp_path / "job2"), token="t3"))
    plans = {i.instance_id: other.record(i.instance_id) for i in (first, second, third, another_job)}
    assert [plans[i.instance_id].launch_index for i in (first, second, third, another_job)] == [0, 1, 2, 0]
    assert plans[first.instance_id].preempt_at == pytest.approx(plans[first.instance_id].running_at + 60)
    assert plans[second.instance_id].preempt_at is None and plans[second.instance_id].supervisor is None
    assert plans[third.instance_id].preempt_at == pytest.approx(plans[third.instance_id].running_at + 30)


def test_on_demand_instances_are_never_preempted_and_do_not_consume_the_schedule(make_backend, job_uri):
    backend = make_backend(preemption={"mode": "schedule", "after_seconds": [40, 50]})
    on_demand = dataclasses.replace(OFFER, market=Market.ON_DEMAND, price_per_hour=OFFER.on_demand_price_per_hour)
    od = backend.launch(dataclasses.replace(spec(job_uri, token="od"), offer=on_demand))
    spot = backend.launch(spec(job_uri, token="spot"))
    od_record, spot_record = backend.record(od.instance_id), backend.record(spot.instance_id)
    assert od_record.preempt_at is None and od_record.supervisor is None and od_record.spot_launch_index == -1
    assert (spot_record.launch_index, spot_record.spot_launch_index) == (1, 0)
    assert spot_record.preempt_at == pytest.approx(spot_record.running_at + 40)


def test_supervisor_leaves_with_an_instance_terminated_before_the_notice(make_backend, job_uri):
    backend = make_backend(preemption={"mode": "schedule", "after_seconds": [30]})
    info = backend.launch(spec(job_uri))
    supervisor = backend.record(info.instance_id).supervisor
    assert supervisor is not None and supervisor.alive()
    backend.terminate([info.instance_id])
    wait_for(lambda: not supervisor.alive(), 5, "the supervisor to exit")
    ended = backend.describe([info.instance_id])[info.instance_id]
    assert ended.reason is TerminationReason.USER and ended.notice_at is None


def test_supervisor_leaves_with_an_instance_that_went_idle(make_backend, job_uri):
    backend = make_backend(preemption={"mode": "schedule", "after_seconds": [30]})
    info = backend.launch(spec(job_uri, idle=0.5))
    supervisor = backend.record(info.instance_id).supervisor
    wait_for(lambda: not supervisor.alive(), 15, "the supervisor to follow its idle instance")
    ended = backend.describe([info.instance_id])[info.instance_id]
    assert ended.state is InstanceState.TERMINATED and ended.reason is TerminationReason.IDLE


def test_trace_mode_plans_from_the_trace(make_backend, job_uri, tmp_path):
    path = write_trace(tmp_path / "t.json", [1, 1, 1, 0, 1, 1, 1, 1, 1, 0], 60.0)
    backend = make_backend(preemption={"mode": "trace", "path": path, "time_scale": 30})
    info = backend.launch(spec(job_uri))
    record = backend.record(info.instance_id)
    assert record.preempt_at - record.running_at == pytest.approx(180 / 30)  # first 1->0 at trace 180 s


def test_trace_capacity_follows_the_trace(tmp_path):
    path = write_trace(tmp_path / "t.json", [1, 1, 0, 0, 1], 60.0)
    config = PreemptionConfig.from_kwargs({"mode": "trace", "path": path, "time_scale": 60, "capacity": True})
    assert [spot_capacity_available(config, s) for s in (0, 1.5, 2.0, 3.9, 4.0, 5.5)] == [
        True, True, False, False, True, True]  # ticks 0, 1, 2, 3, 4, then 5 wraps to tick 0
    no_capacity_check = PreemptionConfig.from_kwargs({"mode": "trace", "path": path, "time_scale": 60})
    assert spot_capacity_available(no_capacity_check, 2.5)


def test_spot_launch_is_refused_while_the_trace_is_down(make_backend, job_uri, tmp_path):
    # down from trace 0 s to 120 s, i.e. the first 2 real seconds at 60x
    path = write_trace(tmp_path / "t.json", [0, 0, 1, 1, 1, 0], 60.0)
    backend = make_backend(preemption={"mode": "trace", "path": path, "time_scale": 60, "capacity": True,
                                       "start_offset_seconds": 0})
    with pytest.raises(LaunchError, match="no spot capacity") as refused:
        backend.launch(spec(job_uri, token="early"))
    assert refused.value.capacity is True
    on_demand = dataclasses.replace(OFFER, market=Market.ON_DEMAND)
    od = backend.launch(dataclasses.replace(spec(job_uri, token="od"), offer=on_demand))
    assert od.state is InstanceState.RUNNING
    later = wait_for(lambda: _try_launch(backend, spec(job_uri, token="later")), 10, "capacity to come back")
    assert later.state is InstanceState.RUNNING
    assert backend.record(later.instance_id).spot_launch_index == 0  # the refusal consumed nothing


def _try_launch(backend, launch_spec):
    try:
        return backend.launch(launch_spec)
    except LaunchError:
        return None
