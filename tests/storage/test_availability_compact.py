"""Compacting the availability log: the events no decision reads go, and what a decision concludes from the
log stays the same (random logs of several jobs and pools, ties included)."""
from __future__ import annotations

import random
import time

import pytest

from airflow_spot.cli import main
from airflow_spot.policy.decision import DecisionParams, decide_attempt
from airflow_spot.policy.observations import EVENT_KINDS, JobObservation, PoolEvent, pool_views
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.availability import COMPACT_AFTER_HOURS, AvailabilityLog
from airflow_spot.storage.object_store import open_store

POOLS = ["p3.2xlarge@us-west-2a", "p3.2xlarge@us-west-2b", "p3.2xlarge@us-east-1a", "g5.xlarge@us-east-1a"]
KINDS = sorted(EVENT_KINDS - {"running"})  # what the operators write to the log


def offers() -> list[Offer]:
    spot = [Offer(p.split("@")[0], p.split("@")[1][:-1], p.split("@")[1], Market.SPOT, 0.9 + i / 10, 3.06, "V100", 1,
                  16.0, preemption_rate_per_hour=0.28) for i, p in enumerate(POOLS)]
    return spot + [Offer("p3.2xlarge", "us-west-2", "us-west-2", Market.ON_DEMAND, 3.06, 3.06, "V100", 1, 16.0)]


def random_events(rng: random.Random, n: int) -> list[PoolEvent]:
    """Mostly repeats (probes and launches of a pool that stays up or down), sometimes a change; coarse
    times, so that events of one pool often share a second."""
    events, up = [], {p: rng.random() < 0.5 for p in POOLS}
    t = 1_800_000_000.0
    for _ in range(n):
        t += rng.choice([0.0, 1.0, 60.0, 300.0, 900.0, 3600.0])
        pool = rng.choice(POOLS)
        if rng.random() < 0.15:
            up[pool] = not up[pool]
        kinds = [k for k in KINDS if (k in ("launched", "probe-up")) == up[pool]]
        events.append(PoolEvent(pool, rng.choice(kinds), t, rng.choice(["j1", "j2", "j3"])))
    return events


def ledger_like(rng: random.Random, log_events: list[PoolEvent]) -> list[PoolEvent]:
    """What a job merges with the log from its own records: up-events the log does not hold (its instance
    still running at an attempt's end), and its own preemptions and refusals, which the log holds too."""
    times = [e.at for e in log_events]
    ups = [PoolEvent(rng.choice(POOLS), "running", rng.uniform(min(times), max(times))) for _ in range(40)]
    downs = [PoolEvent(e.pool, e.kind, e.at) for e in rng.sample([e for e in log_events if not e.up], 20)]
    return ups + downs


def conclusions(events: list[PoolEvent], now: float):
    views = pool_views(events, now, POOLS, DecisionParams().recheck_seconds, DecisionParams().watch_seconds)
    decisions = []
    for running, pool in ((None, None), ("on-demand", None), ("spot", POOLS[1])):
        obs = JobObservation(now=now, started_at=now - 7200, deadline_at=now + 40 * 3600, work_done=3600.0,
                             work_total=30 * 3600.0, offers=offers(), events=events, running=running,
                             running_pool=pool)
        d = decide_attempt(obs)
        decisions.append((d.market, [o.pool for o in d.ranked], d.reason, d.probe, d.spot_up_seconds,
                          d.expected_outage_seconds))
    return views, decisions


@pytest.mark.parametrize("seed", range(12))
def test_a_compacted_log_leads_to_the_same_decisions(tmp_path, seed):
    rng = random.Random(seed)
    log = AvailabilityLog(open_store(str(tmp_path)))
    log.extend(random_events(rng, 300))
    full = log.read()
    own = ledger_like(rng, full)
    now = max(e.at for e in full) + rng.choice([0.0, 30.0, 600.0, 7200.0])
    before = conclusions(full + own, now)
    dropped = log.compact(before=now)
    compacted = log.read()
    assert dropped > 50 and len(compacted) == len(full) - dropped  # much of such a log is repeats
    assert conclusions(compacted + own, now) == before
    assert log.compact(before=now) == 0  # nothing more to drop
    # jobs go on writing; later decisions read the same from the compacted log as from the whole one
    more = random_events(rng, 60)
    shift = now - more[0].at + 1.0
    more = [PoolEvent(e.pool, e.kind, e.at + shift, e.job) for e in more]
    log.extend(more)
    later = more[-1].at + 60.0
    assert conclusions(log.read() + own, later) == conclusions(full + more + own, later)


def test_only_the_inside_of_a_run_of_ups_goes_and_only_before_the_given_time(tmp_path):
    pool = POOLS[0]
    log = AvailabilityLog(open_store(str(tmp_path)))
    log.extend([PoolEvent(pool, k, t, "j") for k, t in [
        ("launched", 100.0), ("probe-up", 200.0), ("probe-up", 300.0), ("probe-up", 400.0),  # 200, 300 go
        ("preempted", 500.0), ("refused", 600.0), ("probe-down", 700.0),  # refusals are all kept
        ("probe-up", 800.0), ("probe-up", 900.0), ("launched", 1000.0), ("probe-up", 1100.0),
    ]])
    assert log.compact(before=850.0, dry_run=True) == 2 and len(log.read()) == 11
    # 900 goes once the event after it (1000) is older than ``before`` as well; 1000 stays: 1100 is not
    assert log.compact(before=1050.0) == 3
    assert [e.at for e in log.read()] == [100.0, 400.0, 500.0, 600.0, 700.0, 800.0, 1000.0, 1100.0]


def test_at_equal_times_a_down_event_comes_first_as_a_decision_reads_them(tmp_path):
    # up 100, up 150, down 200 (a first-layout entry: its kind is in its body), up 200, up 300. In
    # pool_views' order (down first at a tie) the ups make runs of two: nothing goes. Read with the ups
    # first at the tie, or without the first-layout entry, 150 (and 200) would be inside a run
    pool = POOLS[0]
    store = open_store(str(tmp_path))
    log = AvailabilityLog(store)
    log.extend([PoolEvent(pool, "probe-up", t, "j") for t in (100.0, 150.0, 200.0, 300.0)])
    store.put_bytes("p3.2xlarge_us-west-2a/0000000000200.000-j-0123456789ab.json",
                    b'{"schema": 1, "pool": "p3.2xlarge@us-west-2a", "kind": "refused", "at": 200.0, "job": "j"}')
    store.put_bytes("p3.2xlarge_us-west-2a/notes.json", b"not an entry")  # not read, not deleted
    assert log.compact(before=1000.0) == 0 and len(log.read()) == 5


def test_expiry_after_compaction_keeps_a_long_run_long(tmp_path):
    # a pool probed up every 15 min for two days; then everything older than a day expires. The event
    # kept every 6 h of the run leaves it seen up for 18-24 h, not since the last 6 h of repeats
    now = 1_800_000_000.0
    log = AvailabilityLog(open_store(str(tmp_path)))
    log.extend([PoolEvent(POOLS[0], "probe-up", now - 48 * 3600 + k * 900, "j") for k in range(192)])
    assert log.compact(before=now - COMPACT_AFTER_HOURS * 3600) > 150
    log.prune(before=now - 24 * 3600)
    up = pool_views(log.read(), now, POOLS)[POOLS[0]].up_seconds(now)
    assert 18 * 3600 <= up <= 24 * 3600


def test_the_command_compacts_and_counts(tmp_path, capsys):
    # probed up every hour from 30.5 h ago: the last 6 h stay whole, of the rest one an 6 h is kept
    now = time.time()
    log = AvailabilityLog(open_store(str(tmp_path)))
    log.extend([PoolEvent(POOLS[0], "probe-up", now - (h + 0.5) * 3600, "j") for h in range(31)])
    assert main(["availability", "compact", str(tmp_path), "--dry-run"]) == 0
    assert "would delete 20 events" in capsys.readouterr().out and len(log.read()) == 31
    assert main(["availability", "compact", str(tmp_path)]) == 0
    assert "deleted 20 events" in capsys.readouterr().out
    assert [round((now - e.at) / 3600 - 0.5) for e in log.read()] == [30, 24, 18, 12, 6, 5, 4, 3, 2, 1, 0]
    assert main(["availability", "compact", str(tmp_path), "--older-than-hours", "0"]) == 0
    assert "deleted 5 events" in capsys.readouterr().out
    assert main(["availability", "compact", str(tmp_path), "--older-than-hours", "-1"]) == 2
    assert "--older-than-hours must be >= 0" in capsys.readouterr().err
