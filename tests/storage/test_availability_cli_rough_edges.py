"""``airflow-spot availability show``: a job root's log and ledger counted once; a URI of another scheme."""
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

A, B = "g4dn.xlarge@ape1-az1", "g5.xlarge@apse3-az3"


def test_show_on_a_job_root_counts_one_job_and_each_event_once(tmp_path, capsys):
    # as the demo's job writes them: its log has each launch (and refusals), its ledger a row per attempt,
    # whose start repeats the launch and whose end is where the next attempt on that instance starts
    now = time.time()
    store = open_store(str(tmp_path / "job"))
    job = "spot_training_demo.train"
    AvailabilityLog(store.child(JobLayout.AVAILABILITY_PREFIX)).extend([
        PoolEvent(B, "launched", now - 600.0, job), PoolEvent(A, "refused", now - 590.0, job),
        PoolEvent(A, "launched", now - 500.0, job),
    ])
    ledger = LedgerStore(store)
    ledger.write(LedgerRow("train.s0.try1", "i-1", "g5.xlarge", "apse3-az3", "spot", 0.14, 1.4,
                           now - 600.03, now - 10.0, 10, "preempted"))
    ledger.write(LedgerRow("train.s0.try2", "i-2", "g4dn.xlarge", "ape1-az1", "spot", 0.1, 0.8,
                           now - 500.03, now - 300.0, 100, "completed"))
    ledger.write(LedgerRow("train.s1.try1", "i-2", "g4dn.xlarge", "ape1-az1", "spot", 0.1, 0.8,
                           now - 300.0, now - 100.0, 100, "completed", segment_index=1, new_instance=False))
    assert main(["availability", "show", str(tmp_path / "job")]) == 0
    out = capsys.readouterr().out
    # B: launched, preempted; A: refused, launched, running (end of try2 = start of s1), running (end of s1)
    assert "6 events of 2 pools from 1 job(s)" in out, out
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    events = {pool: re.search(r"\s(\d+)\s+(?:launched|running|preempted|refused) ", row).group(1)
              for pool, row in rows.items()}
    assert events == {A: "4", B: "2"}
    assert rows[A].rstrip().endswith("(this job)") and rows[B].rstrip().endswith("(this job)")
    assert rows[A].split()[1] == "up" and rows[B].split()[1] == "down"


def test_show_on_a_job_root_without_a_log_counts_its_ledger_once(tmp_path, capsys):
    now = time.time()
    store = open_store(str(tmp_path / "job"))
    LedgerStore(store).write(LedgerRow("train.s0.try1", "i-1", "g5.xlarge", "apse3-az3", "spot", 0.14, 1.4,
                                       now - 600.0, now - 10.0, 10, "preempted"))
    assert main(["availability", "show", str(tmp_path / "job")]) == 0
    assert "2 events of 1 pools from 1 job(s)" in capsys.readouterr().out


def test_an_unsupported_scheme_speaks_of_the_availability_log(capsys):
    assert main(["availability", "show", "gs://x"]) == 2
    err = capsys.readouterr().err
    assert "availability log URI" in err and "'gs'" in err and "checkpoint" not in err
    assert "file://" in err and "s3://" in err and "a path" in err
    assert main(["availability", "prune", "s3:/bucket/log", "--older-than-days", "14"]) == 2
    err = capsys.readouterr().err
    assert "availability log URI" in err and "s3://bucket/log" in err and "checkpoint" not in err


def test_prune_of_a_folder_above_the_log_is_refused_and_deletes_nothing(tmp_path, capsys):
    # a DAG's root, as the operators lay it out: the deployment's log in _availability beside the job roots,
    # the overhead history in _overheads (entries named by time too) and a job root with its own log
    old = time.time() - 30 * 86400
    dag = open_store(str(tmp_path / "my_dag"))
    AvailabilityLog(dag.child("_availability")).append(PoolEvent(A, "launched", old, "j"))
    dag.put_bytes(f"_overheads/{old:018.3f}-run1.json", b"{}")
    job = dag.child("run1")
    job.put_bytes("control/job.json", b"{}")
    AvailabilityLog(job.child(JobLayout.AVAILABILITY_PREFIX)).append(PoolEvent(A, "launched", old, "j"))
    before = dag.list()
    for argv in (["prune", "--older-than-days", "14"], ["compact"], ["show"]):
        assert main(["availability", *argv, str(tmp_path / "my_dag")]) == 2
        err = capsys.readouterr().err
        assert "is not an availability log" in err and "Nothing was read or deleted" in err, err
        assert f"{dag.uri}/_availability" in err and f"{dag.uri}/run1" in err, err  # where the logs are
    assert dag.list() == before
    # a job's checkpoints/ folder, the overheads folder: objects, none an event
    for folder in ("_overheads", "run1/control"):
        assert main(["availability", "prune", "--older-than-days", "14", str(tmp_path / "my_dag" / folder)]) == 2
        assert "is not an availability log" in capsys.readouterr().err
    assert dag.list() == before
    # the log itself and the job's root still prune
    assert main(["availability", "prune", "--older-than-days", "14", str(tmp_path / "my_dag" / "_availability")]) == 0
    assert main(["availability", "prune", "--older-than-days", "14", str(tmp_path / "my_dag" / "run1")]) == 0
    assert "deleted 1 events" in capsys.readouterr().out
    assert sorted(set(before) - set(dag.list())) == sorted(k for k in before if k.endswith(".launched.json"))


def test_a_file_or_an_empty_uri_is_a_usage_error_that_speaks_of_the_log(tmp_path, capsys):
    (tmp_path / "log.csv").write_text("x")
    assert main(["availability", "show", str(tmp_path / "log.csv")]) == 2
    assert "is a file, not a folder; give the availability log" in capsys.readouterr().err
    assert main(["availability", "show", ""]) == 2
    err = capsys.readouterr().err
    assert "availability log URI must be a non-empty string" in err and "checkpoint" not in err
