"""The local backend: idempotent launch, describe, terminate, list, idle shutdown, serialisation, errors."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from local_helpers import request, spec, wait_for

from airflow_spot.backends.base import InstanceState, LaunchError, TerminationReason, get_backend
from airflow_spot.backends.local_state import STATE_DIR_ENV, group_alive, group_members
from airflow_spot.storage.protocol import Outcome


def test_launch_is_idempotent_on_the_token(backend, job_uri):
    first = backend.launch(spec(job_uri, token="same"))
    again = backend.launch(spec(job_uri, token="same"))
    other = backend.launch(spec(job_uri, token="other"))

    assert again.instance_id == first.instance_id
    assert other.instance_id != first.instance_id
    assert len(backend.list_instances()) == 2  # the repeated token started no second agent
    record = backend.record(first.instance_id)
    assert group_members(record.pgid) == [record.agent.pid]
    assert first.state is InstanceState.RUNNING and first.tags == {"airflow-spot:dag": "d", "airflow-spot:job-uri": job_uri}
    assert first.offer.instance_type == "g5.xlarge" and first.job_uri == job_uri


def test_concurrent_launches_with_one_token_start_one_instance(backend, job_uri):
    code = (
        "import json, sys\n"
        "from airflow_spot.backends.base import LaunchSpec, get_backend\n"
        "from airflow_spot.policy.offers import Offer\n"
        "kwargs, spec = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
        "spec['offer'] = Offer.from_dict(spec['offer'])\n"
        "print(get_backend('local', **kwargs).launch(LaunchSpec(**spec)).instance_id)\n"
    )
    s = spec(job_uri, token="raced")
    payload = json.dumps({**s.__dict__, "offer": s.offer.to_dict()})
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(backend.serialize()), payload],
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    ids = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(ids) == 1 and all(p.returncode == 0 for p in procs)
    assert [i.instance_id for i in backend.list_instances()] == list(ids)


def test_describe_is_batched_and_skips_unknown_ids(backend, job_uri):
    a = backend.launch(spec(job_uri, token="a"))
    b = backend.launch(spec(job_uri, token="b"))
    got = backend.describe([a.instance_id, b.instance_id, "local-doesnotexist", "../evil"])
    assert set(got) == {a.instance_id, b.instance_id}
    assert all(i.state is InstanceState.RUNNING for i in got.values())


def test_terminate_kills_the_whole_group_and_is_idempotent(backend, job_uri, layout):
    info = backend.launch(spec(job_uri))
    # a command that ignores SIGTERM: terminate must still end it (SIGKILL after the grace period)
    layout.write_request(info.instance_id, request(job_uri, "stubborn", (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)"
    )))
    record = backend.record(info.instance_id)
    log = backend.instance_dir(info.instance_id) / "attempts" / "stubborn.log"
    wait_for(lambda: log.exists() and "up" in log.read_text(), 10, "the command to ignore SIGTERM")
    assert len(group_members(record.pgid)) == 2  # agent and command share the instance's group

    backend.terminate([info.instance_id])

    assert not group_alive(record.pgid)
    after = backend.describe([info.instance_id])[info.instance_id]
    assert after.state is InstanceState.TERMINATED and after.reason is TerminationReason.USER
    assert after.terminated_at is not None
    backend.terminate([info.instance_id, "local-unknown"])  # again, and an unknown id: no error
    assert backend.describe([info.instance_id])[info.instance_id].reason is TerminationReason.USER


def test_terminate_lets_the_command_react_to_sigterm(backend, job_uri, layout):
    info = backend.launch(spec(job_uri))
    layout.write_request(info.instance_id, request(job_uri, "polite", (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
        "print('up', flush=True)\ntime.sleep(60)"
    )))
    log = backend.instance_dir(info.instance_id) / "attempts" / "polite.log"
    wait_for(lambda: log.exists() and "up" in log.read_text(), 10, "the command to start")
    backend.terminate([info.instance_id])
    status = layout.read_status("polite")
    assert status is not None and status.outcome == Outcome.PREEMPTED.value and status.exit_code == 75


def test_list_instances_filters_by_tags(backend, job_uri):
    a = backend.launch(spec(job_uri, token="a", **{"airflow-spot:run": "r1"}))
    b = backend.launch(spec(job_uri, token="b", **{"airflow-spot:run": "r2"}))
    assert [i.instance_id for i in backend.list_instances({"airflow-spot:run": "r1"})] == [a.instance_id]
    assert {i.instance_id for i in backend.list_instances({"airflow-spot:dag": "d"})} == {a.instance_id, b.instance_id}
    assert backend.list_instances({"airflow-spot:dag": "other"}) == []


def test_agent_shuts_down_after_idle_timeout(backend, job_uri):
    info = backend.launch(spec(job_uri, idle=0.8))
    ended = wait_for(lambda: (i := backend.describe([info.instance_id])[info.instance_id]).state.is_terminal() and i,
                     15, "idle shutdown")
    assert ended.reason is TerminationReason.IDLE


def test_agent_killed_by_someone_else_is_failed_and_its_command_does_not_survive(backend, job_uri, layout):
    info = backend.launch(spec(job_uri))
    layout.write_request(info.instance_id, request(job_uri, "a1", "import time; time.sleep(60)"))
    record = backend.record(info.instance_id)
    wait_for(lambda: len(group_members(record.pgid)) == 2, 10, "the command to start")
    os.kill(record.agent.pid, signal.SIGKILL)  # only the agent: its child is orphaned in the group
    ended = wait_for(lambda: (i := backend.describe([info.instance_id])[info.instance_id]).state.is_terminal() and i,
                     10, "describe to notice the dead agent")
    assert ended.reason is TerminationReason.FAILED
    wait_for(lambda: not group_alive(record.pgid), 5, "the orphaned command to be killed")


def test_another_process_sees_the_same_instances(backend, job_uri):
    info = backend.launch(spec(job_uri, idle=60))
    code = (
        "import json, sys\n"
        "from airflow_spot.backends.base import get_backend\n"
        "b = get_backend('local', **json.loads(sys.argv[1]))\n"
        "i = b.describe([sys.argv[2]])[sys.argv[2]]\n"
        "b.terminate([i.instance_id])\n"
        "print(i.state.value, b.describe([sys.argv[2]])[sys.argv[2]].reason.value)\n"
    )
    kwargs = json.dumps(backend.serialize())
    env = {k: v for k, v in os.environ.items() if k != STATE_DIR_ENV}
    out = subprocess.run([sys.executable, "-c", code, kwargs, info.instance_id], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["running", "user"]
    assert backend.describe([info.instance_id])[info.instance_id].reason is TerminationReason.USER


def test_state_dir_defaults_to_the_environment_variable(tmp_path, monkeypatch, make_backend):
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "from-env"))
    backend = make_backend(state_dir=None)
    assert backend.serialize()["state_dir"] == str((tmp_path / "from-env").resolve())
    assert get_backend("local", **backend.serialize()).serialize() == backend.serialize()


def test_simulated_boot_keeps_the_instance_pending(make_backend, job_uri, layout):
    backend = make_backend(boot_seconds=1.5)
    launched_at = time.monotonic()
    info = backend.launch(spec(job_uri))
    assert info.state is InstanceState.PENDING
    layout.write_request(info.instance_id, request(job_uri, "a1", "pass"))
    status = wait_for(lambda: layout.read_status("a1"), 15, "the request to run after boot")
    assert status.started_at >= info.launched_at + 1.5
    assert time.monotonic() - launched_at >= 1.5
    assert backend.describe([info.instance_id])[info.instance_id].state is InstanceState.RUNNING


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"notice_window_seconds": -1}, "notice_window_seconds must be >= 0"),
        ({"poll_interval_seconds": 0}, "poll_interval_seconds must be > 0"),
        ({"boot_seconds": "5"}, "boot_seconds must be a number"),
        ({"preemption": {"mode": "sometimes"}}, "valid modes: none, schedule, rate, offer, trace"),
        ({"python": "/nonexistent/python"}, "not an executable interpreter"),
    ],
)
def test_bad_options_fail_early_with_a_clear_message(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_backend("local", state_dir=str(tmp_path / "s"), **kwargs)


def test_unwritable_state_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="state directory .* cannot be created"):
        get_backend("local", state_dir=str(blocker / "state"))


def test_launch_rejects_a_spec_without_token(backend, job_uri):
    with pytest.raises(LaunchError, match="idempotency_token") as err:
        backend.launch(spec(job_uri, token=""))
    assert err.value.capacity is False


@pytest.mark.parametrize("step", [1.0, -1.0])
def test_a_clock_step_does_not_make_a_live_agent_look_dead(backend, job_uri, monkeypatch, step):
    """psutil's start time in seconds since the epoch is boot time + ticks since boot, and ``btime`` in
    /proc/stat moves when the wall clock is stepped or slewed past a second: a live instance whose recorded
    start time was read before such a move must still be alive, and not be killed as a dead agent's leftovers."""
    import psutil
    from psutil import _pslinux

    from airflow_spot.backends.local_state import ProcessRef

    info = backend.launch(spec(job_uri))
    record = backend.record(info.instance_id)
    booted = _pslinux.boot_time()
    monkeypatch.setattr(_pslinux, "boot_time", lambda: booted + step)
    assert abs(psutil.Process(record.agent.pid).create_time() - record.agent.create_time) >= 0.99  # the clock moved

    assert record.agent.alive() and not record.agent.reused()
    assert backend.describe([info.instance_id])[info.instance_id].state is InstanceState.RUNNING
    assert group_members(record.pgid) == [record.agent.pid]
    other = ProcessRef(record.agent.pid, record.agent.create_time, record.agent.start_ticks - 1)
    assert not other.alive() and other.reused()  # the ticks, not the epoch seconds, say which process it is


def test_a_record_without_start_ticks_is_still_read_and_checked(backend, job_uri):
    """A record written before ProcessRef carried the boot-relative start (schema 1) identifies its agent by
    the epoch start time: the live agent is alive, and a pid given to another process is not it."""
    from airflow_spot.backends.local_state import InstanceRecord, ProcessRef

    info = backend.launch(spec(job_uri))
    old = backend.record(info.instance_id).to_dict()
    old["schema"] = 1
    del old["agent"]["start_ticks"]
    record = InstanceRecord.from_dict(old)
    assert record.agent.start_ticks is None and record.agent.alive()
    stranger = ProcessRef(record.agent.pid, record.agent.create_time - 3600)
    assert not stranger.alive() and stranger.reused()
