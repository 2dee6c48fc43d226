"""``airflow-spot availability show|prune``: what the deployment's jobs observed, as a decision reads it."""
from __future__ import annotations

import re
import time

from airflow_spot.cli import main
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.policy.observations import PoolEvent
from airflow_spot.storage.availability import AvailabilityLog
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout

A, B, C = "p3.2xlarge@us-west-2a", "p3.2xlarge@us-west-2b", "p3.2xlarge@us-west-2c"


def test_show_gives_each_pool_as_a_decision_reads_it(tmp_path, capsys):
    now = time.time()
    log = AvailabilityLog(open_store(str(tmp_path)))
    log.extend([
        PoolEvent(A, "refused", now - 3 * 3600, "j1"), PoolEvent(A, "probe-up", now - 3 * 3600 + 240, "j1"),
        PoolEvent(B, "launched", now - 7200, "j2"), PoolEvent(B, "preempted", now - 10, "j2"),
        PoolEvent(C, "refused", now - 1800, "j1"),
        PoolEvent(C, "launched", now - 40 * 3600, "j0"),  # outside the default 24 h
    ])
    assert main(["availability", "show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "5 events of 3 pools from 2 job(s)" in out
    row = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert row[A][1] == "up" and re.search(rf"^\s*{A}.*\s1\s+4 min\s+2\s+probe-up", out, re.M)  # an outage of 4 min
    assert row[B][1] == "down"  # preempted 10 s ago: a decision would not try it
    assert row[C][1] == "unknown"  # refused 30 min ago: worth a new try
    assert main(["availability", "show", str(tmp_path), "--hours", "0"]) == 0
    assert "6 events of 3 pools from 3 job(s)" in capsys.readouterr().out


def test_show_on_a_job_root_adds_the_jobs_ledger(tmp_path, capsys):
    # the job's own log holds its launches, probes and refusals; its preemptions are in its ledger
    now = time.time()
    store = open_store(str(tmp_path / "job"))
    AvailabilityLog(store.child(JobLayout.AVAILABILITY_PREFIX)).append(PoolEvent(A, "refused", now - 900, "dag.train"))
    LedgerStore(store).write(LedgerRow("train.s0.try1", "i-1", "p3.2xlarge", "us-west-2b", "spot", 0.97, 3.06,
                                       now - 3600, now - 5, 100, "preempted"))
    assert main(["availability", "show", str(tmp_path / "job")]) == 0
    out = capsys.readouterr().out
    assert "and the job's ledger" in out
    b = next(line for line in out.splitlines() if line.strip().startswith(B)).split()
    assert b[1] == "down" and "preempted" in b and "(this" in " ".join(b)


def test_show_reads_a_pools_state_from_the_whole_log(tmp_path, capsys):
    # up for two days, probed every 15 min, its repeats compacted: "up since" is two days ago, though
    # only the last 24 h of events are listed
    now = time.time()
    log = AvailabilityLog(open_store(str(tmp_path)))
    log.extend([PoolEvent(A, "probe-up", now - 48 * 3600 + k * 900, "j") for k in range(192)])
    log.compact(before=now - 6 * 3600)
    assert main(["availability", "show", str(tmp_path)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith(A))
    assert "(2.0 d ago)" in row


def test_prune_deletes_only_what_is_older(tmp_path, capsys):
    now = time.time()
    log = AvailabilityLog(open_store(str(tmp_path)))
    log.extend([PoolEvent(A, "launched", now - d * 86400, "j") for d in (30, 20, 1)])
    assert main(["availability", "prune", str(tmp_path), "--older-than-days", "14", "--dry-run"]) == 0
    assert "would delete 2 events" in capsys.readouterr().out and len(log.read()) == 3
    assert main(["availability", "prune", str(tmp_path), "--older-than-days", "14"]) == 0
    assert "deleted 2 events" in capsys.readouterr().out
    assert [round((now - e.at) / 86400) for e in log.read()] == [1]


def test_bad_input_is_refused_and_named(tmp_path, capsys):
    assert main(["availability", "show", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["availability", "prune", str(tmp_path), "--older-than-days", "0"]) == 2
    assert "--older-than-days must be > 0" in capsys.readouterr().err
    assert main(["availability", "show", str(tmp_path), "--hours", "-1"]) == 2
    assert "--hours must be >= 0" in capsys.readouterr().err
    assert main(["availability", "show", str(tmp_path)]) == 0
    assert "no events under" in capsys.readouterr().out
