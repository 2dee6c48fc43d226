from __future__ import annotations

import http.server
import os
import signal
import threading
import time

import pytest

from airflow_spot.training.notices import PREEMPTION, REBALANCE, FileNotice, ImdsNotice, SigtermNotice


class FakeImds(http.server.BaseHTTPRequestHandler):
    """Instance metadata on 127.0.0.1 with IMDSv2 tokens; notices appear when the test says so."""

    action: str | None = None
    rebalance: str | None = None
    tokens_issued = 0
    require_token = True

    def do_PUT(self):
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            type(self).tokens_issued += 1
            self._reply(200, "tok")
        else:
            self._reply(400, "bad")

    def do_GET(self):
        if self.require_token and self.headers.get("X-aws-ec2-metadata-token") != "tok":
            return self._reply(401, "")
        body = {
            "/latest/meta-data/spot/instance-action": type(self).action,
            "/latest/meta-data/events/recommendations/rebalance": type(self).rebalance,
        }.get(self.path)
        self._reply(200, body) if body else self._reply(404, "Not Found")

    def _reply(self, code: int, body: str):
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def imds():
    FakeImds.action = FakeImds.rebalance = None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeImds)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=5)


def collect():
    seen: list[tuple[str, str]] = []
    return seen, lambda kind, detail: seen.append((kind, detail))


def wait_for(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


def test_imds_rebalance_then_instance_action(imds):
    seen, cb = collect()
    src = ImdsNotice(imds, interval=0.02)
    src.start(cb)
    try:
        time.sleep(0.1)
        assert seen == []  # 404s: nothing issued yet
        FakeImds.rebalance = '{"noticeTime": "2026-11-22T08:00:00Z"}'
        wait_for(lambda: len(seen) == 1)
        assert seen[0][0] == REBALANCE
        FakeImds.action = '{"action": "terminate", "time": "2026-11-22T08:02:00Z"}'
        wait_for(lambda: len(seen) == 2)
        assert seen[1] == (PREEMPTION, FakeImds.action)
        assert FakeImds.tokens_issued >= 1  # IMDSv2 was used
    finally:
        src.stop()


def test_imds_unreachable_does_not_raise():
    seen, cb = collect()
    src = ImdsNotice("http://127.0.0.1:9", interval=0.02, timeout=0.2)  # discard port: refused
    src.start(cb)
    time.sleep(0.15)
    src.stop()
    assert seen == []


def test_file_notice(tmp_path):
    seen, cb = collect()
    path = tmp_path / "notice"
    src = FileNotice(str(path), interval=0.01)
    src.start(cb)
    try:
        time.sleep(0.05)
        assert seen == []
        path.write_text("preempt in 5s")
        wait_for(lambda: seen)
        assert seen == [(PREEMPTION, "preempt in 5s")]
    finally:
        src.stop()


def test_sigterm_notice_restores_previous_handler():
    seen, cb = collect()
    before = signal.getsignal(signal.SIGTERM)
    src = SigtermNotice()
    src.start(cb)
    os.kill(os.getpid(), signal.SIGTERM)
    wait_for(lambda: seen)
    src.stop()
    assert seen[0][0] == PREEMPTION
    assert signal.getsignal(signal.SIGTERM) == before


def test_bad_poll_interval():
    with pytest.raises(ValueError, match="positive"):
        FileNotice("/x", interval=0)
