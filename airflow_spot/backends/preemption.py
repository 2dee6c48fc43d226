"""The preemption injector of the ``local`` backend: when to preempt an instance, and doing it.

Configured through the backend's ``preemption`` kwarg (plain JSON):

Only spot instances are preempted; on-demand launches are never preempted and do not count as launches
below (so a deadline's fallback to on-demand does not shift a schedule).

* ``{"mode": "none"}`` (default): instances are never preempted.
* ``{"mode": "schedule", "after_seconds": [6, 9, null, 7]}``: the job's n-th launched spot instance is
  preempted ``after_seconds[n]`` seconds after it starts running (``null``: not preempted); launches past
  the end of the list are never preempted. A demo gets exactly as many preemptions as it lists.
* ``{"mode": "rate", "mtbf_seconds": 30, "seed": 1}``: exponential lifetimes (a Poisson market) with the
  given mean, drawn from ``seed`` and the launch index, so a run is reproducible.
* ``{"mode": "offer", "time_scale": 600, "seed": 1}``: like ``rate``, with the rate the market gives the
  launched offer (``Offer.preemption_rate_per_hour``), time-compressed ``time_scale`` times; an offer
  with no risk is never preempted.
* ``{"mode": "trace", "path": ".../us-west-2b_v100_1.json", "time_scale": 600}``: replays a measured
  spot trace (``1`` = running, a ``1 -> 0`` step = a preemption) on a job-wide clock compressed
  ``time_scale`` times: the job's first launch is trace time ``start_offset_seconds`` (default: the
  trace's first running tick) and an instance is preempted at the next preemption of the trace after
  its start. The trace wraps around at its end. With ``"capacity": true`` a spot launch while the trace
  is down (``0``: the measured instance was waiting for a relaunch) fails with a capacity error, as the
  cloud would refuse it.

For each planned preemption a small supervisor process (``python -m airflow_spot.backends.preemption``,
in a process group of its own so it survives the kill) waits until the time, issues the notice (creates
the instance's notice file, which the agent hands to the training command as ``SPOT_NOTICE_FILE``, and
records ``notice_at``), waits ``notice_window_seconds``, SIGKILLs the instance's process group and records
it as terminated by preemption. It exits as soon as the instance is gone for any other reason, so it
never outlives its instance by more than one poll.

The planning functions are pure: same config, launch index and clock reading, same answer.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
import signal
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

log = logging.getLogger(__name__)

MODES = ("none", "schedule", "rate", "offer", "trace")
SUPERVISOR_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class PreemptionConfig:
    """Validated ``preemption`` kwarg of the local backend (see the module docstring)."""

    mode: str = "none"
    after_seconds: tuple[float | None, ...] = ()
    mtbf_seconds: float | None = None
    seed: int = 0
    path: str | None = None
    time_scale: float = 1.0
    start_offset_seconds: float | None = None
    #: trace mode: refuse spot launches while the trace is down
    capacity: bool = False

    ALLOWED: ClassVar[dict[str, set[str]]] = {
        "none": {"mode"},
        "schedule": {"mode", "after_seconds"},
        "rate": {"mode", "mtbf_seconds", "seed"},
        "offer": {"mode", "time_scale", "seed"},
        "trace": {"mode", "path", "time_scale", "start_offset_seconds", "capacity"},
    }

    @classmethod
    def from_kwargs(cls, options: dict | None) -> PreemptionConfig:
        """Validate the user's dict; every mistake names the key and how to fix it."""
        if options is None:
            return cls()
        if not isinstance(options, dict):
            raise ValueError(f"preemption must be a dict like {{'mode': 'rate', 'mtbf_seconds': 30}}, got {options!r}")
        mode = options.get("mode", "none")
        if mode not in MODES:
            raise ValueError(f"unknown preemption mode {mode!r}; valid modes: {', '.join(MODES)}")
        unknown = set(options) - cls.ALLOWED[mode]
        if unknown:
            raise ValueError(
                f"preemption mode {mode!r} does not take {sorted(unknown)}; "
                f"it takes {sorted(cls.ALLOWED[mode] - {'mode'})}"
            )
        if mode == "schedule":
            after = options.get("after_seconds")
            if not isinstance(after, (list, tuple)) or not after:
                raise ValueError(
                    "preemption mode 'schedule' needs after_seconds: a non-empty list of seconds (or null)"
                )
            for value in after:
                if value is not None and (not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value)):
                    raise ValueError(f"preemption after_seconds must hold seconds >= 0 or null, got {value!r}")
            return cls(mode=mode, after_seconds=tuple(None if v is None else float(v) for v in after))
        if mode == "rate":
            mtbf = options.get("mtbf_seconds")
            if not isinstance(mtbf, (int, float)) or mtbf <= 0 or not math.isfinite(mtbf):
                raise ValueError(f"preemption mode 'rate' needs mtbf_seconds > 0, got {mtbf!r}")
            seed = options.get("seed", 0)
            if not isinstance(seed, int):
                raise ValueError(f"preemption seed must be an integer, got {seed!r}")
            return cls(mode=mode, mtbf_seconds=float(mtbf), seed=seed)
        if mode in ("offer", "trace"):
            scale = options.get("time_scale", 1.0)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
                raise ValueError(f"preemption time_scale must be > 0 (trace seconds per real second), got {scale!r}")
        if mode == "offer":
            seed = options.get("seed", 0)
            if not isinstance(seed, int):
                raise ValueError(f"preemption seed must be an integer, got {seed!r}")
            return cls(mode=mode, time_scale=float(options.get("time_scale", 1.0)), seed=seed)
        if mode == "trace":
            path = options.get("path")
            if not isinstance(path, str) or not Path(path).is_file():
                raise ValueError(
                    f"preemption mode 'trace' needs path= an existing spot trace JSON file, got {path!r} "
                    "(e.g. shared/data/spot-traces/preemption/1-node/aws-04-22-2023/us-west-2b_v100_1.json)"
                )
            offset = options.get("start_offset_seconds")
            if offset is not None and (not isinstance(offset, (int, float)) or offset < 0):
                raise ValueError(f"preemption start_offset_seconds must be >= 0 trace seconds, got {offset!r}")
            capacity = options.get("capacity", False)
            if not isinstance(capacity, bool):
                raise ValueError(f"preemption capacity must be true or false, got {capacity!r}")
            trace = load_trace(path)
            if not trace_preemption_times(trace.values, trace.gap_seconds):
                raise ValueError(f"spot trace {path!r} holds no preemption (no 1 -> 0 step); pick another trace")
            return cls(mode=mode, path=str(Path(path).resolve()), time_scale=float(scale),
                       start_offset_seconds=None if offset is None else float(offset), capacity=capacity)
        return cls()

    def to_kwargs(self) -> dict:
        if self.mode == "schedule":
            return {"mode": "schedule", "after_seconds": list(self.after_seconds)}
        if self.mode == "rate":
            return {"mode": "rate", "mtbf_seconds": self.mtbf_seconds, "seed": self.seed}
        if self.mode == "offer":
            return {"mode": "offer", "time_scale": self.time_scale, "seed": self.seed}
        if self.mode == "trace":
            d = {"mode": "trace", "path": self.path, "time_scale": self.time_scale}
            if self.start_offset_seconds is not None:
                d["start_offset_seconds"] = self.start_offset_seconds
            if self.capacity:
                d["capacity"] = True
            return d
        return {"mode": "none"}


@dataclass(frozen=True)
class Trace:
    gap_seconds: float
    values: tuple[int, ...]

    @property
    def length_seconds(self) -> float:
        return self.gap_seconds * len(self.values)


@lru_cache(maxsize=16)
def load_trace(path: str) -> Trace:
    """Read a spot trace: ``{"metadata": {"gap_seconds": G}, "data": [1, 1, 0, ...]}`` (1 = running)."""
    try:
        raw = json.loads(Path(path).read_text())
        gap = float(raw["metadata"]["gap_seconds"])
        values = tuple(int(v) for v in raw["data"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path!r} is not a spot trace ({{'metadata': {{'gap_seconds': G}}, 'data': [...]}}): {exc}"
        ) from exc
    if gap <= 0 or not values:
        raise ValueError(f"spot trace {path!r} has no ticks or a non-positive gap_seconds")
    return Trace(gap, values)


def trace_preemption_times(values: tuple[int, ...] | list[int], gap_seconds: float) -> list[float]:
    """Trace times (seconds from the trace start) of every ``1 -> 0`` step, i.e. every preemption."""
    return [i * gap_seconds for i in range(1, len(values)) if values[i - 1] == 1 and values[i] == 0]


def first_running_offset(values: tuple[int, ...] | list[int], gap_seconds: float) -> float:
    return next((i * gap_seconds for i, v in enumerate(values) if v == 1), 0.0)


def next_trace_preemption(events: list[float], trace_now: float, length_seconds: float) -> float:
    """Trace time of the first preemption strictly after ``trace_now``, wrapping around the trace.

    The result may exceed ``length_seconds`` (a later lap); it is always > ``trace_now``.
    """
    lap, position = divmod(trace_now, length_seconds)
    for event in events:
        if event > position:
            return lap * length_seconds + event
    return (lap + 1) * length_seconds + events[0]


def preemption_delay(
    config: PreemptionConfig,
    *,
    launch_index: int,
    seconds_since_job_start: float,
    preemption_rate_per_hour: float = 0.0,
) -> float | None:
    """Seconds after a spot instance starts running at which it is preempted; ``None``: never.

    :param launch_index: 0-based position of the instance among the job's spot launches.
    :param seconds_since_job_start: real seconds from the job's first launch to this instance's start
        (the trace mode's clock; the other modes ignore it).
    :param preemption_rate_per_hour: the offer's risk (``offer`` mode).
    """
    if config.mode == "schedule":
        if launch_index < len(config.after_seconds):
            return config.after_seconds[launch_index]
        return None
    if config.mode == "rate":
        rng = random.Random(f"airflow-spot-preemption:{config.seed}:{launch_index}")
        return rng.expovariate(1.0 / float(config.mtbf_seconds))
    if config.mode == "offer":
        if preemption_rate_per_hour <= 0:
            return None
        rng = random.Random(f"airflow-spot-preemption:{config.seed}:{launch_index}")
        return rng.expovariate(preemption_rate_per_hour * config.time_scale / 3600.0)
    if config.mode == "trace":
        trace = load_trace(config.path)
        events = trace_preemption_times(trace.values, trace.gap_seconds)
        trace_now = _trace_time(config, trace, seconds_since_job_start)
        event = next_trace_preemption(events, trace_now, trace.length_seconds)
        return (event - trace_now) / config.time_scale
    return None


def _trace_time(config: PreemptionConfig, trace: Trace, seconds_since_job_start: float) -> float:
    offset = (config.start_offset_seconds if config.start_offset_seconds is not None
              else first_running_offset(trace.values, trace.gap_seconds))
    return offset + max(0.0, seconds_since_job_start) * config.time_scale


def spot_capacity_available(config: PreemptionConfig, seconds_since_job_start: float) -> bool:
    """Whether a spot launch succeeds now: always, except in trace mode with ``capacity`` while the
    trace is down."""
    if config.mode != "trace" or not config.capacity:
        return True
    trace = load_trace(config.path)
    tick = int(_trace_time(config, trace, seconds_since_job_start) // trace.gap_seconds) % len(trace.values)
    return trace.values[tick] == 1


# ---------------------------------------------------------------------------------------------- supervisor
def spawn_supervisor_command(state_dir: str, instance_id: str, at: float, notice_window: float) -> list[str]:
    return [
        sys.executable, "-m", "airflow_spot.backends.preemption",
        "--state-dir", state_dir, "--instance-id", instance_id,
        "--at", repr(at), "--notice-window", repr(notice_window),
    ]


def supervise(state_dir: str, instance_id: str, at: float, notice_window: float) -> str:
    """Preempt one instance at wall-clock time ``at`` (notice, window, kill). Returns what happened."""
    from airflow_spot.backends.base import InstanceState, TerminationReason
    from airflow_spot.backends.local_state import LocalState, group_alive, kill_group, write_json_atomic

    state = LocalState(state_dir)

    def instance_gone() -> bool:
        record = state.read(instance_id)
        return (
            record is None
            or record.terminate_requested
            or InstanceState(record.info.state).is_terminal()
            or not record.agent.alive()
        )

    def wait_until(deadline: float) -> bool:
        """Sleep until ``deadline``; False if the instance went away meanwhile."""
        while True:
            if instance_gone():
                return False
            left = deadline - time.time()
            if left <= 0:
                return True
            time.sleep(min(SUPERVISOR_POLL_SECONDS, left))

    if not wait_until(at):
        return "instance gone before the notice"
    notice_at = time.time()
    write_json_atomic(state.notice_path(instance_id), {"kind": "preemption", "time": notice_at,
                                                       "kill_at": notice_at + notice_window})

    def mark_notice(record):
        record.info.notice_at = notice_at

    state.update(instance_id, mark_notice)
    log.info("notice issued to %s; killing in %.1f s", instance_id, notice_window)
    if not wait_until(notice_at + notice_window):
        return "instance gone during the notice window"

    killed: list = []

    def mark_kill(record):
        record.preempt_kill = True
        killed.append(record)

    if state.update(instance_id, mark_kill) is None:
        return "instance record vanished"
    pgid, agent = killed[0].pgid, killed[0].agent
    kill_group(pgid, signal.SIGKILL, leader=agent)
    deadline = time.monotonic() + 5.0
    while group_alive(pgid, leader=agent) and time.monotonic() < deadline:
        time.sleep(0.02)
    killed_at = time.time()

    def mark_terminated(record):
        if not InstanceState(record.info.state).is_terminal():
            record.info.state = InstanceState.TERMINATED
            record.info.reason = TerminationReason.PREEMPTED
            record.info.terminated_at = killed_at
        record.extra["notice_to_kill_seconds"] = killed_at - notice_at

    state.update(instance_id, mark_terminated)
    log.info("preempted %s (%.2f s after the notice)", instance_id, killed_at - notice_at)
    return "preempted"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="preempt one local instance: notice, window, kill")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--instance-id", required=True)
    p.add_argument("--at", type=float, required=True, help="wall-clock time of the notice")
    p.add_argument("--notice-window", type=float, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s preemption %(levelname)s %(message)s")
    outcome = supervise(args.state_dir, args.instance_id, args.at, args.notice_window)
    log.info("supervisor of %s done: %s", args.instance_id, outcome)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
