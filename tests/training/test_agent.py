"""The agent as a real process: requests in, statuses out, warm reuse, idle shutdown, SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import AttemptStatus, JobLayout, SegmentRequest
from airflow_spot.testing.polling import wait_for
from airflow_spot.training import env as E
from airflow_spot.training.agent import AGENT_EXIT_FILE, agent_key

INSTANCE = "local-test0001"


class AgentProcess:
    def __init__(self, tmp_path: Path, idle: float = 30.0, term_grace: float = 5.0) -> None:
        self.job_uri = "file://" + str(tmp_path / "job")
        self.work_dir = tmp_path / "instance"
        self.notice_file = tmp_path / "notice"
        self.layout = JobLayout(open_store(self.job_uri))
        self.args = ["--idle-timeout", str(idle), "--term-grace", str(term_grace)]
        self.log_path = tmp_path / "agent.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "airflow_spot.training.agent", "--job-uri", self.job_uri,
                 "--instance-id", INSTANCE, "--work-dir", str(self.work_dir), "--notice-file", str(self.notice_file),
                 "--poll-interval", "0.1", *self.args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return self

    def submit(self, attempt_id: str, command: list[str], **kwargs) -> SegmentRequest:
        kwargs.setdefault("created_at", time.time())
        req = SegmentRequest(attempt_id=attempt_id, job_uri=self.job_uri, segment_index=0, start_step=10,
                             end_step=20, command=command, **kwargs)
        self.layout.write_request(INSTANCE, req)
        return req

    def status(self, attempt_id: str, timeout: float = 20.0) -> AttemptStatus:
        return wait_for(lambda: self.layout.read_status(attempt_id), timeout, f"status of {attempt_id}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            from airflow_spot.backends.local_state import kill_group

            kill_group(self.proc.pid, signal.SIGKILL)  # the agent's session: its commands' groups too
            self.proc.wait(timeout=10)


@pytest.fixture
def agent(tmp_path):
    started = []

    def start(start: bool = True, **kwargs) -> AgentProcess:
        a = AgentProcess(tmp_path, **kwargs)
        started.append(a)
        return a.start() if start else a

    yield start
    for a in started:
        a.stop()
        if a.proc is not None:
            with pytest.raises(ProcessLookupError):  # nothing of the instance's group is left
                os.killpg(a.proc.pid, 0)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.parametrize(
    "exit_code, outcome",
    [(0, "completed"), (75, "preempted"), (1, "failed"), (3, "failed")],
)
def test_exit_code_decides_the_outcome(agent, exit_code, outcome):
    a = agent()
    a.submit("a1", py(f"import sys; print('hello from the command'); sys.exit({exit_code})"))
    status = a.status("a1")
    assert status.outcome == outcome and status.exit_code == exit_code
    assert status.instance_id == INSTANCE and status.ended_at >= status.started_at
    assert "hello from the command" in status.error_tail
    assert "hello from the command" in (a.work_dir / "attempts" / "a1.log").read_text()


def test_command_gets_the_segment_environment(agent, tmp_path):
    a = agent()
    out = tmp_path / "env.json"
    names = [E.JOB_URI, E.ATTEMPT_ID, E.START_STEP, E.END_STEP, E.NOTICE_FILE, E.MTBF_SECONDS,
             E.CKPT_MIN_INTERVAL, E.CKPT_MAX_INTERVAL, E.CKPT_KEEP, E.WARM_START_URI, "MY_VAR"]
    dump = f"import json, os; json.dump({{n: os.environ.get(n) for n in {names!r}}}, open({str(out)!r}, 'w'))"
    a.submit("a1", py(dump),
             env={"MY_VAR": "mine", E.JOB_URI: "file:///elsewhere"}, mtbf_seconds=120.0, min_interval_seconds=5.0,
             max_interval_seconds=60.0, keep_checkpoints=2, warm_start_uri="file:///previous-run")
    assert a.status("a1").outcome == "completed"
    seen = json.loads(out.read_text())
    assert seen == {
        E.JOB_URI: a.job_uri, E.ATTEMPT_ID: "a1", E.START_STEP: "10", E.END_STEP: "20",
        E.NOTICE_FILE: str(a.notice_file), E.MTBF_SECONDS: "120.0", E.CKPT_MIN_INTERVAL: "5.0",
        E.CKPT_MAX_INTERVAL: "60.0", E.CKPT_KEEP: "2", E.WARM_START_URI: "file:///previous-run", "MY_VAR": "mine",
    }


def test_missing_command_is_a_failed_attempt_not_a_dead_agent(agent):
    a = agent()
    a.submit("a1", ["/no/such/program", "--flag"])
    status = a.status("a1")
    assert status.outcome == "failed" and status.exit_code is None
    assert "cannot start command ['/no/such/program', '--flag']" in status.error_tail
    assert "No such file or directory" in status.error_tail
    a.submit("a2", py("pass"))  # the agent is still serving
    assert a.status("a2").outcome == "completed"


def test_bad_cwd_is_a_failed_attempt(agent, tmp_path):
    a = agent()
    a.submit("a1", py("pass"), cwd=str(tmp_path / "missing-dir"))
    status = a.status("a1")
    assert status.outcome == "failed" and "missing-dir" in status.error_tail


def test_warm_instance_runs_requests_in_order_of_creation(agent, tmp_path):
    a = agent(start=False)
    marks = tmp_path / "order.txt"
    now = time.time()
    # written in the opposite order, before the agent starts: created_at decides
    a.submit("second", py(f"open({str(marks)!r}, 'a').write('second\\n')"), created_at=now + 1)
    a.submit("first", py(f"open({str(marks)!r}, 'a').write('first\\n')"), created_at=now)
    a.start()
    second = a.status("second")
    first = a.status("first")
    assert marks.read_text().split() == ["first", "second"]
    assert first.ended_at <= second.started_at
    a.submit("third", py("pass"))  # a later segment on the same warm instance
    assert a.status("third").outcome == "completed"
    assert a.proc.poll() is None


def test_attempt_with_a_status_is_never_run_again(agent, tmp_path):
    marker = tmp_path / "ran"
    a = agent()
    old = AttemptStatus(attempt_id="done", outcome="completed", exit_code=0, started_at=1.0, ended_at=2.0)
    a.layout.write_status(old)
    a.submit("done", py(f"open({str(marker)!r}, 'w').write('ran')"))
    a.submit("next", py("pass"))
    a.status("next")
    assert not marker.exists()
    assert a.layout.read_status("done") == old


def test_unreadable_status_also_means_never_again(agent, tmp_path):
    marker = tmp_path / "ran"
    a = agent(start=False)
    a.layout.store.put_bytes(a.layout.status_key("future"), b'{"schema": 99, "attempt_id": "future"}')
    a.submit("future", py(f"open({str(marker)!r}, 'w').write('ran')"))
    a.start()
    a.submit("next", py("pass"))
    a.status("next")
    assert not marker.exists() and a.proc.poll() is None


def test_status_carries_the_last_committed_step(agent):
    a = agent()
    ckpts = CheckpointStore(open_store(a.job_uri).child("checkpoints"), writer="earlier")
    ckpts.save(7, lambda f: f.write(b"state"))
    a.submit("a1", py("import sys; sys.exit(75)"))
    assert a.status("a1").last_committed_step == 7


def test_idle_timeout_shuts_the_agent_down_cleanly(agent):
    a = agent(idle=0.7)
    a.submit("a1", py("pass"))
    a.status("a1")
    assert a.proc.wait(timeout=15) == 0
    marker = json.loads((a.work_dir / AGENT_EXIT_FILE).read_text())
    assert marker["reason"] == "idle"
    liveness = json.loads(open_store(a.job_uri).get_bytes(agent_key(INSTANCE)))
    assert liveness["state"] == "exited" and liveness["exit_reason"] == "idle"  # billed idle to its time
    assert JobLayout(open_store(a.job_uri)).agent_exits([INSTANCE]) == {INSTANCE: liveness["time"]}


def test_sigterm_is_forwarded_to_the_command_and_its_status_written(agent, tmp_path):
    a = agent()
    started = tmp_path / "started"
    a.submit("a1", py(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('saving', flush=True), sys.exit(75)))\n"
        f"open({str(started)!r}, 'w').close()\n"
        "time.sleep(60)\n"
    ))
    wait_for(started.exists, 15, "the command to start")
    os.kill(a.proc.pid, signal.SIGTERM)  # the agent only, not the group: it must forward
    assert a.proc.wait(timeout=15) == 0
    status = a.status("a1", timeout=1)
    assert status.outcome == "preempted" and status.exit_code == 75 and "saving" in status.error_tail
    assert json.loads((a.work_dir / AGENT_EXIT_FILE).read_text())["reason"] == "sigterm"
    liveness = json.loads(open_store(a.job_uri).get_bytes(agent_key(INSTANCE)))
    assert liveness["exit_reason"] == "sigterm"  # ended under it: its time to here is owed if nobody billed it
    assert JobLayout(open_store(a.job_uri)).agent_exits([INSTANCE]) == {INSTANCE: liveness["time"]}
    assert status.kill_seen is False  # no kill recorded before it: a preemption, whatever the clocks say


def test_a_status_the_recorded_kill_brought_about_says_so(agent, tmp_path):
    """The killer records the kill before it ends the instance; the status the termination brings about
    says it found the record (``kill_seen``), so no clock decides whether it was the kill's."""
    a = agent()
    started = tmp_path / "started"
    a.submit("a1", py(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
        f"open({str(started)!r}, 'w').close()\n"
        "time.sleep(60)\n"
    ))
    wait_for(started.exists, 15, "the command to start")
    JobLayout(open_store(a.job_uri)).write_kill("a1", time.time())
    os.kill(a.proc.pid, signal.SIGTERM)
    assert a.proc.wait(timeout=15) == 0
    status = a.status("a1", timeout=1)
    assert status.outcome == "preempted" and status.kill_seen is True


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(agent, tmp_path):
    a = agent(term_grace=0.5)
    started = tmp_path / "started"
    a.submit("a1", py(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(started)!r}, 'w').close()\ntime.sleep(60)\n"
    ))
    wait_for(started.exists, 15, "the command to start")
    os.kill(a.proc.pid, signal.SIGTERM)
    assert a.proc.wait(timeout=15) == 0
    status = a.status("a1", timeout=1)
    # killed because the instance is stopping, not because the user's code failed
    assert status.outcome == "preempted" and status.exit_code == -signal.SIGKILL
    assert "killed by signal 9" in status.error_tail


def test_a_command_killed_by_a_signal_on_its_own_is_failed(agent):
    a = agent()
    a.submit("a1", py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    status = a.status("a1")
    assert status.outcome == "failed" and status.exit_code == -signal.SIGKILL


def test_no_new_attempt_starts_under_a_preemption_notice(agent, tmp_path):
    a = agent()
    a.notice_file.write_text("preemption")
    marker = tmp_path / "ran"
    a.submit("a1", py(f"open({str(marker)!r}, 'w').close()"))
    status = a.status("a1")
    assert status.outcome == "preempted" and "preemption notice" in status.error_tail
    assert not marker.exists()



def test_agent_on_s3_waits_out_a_store_outage(tmp_path, monkeypatch):
    """The agent serves a job on s3:// (moto's server on 127.0.0.1) and survives the endpoint going away."""
    from moto.server import ThreadedMotoServer

    from airflow_spot.testing.moto_s3 import FAKE_CREDENTIALS, create_bucket

    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # fail fast while the endpoint is down
    create_bucket(endpoint, "jobs")
    job_uri = "s3://jobs/run-1"
    layout = JobLayout(open_store(job_uri))
    log_path = tmp_path / "agent.log"

    def submit(attempt_id: str) -> None:
        layout.write_request(INSTANCE, SegmentRequest(attempt_id=attempt_id, job_uri=job_uri, segment_index=0,
                                                      start_step=0, end_step=1, command=py("pass"),
                                                      created_at=time.time()))

    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "airflow_spot.training.agent", "--job-uri", job_uri, "--instance-id", INSTANCE,
             "--idle-timeout", "30", "--work-dir", str(tmp_path / "instance"), "--poll-interval", "0.1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        submit("before")
        assert wait_for(lambda: layout.read_status("before"), 30, "the first status").outcome == "completed"
        server.stop()  # the endpoint goes away for a while; moto keeps its buckets in this process
        wait_for(lambda: "cannot read requests from the store" in log_path.read_text(), 15, "failed polls")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        submit("after")
        assert wait_for(lambda: layout.read_status("after"), 30, "the status after the outage").outcome == "completed"
        assert proc.poll() is None
    finally:
        server.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _started_command(tmp_path, body: str = "") -> tuple[list[str], Path]:
    """A command that writes its pid to a file, then sleeps (no SIGTERM handler unless ``body`` sets one)."""
    pid_file = tmp_path / "pid"
    return py(f"import os, signal, time\n{body}\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
              "time.sleep(60)\n"), pid_file


def test_sigterm_under_a_notice_before_any_handler_is_preempted(agent, tmp_path):
    """The preemption's SIGTERM reaches a command that has not installed its notice handler yet (still
    importing, say): it dies with -15, nothing is lost, and the attempt is preempted, not failed."""
    a = agent()
    command, pid_file = _started_command(tmp_path)
    a.submit("a1", command)
    wait_for(pid_file.exists, 15, "the command to start")
    a.notice_file.write_text("preemption")
    os.kill(int(wait_for(pid_file.read_text, 5, "the pid")), signal.SIGTERM)
    status = a.status("a1")
    assert status.outcome == "preempted" and status.exit_code == -signal.SIGTERM
    assert "preemption notice was issued" in status.error_tail


def test_sigterm_without_a_notice_or_a_stop_is_failed(agent, tmp_path):
    """A SIGTERM nobody announced (the user's own kill, a watchdog) is not a preemption."""
    a = agent()
    command, pid_file = _started_command(tmp_path)
    a.submit("a1", command)
    wait_for(pid_file.exists, 15, "the command to start")
    os.kill(int(wait_for(pid_file.read_text, 5, "the pid")), signal.SIGTERM)
    status = a.status("a1")
    assert status.outcome == "failed" and status.exit_code == -signal.SIGTERM


def test_a_crash_by_signal_while_stopping_is_still_failed(agent, tmp_path):
    """The agent forwards SIGTERM and the command crashes on it (abort): the user's code failed."""
    a = agent()
    command, pid_file = _started_command(tmp_path, "signal.signal(signal.SIGTERM, lambda *a: os.abort())")
    a.submit("a1", command)
    wait_for(pid_file.exists, 15, "the command to start")
    os.kill(a.proc.pid, signal.SIGTERM)
    assert a.proc.wait(timeout=15) == 0
    status = a.status("a1", timeout=1)
    assert status.outcome == "failed" and status.exit_code == -signal.SIGABRT


def test_sigterm_forwarded_before_the_command_installs_a_handler_is_preempted(agent, tmp_path):
    a = agent()
    command, pid_file = _started_command(tmp_path)
    a.submit("a1", command)
    wait_for(pid_file.exists, 15, "the command to start")
    os.kill(a.proc.pid, signal.SIGTERM)
    assert a.proc.wait(timeout=15) == 0
    status = a.status("a1", timeout=1)
    assert status.outcome == "preempted" and status.exit_code == -signal.SIGTERM
    assert "instance was stopping" in status.error_tail


def test_a_launcher_exit_after_the_session_ended_for_a_notice_is_a_preemption(agent):
    """torchrun exits 1 when its ranks exit 75; the session's word in SPOT_OUTCOME_FILE says why. A later
    attempt's plain failure is not taken for a preemption by that earlier word."""
    a = agent()
    write_then_fail = ("import os, sys; open(os.environ['SPOT_OUTCOME_FILE'], 'w').write('preempted a1\\n'); "
                       "sys.exit(1)")
    a.submit("a1", py(write_then_fail))
    status = a.status("a1")
    assert status.outcome == "preempted" and status.exit_code == 1
    assert "ended the attempt for a preemption notice" in status.error_tail
    a.submit("a2", py("import sys; sys.exit(1)"))
    assert a.status("a2").outcome == "failed"


def test_processes_a_command_started_in_sessions_of_their_own_end_with_it(agent, tmp_path):
    """torchrun starts each rank in a session of its own: a signal to the command's group misses them. The
    agent marks every process of the command (SPOT_COMMAND_TOKEN in its environment) and ends those too."""
    pid_file = tmp_path / "orphan.pid"
    a = agent()
    spawn = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
             f"start_new_session=True); open({str(pid_file)!r}, 'w').write(str(p.pid))")
    a.submit("a1", py(spawn))
    assert a.status("a1").outcome == "completed"
    orphan = int(pid_file.read_text())

    def gone() -> bool:
        try:
            with open(f"/proc/{orphan}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except FileNotFoundError:
            return True

    try:
        wait_for(lambda: gone() or None, 20.0, "the command's process in a session of its own to end")
    finally:
        if not gone():
            os.kill(orphan, signal.SIGKILL)


@pytest.mark.parametrize("bad", [{"heartbeat_seconds": 0.0}, {"heartbeat_seconds": -1.0},
                                 {"idle_timeout": float("nan")}, {"poll_interval": 0.0}, {"term_grace": -1.0}])
def test_the_agent_refuses_timings_that_would_spin_or_never_end(tmp_path, bad):
    """A heartbeat of 0 made the wait for the command tick without a pause (a busy loop on the instance);
    each timing is checked when the agent is made, with the values in the message."""
    from airflow_spot.training.agent import Agent

    kw = {"idle_timeout": 60.0, "work_dir": tmp_path / "w", **bad}
    with pytest.raises(ValueError, match="must be positive"):
        Agent(f"file://{tmp_path}/job", "i-1", **kw)


def test_the_command_is_marked_before_the_agent_can_signal_it(tmp_path, monkeypatch):
    """The SIGTERM handler signals ``self.child`` with its token (processes a launcher starts in sessions of
    their own carry only the token). A child visible to the handler before it was marked would get a signal
    that reaches its group alone, so the agent must never hold an unmarked child."""
    from airflow_spot.training.agent import Agent

    seen: list[str | None] = []

    class Watched(Agent):
        @property
        def child(self):
            return self.__dict__.get("_child")

        @child.setter
        def child(self, proc):
            if proc is not None:
                seen.append(getattr(proc, "spot_token", None))
            self.__dict__["_child"] = proc

    a = Watched(f"file://{tmp_path}/job", INSTANCE, idle_timeout=60.0, work_dir=tmp_path / "w",
                heartbeat_seconds=0.5)
    req = SegmentRequest(attempt_id="a1", job_uri=f"file://{tmp_path}/job", segment_index=0, start_step=0,
                         end_step=1, command=py("pass"), created_at=time.time())
    code, _ = a._run_command(req, tmp_path / "a1.log")
    assert code == 0
    assert seen and all(seen), f"the agent held the command before marking it with its token: {seen}"
