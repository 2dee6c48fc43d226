"""``airflow-spot reap``: lists and terminates leftover instances, by tag and age, with a dry run."""
from __future__ import annotations

import json
import time

import pytest
from local_helpers import spec

from airflow_spot.backends.base import InstanceState, TerminationReason
from airflow_spot.backends.reap import leftovers
from airflow_spot.cli import main


def states(backend) -> dict[str, tuple[str, str]]:
    return {i.instance_id: (i.state.value, i.reason.value) for i in backend.list_instances()}


def test_dry_run_lists_and_terminates_nothing(backend, job_uri, capsys):
    info = backend.launch(spec(job_uri))
    options = json.dumps({"state_dir": str(backend.state.root)})
    assert main(["reap", "--backend-options", options, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert info.instance_id in out and "would be terminated" in out and "airflow-spot:dag=d" in out
    assert states(backend)[info.instance_id] == ("running", "")


def test_reap_terminates_only_matching_instances(backend, job_uri, capsys):
    keep = backend.launch(spec(job_uri, token="keep", **{"airflow-spot:run": "live"}))
    gone = backend.launch(spec(job_uri, token="gone", **{"airflow-spot:run": "dead"}))
    options = json.dumps({"state_dir": str(backend.state.root)})
    assert main(["reap", "--backend-options", options, "--tag", "airflow-spot:run=dead"]) == 0
    assert "terminated 1 instance(s)" in capsys.readouterr().out
    assert states(backend) == {keep.instance_id: ("running", ""), gone.instance_id: ("terminated", "user")}
    assert main(["reap", "--backend-options", options, "--tag", "airflow-spot:run=dead"]) == 0
    assert "no live instances match" in capsys.readouterr().out


def test_older_than_spares_young_instances(backend, job_uri, capsys):
    backend.launch(spec(job_uri))
    options = json.dumps({"state_dir": str(backend.state.root)})
    assert main(["reap", "--backend-options", options, "--older-than", "3600"]) == 0
    assert "no live instances match" in capsys.readouterr().out
    assert all(s == ("running", "") for s in states(backend).values())


def test_leftovers_selects_live_and_old_enough(backend, job_uri):
    a = backend.launch(spec(job_uri, token="a"))
    b = backend.launch(spec(job_uri, token="b"))
    backend.terminate([b.instance_id])
    infos = backend.list_instances()
    now = time.time()
    assert [i.instance_id for i in leftovers(infos, 0, now)] == [a.instance_id]
    assert leftovers(infos, 10, now) == []
    assert [i.instance_id for i in leftovers(infos, 10, now + 11)] == [a.instance_id]
    assert backend.describe([b.instance_id])[b.instance_id].reason is TerminationReason.USER
    assert backend.describe([a.instance_id])[a.instance_id].state is InstanceState.RUNNING


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tag", "novalue"], "--tag wants KEY=VALUE"),
        (["--older-than", "-5"], "--older-than must be >= 0"),
        (["--backend-options", "[1]"], "must be a JSON object"),
    ],
)
def test_bad_arguments_are_explained(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["reap", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_unknown_backend_is_explained(capsys):
    assert main(["reap", "--backend", "gce"]) == 2
    assert "unknown backend 'gce'; valid backends:" in capsys.readouterr().err


def test_purge_forgets_old_terminated_instances_only(backend, job_uri, capsys):
    live = backend.launch(spec(job_uri, token="live"))
    ended = backend.launch(spec(job_uri, token="ended"))
    backend.terminate([ended.instance_id])
    options = json.dumps({"state_dir": str(backend.state.root)})
    assert main(["reap", "--backend-options", options, "--purge-older-than", "3600", "--tag", "none=none"]) == 0
    assert "purged 0" in capsys.readouterr().out
    assert main(["reap", "--backend-options", options, "--purge-older-than", "0", "--tag", "none=none"]) == 0
    assert "purged 1" in capsys.readouterr().out
    assert [i.instance_id for i in backend.list_instances()] == [live.instance_id]
    assert not backend.instance_dir(ended.instance_id).exists()
    assert backend.state.token_instance("ended") is None and backend.state.token_instance("live") == live.instance_id


def test_reap_bills_the_attempts_it_ends_and_the_idle_time_of_its_instances(backend, job_uri, tmp_path, capsys,
                                                                           monkeypatch):
    """Reaping ends instances whose DAG run went (deleted, or marked failed before its finish task ran):
    their attempts had no ledger row, so their time was missing from the job's cost and the job's page
    showed them running (then preempted, from the status the termination brings about). Reap bills them
    as the finish task does: the kill recorded before the termination, the attempt ``abandoned`` after.
    Only instances of runs it found over (``--runs finished``); with ``--runs any`` it bills nothing, since a
    running run's segments account for their own attempts."""
    from local_helpers import request, wait_for

    from airflow_spot.operators.attempt_record import AttemptLaunch
    from airflow_spot.policy.ledger import LedgerRow
    from airflow_spot.storage.ledger_store import LedgerStore
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout

    from airflow_spot.commands import airflow_lookups

    gone_run = {"airflow-spot:run": "a-deleted-run"}  # no such DAG run in Airflow's database: over
    monkeypatch.setattr(airflow_lookups, "dag_run_states", lambda keys: {k: None for k in keys})
    info = backend.launch(spec(job_uri, **gone_run))
    store = open_store(job_uri)
    layout = JobLayout(store)
    started = tmp_path / "started"
    layout.write_request(info.instance_id, request(job_uri, "s.try1", (
        "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
        f"open({str(started)!r}, 'w').close()\ntime.sleep(60)\n")))
    now = time.time()
    AttemptLaunch("s.try1", 0, 0, 10, info.instance_id, info.offer.to_dict(), now - 5, now - 5, False, 1,
                  "s").write(store)
    # an earlier job's attempt on an instance already gone is not this reap's to bill
    AttemptLaunch("old.try1", 0, 0, 10, "i-gone", info.offer.to_dict(), now - 900, now - 900, False, 1,
                  "s").write(store)
    wait_for(started.exists, 15, "the attempt's command to start")
    options = json.dumps({"state_dir": str(backend.state.root)})
    assert main(["reap", "--backend-options", options, "--runs", "finished"]) == 0
    out = capsys.readouterr().out
    assert "terminated 1 instance(s)" in out and f"billed in {job_uri}: 1 attempt(s)" in out, out
    (row,) = LedgerStore(store).rows()
    assert row.attempt_id == "s.try1" and row.outcome == "abandoned" and row.cost > 0
    assert layout.read_kill("s.try1") is not None
    wait_for(lambda: layout.read_status("s.try1") is not None, 15, "the attempt's status on the termination")
    assert layout.read_status("s.try1").kill_seen is True
    # a warm instance (its attempt accounted for) is billed its idle time to the reap
    warm = backend.launch(spec(job_uri, token="warm", **gone_run))
    LedgerStore(store).write(LedgerRow(
        attempt_id="s.try2", instance_id=warm.instance_id, instance_type="g5.xlarge", zone=warm.offer.zone,
        market="spot", price_per_hour=0.4, on_demand_price_per_hour=1.0, started_at=now - 1000,
        ended_at=now - 600, steps_done=5, outcome="completed", segment_index=0))
    assert main(["reap", "--backend-options", options, "--runs", "finished"]) == 0
    assert "attempt(s)" in capsys.readouterr().out
    (idle,), _ = LedgerStore(store).idle_rows()
    assert idle.instance_id == warm.instance_id and idle.started_at == now - 600
    # --runs any may end a running run's instances: its segments bill their attempts, reap bills nothing
    other = backend.launch(spec(job_uri, token="any", **gone_run))
    LedgerStore(store).write(LedgerRow(
        attempt_id="s.try3", instance_id=other.instance_id, instance_type="g5.xlarge", zone=other.offer.zone,
        market="spot", price_per_hour=0.4, on_demand_price_per_hour=1.0, started_at=now - 1000,
        ended_at=now - 600, steps_done=5, outcome="completed", segment_index=0))
    assert main(["reap", "--backend-options", options]) == 0
    assert "billed" not in capsys.readouterr().out
    assert len(LedgerStore(store).idle_rows()[0]) == 1
