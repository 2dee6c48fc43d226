"""SRE review of the agent (``airflow_spot/training/agent.py``): defects found while trusting it on instances.

Each test runs the agent as a real process (as the local backend, the runner container and EC2's user data
do) and fails because of one defect; its docstring names the mechanism and the behaviour expected. Every
wait is bounded, and every process a test starts is ended by its pid (the agent, and what is left of the
process group it leads: its commands and their children).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import AttemptStatus, JobLayout, SegmentRequest
from airflow_spot.testing.polling import wait_for

INSTANCE = "local-sre00001"
PY = sys.executable


def alive(pid: int) -> bool:
    """The process runs (a zombie waiting for its parent does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes of process group ``pgid`` (orphans keep their group)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def kill_pids(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Agent:
    """One agent process serving ``INSTANCE`` of a job, leader of a session of its own (like the local
    backend's instances)."""

    def __init__(self, tmp_path: Path, job_uri: str | None = None, *, idle: float = 60.0, term_grace: float = 5.0,
                 wrap: list[str] | None = None, env: dict | None = None) -> None:
        self.tmp = tmp_path
        self.job_uri = job_uri or "file://" + str(tmp_path / "job")
        self.work_dir = tmp_path / "instance"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.notice_file = tmp_path / "notice"
        self.layout = JobLayout(open_store(self.job_uri))
        self.log_path = tmp_path / "agent.log"
        argv = [PY, "-m", "airflow_spot.training.agent", "--job-uri", self.job_uri, "--instance-id", INSTANCE,
                "--work-dir", str(self.work_dir), "--notice-file", str(self.notice_file), "--poll-interval", "0.1",
                "--idle-timeout", str(idle), "--term-grace", str(term_grace)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen((wrap or []) + argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        self.extra_pids: list[int] = []

    def submit(self, attempt_id: str, command: list[str], **kwargs) -> SegmentRequest:
        kwargs.setdefault("created_at", time.time())
        kwargs.setdefault("total_steps", 20)  # the job's last segment: no hand-off directory unless asked
        req = SegmentRequest(attempt_id=attempt_id, job_uri=self.job_uri, segment_index=0, start_step=10,
                             end_step=20, command=command, **kwargs)
        self.layout.write_request(INSTANCE, req)
        return req

    def status(self, attempt_id: str, timeout: float = 20.0) -> AttemptStatus:
        return wait_for(lambda: self.layout.read_status(attempt_id), timeout, f"status of {attempt_id}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """Kill, by pid, the agent and every process left in its group, then reap the agent."""
        pids = [self.proc.pid, *group_members(self.proc.pid), *self.extra_pids]
        kill_pids(pids)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def agents(tmp_path):
    started: list[Agent] = []

    def start(**kwargs) -> Agent:
        a = Agent(tmp_path, **kwargs)
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()


def read_pid(path: Path, timeout: float = 20.0) -> int:
    return int(wait_for(lambda: path.exists() and path.read_text().strip(), timeout, f"pid in {path.name}"))


# --------------------------------------------------------------------------------------------------------------
# 1. SIGTERM is forwarded to the command's process only, not to its process group


def test_sigterm_reaches_the_training_process_behind_a_wrapper_script(agents, tmp_path):
    """Mechanism: ``agent.py: Agent._forward_sigterm`` sends SIGTERM with ``child.send_signal`` to the direct
    child only (``Agent._run_command`` starts it with ``subprocess.Popen`` in the agent's own process group,
    and ``child.kill()`` after the grace also reaches only it). A training command started through a wrapper
    (``["bash", "train.sh"]``, ``["sh", "-c", "cd /opt/p && python3 train.py"]``: neither shell execs its last
    command) never hears the notice: the shell dies of the SIGTERM at once, the agent writes ``preempted``
    with the step committed before any emergency save, and exits (on EC2 the user data then powers the
    instance off; in the runner container the agent is PID 1 and ``docker stop`` signals it alone; the local
    backend's ``terminate`` signals the agent alone), while the training process runs on unsaved, orphaned.

    Expected: the agent signals the command's whole process group (start it in a session of its own and
    ``killpg`` it), waits up to the grace for that group to finish (the training's emergency save), and
    leaves none of the attempt's processes behind.
    """
    got, saved, pid_file = tmp_path / "got-sigterm", tmp_path / "saved", tmp_path / "train.pid"
    (tmp_path / "train.py").write_text(
        "import os, signal, sys, time\n"
        "def on_term(*_):\n"
        f"    open({str(got)!r}, 'w').close()\n"
        "    time.sleep(1.0)  # the emergency save\n"
        f"    open({str(saved)!r}, 'w').close()\n"
        "    sys.exit(75)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    wrapper = tmp_path / "train.sh"
    wrapper.write_text(f"#!/bin/bash\ncd {str(tmp_path)!r}\n{PY} train.py\n")
    a = agents(term_grace=5.0)
    a.submit("a1", ["bash", str(wrapper)])
    train_pid = read_pid(pid_file)
    a.extra_pids.append(train_pid)

    os.kill(a.proc.pid, signal.SIGTERM)  # the agent alone, as the local backend and `docker stop` do
    assert a.proc.wait(timeout=20) == 0
    status = a.status("a1", timeout=2)
    assert status.outcome == "preempted"
    assert got.exists(), "the training process behind the wrapper never got the SIGTERM (no emergency save)"
    assert saved.exists(), "the agent gave up on the attempt before its training process finished saving"
    deadline = time.monotonic() + 3
    while alive(train_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(train_pid), f"the training process {train_pid} outlived the agent"


# --------------------------------------------------------------------------------------------------------------
# 2. The processes an attempt leaves behind keep running on the (warm) instance


def test_processes_an_attempt_left_behind_do_not_outlive_it(agents, tmp_path):
    """Mechanism: ``agent.py: Agent._run_command`` waits for the command's own process and
    ``Agent.run_request`` then writes the status and serves the next request; nothing ends the processes the
    command started (a background evaluation, a helper server, a subprocess the script forgot, workers of a
    crashed launcher). They run on, in the agent's process group, into the next segment on the same warm
    instance, holding its GPU memory and CPU (the next attempt then fails with CUDA out of memory, a user
    failure that is nobody's code), and no status or log names them.

    Expected: when an attempt's command has ended (no warm process kept), the agent ends what is left of the
    attempt's process group (SIGTERM, then SIGKILL after a short grace) before it reports and serves the next
    request, as Slurm or Kubernetes end a job's process tree.
    """
    helper_pid_file = tmp_path / "helper.pid"
    a = agents()
    a.submit("a1", [PY, "-c",
                    "import subprocess, sys\n"
                    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                    f"open({str(helper_pid_file)!r}, 'w').write(str(p.pid))\n"
                    "print('segment done; helper', p.pid, 'left running')\n"])
    status = a.status("a1")
    helper = read_pid(helper_pid_file)
    a.extra_pids.append(helper)
    assert status.outcome == "completed"
    deadline = time.monotonic() + 5
    while alive(helper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(helper), f"the attempt's helper process {helper} still runs after the attempt's status"


# --------------------------------------------------------------------------------------------------------------
# 3. The final status is given up after ~10 s of store outage, though the agent lives on


def test_final_status_is_written_once_the_store_comes_back(tmp_path, monkeypatch):
    """Mechanism: ``agent.py: Agent._write_status_once`` tries 6 times over ~10.5 s and then drops the status
    ("gave up writing the status"); ``Agent.run`` goes on serving (and waits out the same outage for request
    polls up to the idle timeout), but never retries the dropped status. An S3 outage or network blip longer
    than ~10 s at the moment a command ends therefore turns its attempt into ``lost``: the trigger waits the
    whole heartbeat window (300 s) and then retries it on the *preemption* budget at once; a user failure loses
    its error tail and skips ``retry_delay``.

    Expected: a status that could not be written stays pending and is retried (with backoff) while the agent
    runs, before it serves another request or exits, so it lands as soon as the store answers again.
    """
    from moto.server import ThreadedMotoServer

    from airflow_spot.testing.moto_s3 import FAKE_CREDENTIALS, create_bucket

    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # each call fails fast while the endpoint is down
    create_bucket(endpoint, "jobs")
    job_uri = "s3://jobs/run-1"
    go = tmp_path / "go"
    a = Agent(tmp_path, job_uri=job_uri, env=dict(os.environ))
    try:
        a.submit("a1", [PY, "-c",
                        "import os, sys, time\n"
                        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
                        "print('Traceback: the user code failed'); sys.exit(3)\n"])
        wait_for(lambda: "attempt a1: steps" in a.log(), 20, "the agent to start the attempt")
        server.stop()  # the store goes away while the command runs...
        go.touch()  # ... and the command ends during the outage
        wait_for(lambda: "cannot write the status of a1" in a.log(), 15, "a failed status write")
        outage_end = time.monotonic() + 11.5  # an outage of ~12 s
        while time.monotonic() < outage_end and "gave up writing the status" not in a.log():
            time.sleep(0.1)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        assert a.proc.poll() is None  # the agent itself is fine and serving
        status = wait_for(lambda: JobLayout(open_store(job_uri)).read_status("a1"), 12,
                          "the status of a1 once the store is back")
        assert status.outcome == "failed" and status.exit_code == 3
        assert "the user code failed" in status.error_tail
    finally:
        server.stop()
        a.stop()


# --------------------------------------------------------------------------------------------------------------
# 4. A full local disk kills the agent in the middle of a request


def _unshare_tmpfs_works(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {str(probe)!r}"],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def test_a_full_disk_fails_the_request_instead_of_killing_the_agent(agents, tmp_path):
    """Mechanism: ``agent.py: Agent._run_command`` makes the hand-off directory
    (``channel.path.mkdir``, for every segment but the job's last), opens the attempt's log and writes the
    warm hand-over note, and ``handoff.py: WarmProcess.hand_over`` writes the answer file, all outside any
    ``try``; only ``Popen`` is guarded. On a full disk (ext4 out of blocks refuses a new directory with
    ENOSPC while files can still be created; here a tmpfs out of inodes, the same error at the same line) the
    ``OSError`` escapes ``Agent.run_request`` and ``Agent.run``: the agent dies with a traceback in its own
    log only (``/var/log/airflow-spot-agent.log`` on EC2, gone with the instance), the attempt gets no status
    (``lost`` after the start-up window, retried on the preemption budget), and on EC2 the user data powers
    the instance off.

    Expected: a local write that fails ends that request with a status (``failed`` with the ENOSPC in its
    tail, or the command run without a hand-off), and the agent keeps serving.
    """
    if not _unshare_tmpfs_works(tmp_path):
        pytest.skip("needs unshare -rm and a tmpfs mount in a private mount namespace")
    work = tmp_path / "instance"
    work.mkdir()
    # the agent's work dir is a small filesystem of its own, private to the agent's mount namespace
    a = agents(wrap=["unshare", "-rm", "sh", "-c",
                     f"mount -t tmpfs -o size=4m,nr_inodes=64 tmpfs {str(work)!r} && exec \"$@\"", "agent"])
    # the first segment's command fills the disk (its data cache, its outputs), then ends well
    a.submit("a1", [PY, "-c",
                    "import itertools\n"
                    "for i in itertools.count():\n"
                    "    try:\n"
                    "        open(f'cache-{i}', 'w').close()\n"
                    "    except OSError:\n"
                    "        break\n"],
             cwd=str(work))
    assert a.status("a1").outcome == "completed"
    # the next segment of the job, on the same (warm) instance: not the last, so a hand-off is offered
    a.submit("a2", [PY, "-c", "print('second segment')"], total_steps=100)
    wait_for(lambda: a.layout.read_status("a2") or a.proc.poll() is not None, 15, "a2's status or the agent's end")
    status = a.layout.read_status("a2")
    if status is None:
        pytest.fail(f"no status for a2: the agent died (exit {a.proc.poll()}); its log ends with:\n"
                    + a.log()[-1200:])
    if status.outcome == "failed":
        assert "No space left on device" in status.error_tail
    assert a.proc.poll() is None, "the agent died after the request"


# --------------------------------------------------------------------------------------------------------------
# 5. A SIGTERM death reported by a wrapper as 128+15 is counted as the user's failure


def test_a_wrapper_reporting_the_sigterm_death_as_143_is_preempted(agents, tmp_path):
    """Mechanism: ``agent.py: outcome_for_exit`` recognises a SIGTERM death while the instance stops (or under
    a notice) only as a negative return code (``-15``). A command run through an entrypoint that forwards
    SIGTERM and exits with its child's status (``docker run``, a ``trap``-and-``wait`` entrypoint script,
    ``uv run``) reports the same death the shell way, as exit status 143 (128 + 15), which falls through to
    ``failed``: a preemption (or a termination) that lands while the training process is still starting (no
    notice handler yet) spends the user-code ``retries`` and waits ``retry_delay``, where the same command
    run without the wrapper is ``preempted``
    (``test_agent.py::test_sigterm_forwarded_before_the_command_installs_a_handler_is_preempted``).

    Expected: while the agent is stopping or a notice was issued, exit status 128 + SIGTERM is classified like
    ``-SIGTERM`` (``preempted``, with the agent's note in the tail).
    """
    pid_file = tmp_path / "train.pid"
    (tmp_path / "train.py").write_text(  # still importing: no SIGTERM handler yet
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    )
    entrypoint = tmp_path / "entrypoint.sh"
    entrypoint.write_text(
        "#!/bin/bash\n"
        "# forwards SIGTERM to the trainer and exits with its status, as container entrypoints do\n"
        "trap 'kill -TERM \"$child\" 2>/dev/null' TERM\n"
        f"cd {str(tmp_path)!r}\n"
        f"{PY} train.py &\n"
        "child=$!\n"
        "while true; do wait \"$child\"; rc=$?; kill -0 \"$child\" 2>/dev/null || break; done\n"
        "exit $rc\n"
    )
    a = agents(term_grace=5.0)
    a.submit("a1", ["bash", str(entrypoint)])
    a.extra_pids.append(read_pid(pid_file))
    os.kill(a.proc.pid, signal.SIGTERM)  # the instance is being ended
    assert a.proc.wait(timeout=20) == 0
    status = a.status("a1", timeout=2)
    assert status.exit_code == 143  # the wrapper's report of its child's SIGTERM death
    assert status.outcome == "preempted", f"a SIGTERM death while stopping counted as {status.outcome}"
