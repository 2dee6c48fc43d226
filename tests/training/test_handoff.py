"""Warm training processes across segment boundaries: the agent and real ``train_tiny`` processes.

Every wait is bounded; no test asserts on timing. Process identity comes from the heartbeats, which
carry the pid of the training process that wrote them.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import PREEMPTED_EXIT_CODE, JobLayout, SegmentRequest
from airflow_spot.testing.polling import wait_for
from airflow_spot.training.handoff import HandoffDir, incompatible, wants_handoff

INSTANCE = "local-warm0001"
TOTAL = 90
SEGMENTS = [(0, 30), (30, 60), (60, 90)]


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie not reaped yet still answers kill(0): look at its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


class WarmAgent:
    """A real agent process serving ``train_tiny`` segments of one job."""

    def __init__(self, tmp_path: Path, handoff_wait: float = 60.0, term_grace: float = 10.0) -> None:
        self.tmp = tmp_path
        self.job_uri = "file://" + str(tmp_path / "job")
        self.work_dir = tmp_path / "instance"
        self.notice_file = tmp_path / "notice"
        self.weights = tmp_path / "final.pt"
        self.layout = JobLayout(open_store(self.job_uri))
        self.log_path = tmp_path / "agent.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "airflow_spot.training.agent", "--job-uri", self.job_uri,
                 "--instance-id", INSTANCE, "--work-dir", str(self.work_dir), "--notice-file", str(self.notice_file),
                 "--poll-interval", "0.1", "--idle-timeout", "120", "--term-grace", str(term_grace),
                 "--handoff-wait", str(handoff_wait)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def command(self, **extra) -> list[str]:
        return [sys.executable, "-m", "airflow_spot.examples.train_tiny", "--total-steps", str(TOTAL),
                "--final-weights", str(self.weights), "--step-sleep", "0.002"]

    def submit(self, attempt_id: str, start: int, end: int, **kwargs) -> SegmentRequest:
        kwargs.setdefault("command", self.command())
        kwargs.setdefault("total_steps", TOTAL)
        kwargs.setdefault("env", {"SPOT_CKPT_MIN_INTERVAL": "3600", "SPOT_HEARTBEAT_SECONDS": "0.2"})
        req = SegmentRequest(attempt_id=attempt_id, job_uri=self.job_uri, segment_index=0, start_step=start,
                             end_step=end, created_at=time.time(), **kwargs)
        self.layout.write_request(INSTANCE, req)
        return req

    def status(self, attempt_id: str, timeout: float = 90.0):
        return wait_for(lambda: self.layout.read_status(attempt_id), timeout, f"status of {attempt_id}")

    def pid(self, attempt_id: str) -> int:
        hb = wait_for(lambda: self.layout.read_heartbeat(attempt_id), 30, f"heartbeat of {attempt_id}")
        return hb.pid

    def agent_log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def warm_agent(tmp_path):
    agents = []

    def start(**kwargs) -> WarmAgent:
        agents.append(WarmAgent(tmp_path, **kwargs))
        return agents[-1]

    yield start
    for a in agents:
        a.stop()


@pytest.fixture(scope="module")
def reference_weights(tmp_path_factory):
    """The same job trained without interruption, in one process."""
    d = tmp_path_factory.mktemp("ref")
    out = d / "ref.pt"
    subprocess.run(
        [sys.executable, "-m", "airflow_spot.examples.train_tiny", "--total-steps", str(TOTAL),
         "--job-uri", str(d / "job"), "--final-weights", str(out)],
        check=True, timeout=120, capture_output=True,
    )
    return torch.load(out), torch.load(str(out) + ".optim")


def assert_same_training(reference, weights: Path) -> None:
    ref_w, ref_o = reference
    got_w, got_o = torch.load(weights), torch.load(str(weights) + ".optim")
    assert ref_w.keys() == got_w.keys()
    for k in ref_w:
        assert torch.equal(ref_w[k], got_w[k]), f"weights differ at {k}"
    for pid, st in ref_o["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got_o["state"][pid][k]), f"optimizer state {pid}.{k} differs"


def run_segments(a: WarmAgent, names: list[str], **kwargs) -> list:
    statuses = []
    for name, (start, end) in zip(names, SEGMENTS, strict=True):
        a.submit(name, start, end, **kwargs)
        statuses.append(a.status(name))
        assert statuses[-1].outcome == "completed", statuses[-1].error_tail
    return statuses


def test_compatible_segments_continue_in_one_process_bit_exact(warm_agent, reference_weights):
    a = warm_agent()
    statuses = run_segments(a, ["s0", "s1", "s2"])
    pids = [a.pid(n) for n in ("s0", "s1", "s2")]
    assert len(set(pids)) == 1, f"one warm process ran all three segments, got pids {pids}"
    assert [s.last_committed_step for s in statuses] == [30, 60, 90]
    # the last segment ends the process (end == total steps): its final weights equal an uninterrupted run
    wait_for(lambda: a.weights.exists() and pid_gone(pids[0]), 30, "the last segment's process to exit")
    assert_same_training(reference_weights, a.weights)
    # only the first attempt started a process; the later ones say where their output went
    assert "resuming at step 0" in (a.work_dir / "attempts" / "s0.log").read_text()
    assert "continues in the warm training process" in (a.work_dir / "attempts" / "s1.log").read_text()
    assert "steps [30, 60)" in statuses[1].error_tail or "segment done at step 60" in statuses[1].error_tail
    assert len(list((a.work_dir / "handoff").iterdir())) == 1
    # each attempt's checkpoints carry its own writer name
    names = [p.name for p in (a.tmp / "job" / "checkpoints").iterdir()]
    assert any("-s2-" in n for n in names)


def test_incompatible_request_gets_a_fresh_process(warm_agent, reference_weights):
    a = warm_agent()
    a.submit("s0", *SEGMENTS[0])
    assert a.status("s0").outcome == "completed"
    first = a.pid("s0")
    a.submit("s1", *SEGMENTS[1], env={"SPOT_CKPT_MIN_INTERVAL": "3600", "OTHER": "1"})  # another environment
    assert a.status("s1").outcome == "completed"
    second = a.pid("s1")
    assert second != first and pid_gone(first)
    assert "another environment" in a.agent_log()
    a.submit("s2", *SEGMENTS[2], env={"SPOT_CKPT_MIN_INTERVAL": "3600", "OTHER": "1"})
    assert a.status("s2").outcome == "completed"
    assert a.pid("s2") == second  # compatible with s1: continues in s1's process
    wait_for(lambda: a.weights.exists() and pid_gone(second), 30, "the last process to exit")
    assert_same_training(reference_weights, a.weights)


def test_no_request_within_the_handoff_wait_ends_the_process(warm_agent):
    a = warm_agent(handoff_wait=0.5)
    a.submit("s0", *SEGMENTS[0])
    assert a.status("s0").outcome == "completed"
    first = a.pid("s0")
    wait_for(lambda: pid_gone(first), 30, "the unused warm process to exit")
    wait_for(lambda: "no next request within" in a.agent_log(), 10, "the agent to log the dismissal")
    assert "exited with 0" in a.agent_log()
    a.submit("s1", *SEGMENTS[1])  # a later request gets a fresh process, resuming from the store
    assert a.status("s1").outcome == "completed"
    assert a.pid("s1") != first
    assert "resuming at step 30" in (a.work_dir / "attempts" / "s1.log").read_text()


def test_notice_while_waiting_exits_preempted_and_keeps_the_completed_status(warm_agent):
    a = warm_agent()
    a.submit("s0", *SEGMENTS[0])
    done = a.status("s0")
    assert done.outcome == "completed"
    first = a.pid("s0")
    # Waiting between segments, the process no longer heartbeats for the attempt it finished (5 ticks).
    time.sleep(1.0)
    settled = a.layout.read_heartbeat("s0")
    time.sleep(1.0)
    assert a.layout.read_heartbeat("s0") == settled
    a.notice_file.write_text("preemption in 0 s")
    wait_for(lambda: pid_gone(first), 30, "the warm process to exit on the notice")
    wait_for(lambda: f"exited with {PREEMPTED_EXIT_CODE}" in a.agent_log(), 10, "the agent to see the exit")
    assert a.layout.read_status("s0") == done  # written once, never overwritten
    a.submit("s1", *SEGMENTS[1])  # nothing starts under the notice
    st = a.status("s1")
    assert st.outcome == "preempted" and "notice" in st.error_tail
    assert a.layout.read_heartbeat("s1") is None


def test_sigterm_while_waiting_exits_preempted_without_a_new_status(warm_agent):
    a = warm_agent()
    a.submit("s0", *SEGMENTS[0])
    done = a.status("s0")
    first = a.pid("s0")
    os.kill(a.proc.pid, signal.SIGTERM)  # the agent only: it forwards to its warm process
    assert a.proc.wait(timeout=30) == 0
    assert pid_gone(first)
    assert f"exited with {PREEMPTED_EXIT_CODE}" in a.agent_log()
    assert a.layout.read_status("s0") == done
    assert sorted(p.name for p in (a.tmp / "job" / "control" / "attempts").iterdir()) == ["s0"]


def test_opting_out_starts_a_process_per_segment(warm_agent, reference_weights):
    a = warm_agent()
    run_segments(a, ["s0", "s1", "s2"], warm_process=False)
    pids = [a.pid(n) for n in ("s0", "s1", "s2")]
    assert len(set(pids)) == 3
    assert not (a.work_dir / "handoff").exists()
    assert_same_training(reference_weights, a.weights)


# ---------------------------------------------------------------------------------------- pure parts
def request(**kw) -> SegmentRequest:
    base = dict(attempt_id="a", job_uri="file:///j", segment_index=0, start_step=30, end_step=60,
                command=["python", "t.py"], env={"A": "1", "SPOT_CKPT_KEEP": "2"}, cwd="/w", total_steps=90)
    return SegmentRequest(**{**base, **kw})


def test_compatibility_rules():
    running = request(attempt_id="prev", start_step=0, end_step=30)
    assert incompatible(running, 30, request(env={"A": "1", "SPOT_CKPT_KEEP": "5"}), 30) is None
    assert "command" in incompatible(running, 30, request(command=["python", "u.py"]), 30)
    assert "working directory" in incompatible(running, 30, request(cwd="/x"), 30)
    assert "environment" in incompatible(running, 30, request(env={"A": "2"}), 30)
    assert "job" in incompatible(running, 30, request(job_uri="file:///k"), 30)
    assert "newest checkpoint" in incompatible(running, 30, request(), 35)
    assert "range" in incompatible(running, 30, request(start_step=60, end_step=90), 30)
    assert "opts out" in incompatible(running, 30, request(warm_process=False), 30)
    assert "opts out" in incompatible(running, 30, request(env={"A": "1", "SPOT_WARM_PROCESS": "0"}), 30)


def test_last_segment_and_opt_out_get_no_handoff_dir():
    assert wants_handoff(request())
    assert wants_handoff(request(total_steps=None))
    assert not wants_handoff(request(start_step=60, end_step=90))
    assert not wants_handoff(request(warm_process=False))


def test_answer_wait_is_bounded_and_stops_on_request(tmp_path):
    ch = HandoffDir(tmp_path)
    assert ch.wait_answer("a", 0.1, lambda: False) is None
    assert ch.wait_answer("a", 30, lambda: True) is None
    ch.answer("a", {"action": "exit"})
    assert ch.wait_answer("a", 30, lambda: False) == {"action": "exit"}
    assert json.loads((tmp_path / "answer-a.json").read_text()) == {"action": "exit"}


FAKE_SESSION = """
import os, sys
from airflow_spot.training.handoff import HandoffDir
attempt = os.environ["SPOT_ATTEMPT_ID"]
open(sys.argv[1], "a").write(f"{attempt} {os.getpid()}\\n")
if os.environ.get("SPOT_HANDOFF_DIR"):
    channel = HandoffDir(os.environ["SPOT_HANDOFF_DIR"])
    channel.write_done(attempt, int(os.environ["SPOT_END_STEP"]))
    channel.wait_answer(attempt, 30, lambda: False)
# never acknowledges a hand-over: the process is gone before it takes the next segment
"""


def test_a_process_that_ends_instead_of_taking_the_segment_is_replaced(warm_agent, tmp_path):
    from airflow_spot.storage.checkpoint import CheckpointStore

    a = warm_agent()
    CheckpointStore(open_store(a.job_uri).child("checkpoints"), writer="earlier").save(20, lambda f: f.write(b"s"))
    marks = tmp_path / "marks.txt"
    command = [sys.executable, "-c", FAKE_SESSION, str(marks)]
    a.submit("s0", 10, 20, command=command, total_steps=100, env={})
    assert a.status("s0").outcome == "completed"
    a.submit("s1", 20, 30, command=command, total_steps=100, env={})  # compatible: handed over, never taken
    st = a.status("s1")
    assert st.outcome == "completed", st.error_tail
    wait_for(lambda: len(marks.read_text().split("\n")) > 2, 10, "the second process's mark")
    runs = [line.split() for line in marks.read_text().splitlines()]
    assert [r[0] for r in runs] == ["s0", "s1"] and runs[0][1] != runs[1][1]
    assert "did not take the segment" in a.agent_log()
