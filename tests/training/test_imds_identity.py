"""On EC2 the agent learns its instance id and region from IMDSv2 (token PUT, then GETs with the token)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from airflow_spot.training.notices import instance_identity

TOKEN = "tok-123"


class Imds(BaseHTTPRequestHandler):
    """IMDSv2 as AWS serves it: metadata only with a session token from ``PUT /latest/api/token``."""

    paths = {"/latest/meta-data/instance-id": "i-0abc1234def567890", "/latest/meta-data/placement/region": "us-west-2"}
    seen: list[str] = []

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: str = "") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_PUT(self):
        self.seen.append("PUT " + self.path)
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        self._send(200, TOKEN) if self.path == "/latest/api/token" and ttl else self._send(400)

    def do_GET(self):
        self.seen.append("GET " + self.path)
        if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
            return self._send(401)
        self._send(200, self.paths[self.path]) if self.path in self.paths else self._send(404)


@pytest.fixture
def imds():
    Imds.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Imds)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=5)


def test_identity_comes_from_imdsv2_with_a_token(imds):
    assert instance_identity(imds) == ("i-0abc1234def567890", "us-west-2")
    assert Imds.seen[0] == "PUT /latest/api/token"


def test_unreachable_metadata_is_a_clear_error():
    with pytest.raises(OSError, match="did not tell this instance's id"):
        instance_identity("http://127.0.0.1:9", timeout=0.5, attempts=2)


def test_agent_without_instance_id_serves_as_the_metadata_instance(imds, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "airflow_spot.training.agent", "--job-uri", f"file://{job}", "--imds-url", imds,
         "--idle-timeout", "1", "--poll-interval", "0.1", "--work-dir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "this is i-0abc1234def567890 in us-west-2" in out.stdout
    record = json.loads((job / "control/instances/i-0abc1234def567890/agent.json").read_text())
    assert record["instance_id"] == "i-0abc1234def567890"


def test_agent_needs_an_instance_id_or_a_metadata_url(tmp_path):
    out = subprocess.run([sys.executable, "-m", "airflow_spot.training.agent", "--job-uri", f"file://{tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "give --instance-id, or --imds-url" in out.stderr

