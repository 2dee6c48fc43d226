"""The Spot Training page in a real browser: ``airflow-spot demo`` runs its DAG to completion (real
preemptions on the local backend), a real ``airflow api-server`` on 127.0.0.1 serves the plugin from the
same metadata DB, and headless Chromium renders the job's page. The test reads the rendered DOM and
saves a screenshot next to it, copied to ``out/test-artifacts/`` (or ``$SPOT_UI_ARTIFACTS``).

Chromium: Debian's ``chromium`` package. The test installs it with apt-get when it is missing and this
process may (root); otherwise it is skipped, saying why.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from airflow_spot.testing.polling import wait_for

pytestmark = pytest.mark.slow

DAG_ID = "spot_training_demo"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1300,1400", "--virtual-time-budget=15000",
]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("Chromium is not installed and this process cannot install it (needs root and apt-get)")
    try:
        subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True, timeout=600, check=True)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"Chromium could not be installed with apt-get: {exc}")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get reported success but no chromium binary is on PATH")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def airflow_env(home: Path, port: int, all_admins: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{port}",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="tester:admin",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(home / "passwords.json"),
        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    )
    if all_admins:  # tests only: every request is an admin's, so Chromium needs no login
        env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] = "True"
    return env


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def password_token(base: str) -> str:
    body = json.dumps({"username": "tester", "password": "spot-ui-test"}).encode()
    req = urllib.request.Request(f"{base}/auth/token", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["access_token"]


@contextlib.contextmanager
def api_server(out: Path, all_admins: bool):
    """A real ``airflow api-server`` on 127.0.0.1 over the demo's metadata DB, as its own process group."""
    port = free_port()
    home = out / "airflow"
    (home / "passwords.json").write_text(json.dumps({"tester": "spot-ui-test"}))
    log = open(out / f"api-server-{port}.log", "wb")
    server = subprocess.Popen(
        ["airflow", "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env=airflow_env(home, port, all_admins), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(base), timeout=120, interval=1.0, what="the API server to answer")
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    browser = chromium()
    out = tmp_path_factory.mktemp("demo")
    run = subprocess.run(
        [sys.executable, "-m", "airflow_spot.cli", "demo", "--out", str(out), "--total-steps", "300",
         "--steps-per-segment", "100", "--preempt-after", "4,4"],
        env=airflow_env(out / "airflow", 0, False), capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {"browser": browser, "out": out, "stdout": run.stdout}


def _healthy(base: str) -> bool:
    try:
        return get(f"{base}/api/v2/monitor/health")[0] == 200
    except OSError:
        return False


def test_the_real_api_server_serves_the_plugin_only_with_a_token(demo):
    with api_server(demo["out"], all_admins=False) as base:
        jobs_status, _ = get(f"{base}/spot/api/jobs")
        token = password_token(base)
        jobs = json.loads(get(f"{base}/spot/api/jobs", token)[1])
        job = next(j for j in jobs if j["dag_id"] == DAG_ID)
        routes = ["/spot/", "/spot/api/jobs", f"/spot/api/jobs/{DAG_ID}/{job['run_id']}",
                  f"/spot/jobs/{DAG_ID}/{urllib.request.quote(job['run_id'], safe='')}"]
        without = {r: get(base + r)[0] for r in routes}
        with_token = {r: get(base + r, token)[0] for r in routes}
        plugins = json.loads(get(f"{base}/api/v2/plugins", token)[1])
    assert jobs_status == 401
    assert without == {r: 401 for r in routes}
    assert with_token == {r: 200 for r in routes}
    assert job["state"] == "finished" and job["progress"] == 1.0 and job["preemptions"] >= 1
    views = {(v["name"], v["destination"]) for p in plugins["plugins"] for v in p.get("external_views", [])}
    assert {("Spot Training", "nav"), ("Spot Training", "dag_run"), ("Spot Training", "task_instance")} <= views


def test_the_job_page_renders_segments_preemptions_and_savings(demo):
    out = demo["out"]
    with api_server(out, all_admins=True) as base:
        jobs = json.loads(get(f"{base}/spot/api/jobs")[1])
        job = next(j for j in jobs if j["dag_id"] == DAG_ID)
        detail = json.loads(get(f"{base}/spot/api/jobs/{DAG_ID}/{job['run_id']}")[1])
        url = f"{base}/spot/jobs/{DAG_ID}/{urllib.request.quote(job['run_id'], safe='')}"
        profile = out / "chromium-profile"
        dom = subprocess.run(
            [demo["browser"], *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
            capture_output=True, text=True, timeout=180,
        ).stdout
        shot = out / "job-page.png"
        subprocess.run(
            [demo["browser"], *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={shot}", url],
            capture_output=True, timeout=180,
        )
    (out / "job-page.html").write_text(dom)
    # kept beyond pytest's temporary directories (it keeps only the last three sessions')
    keep = Path(os.environ.get("SPOT_UI_ARTIFACTS", Path(__file__).resolve().parents[2] / "out" / "test-artifacts"))
    keep.mkdir(parents=True, exist_ok=True)
    if shot.is_file():
        shutil.copy(shot, keep / "spot-job-page.png")
    (keep / "spot-job-page.html").write_text(dom)
    print(f"\nscreenshot: {keep / 'spot-job-page.png'}\nDOM: {keep / 'spot-job-page.html'}")
    assert shot.is_file() and shot.stat().st_size > 10_000
    preemptions = [a for a in detail["attempts"] if a["preemption"]]
    assert preemptions, "the demo's schedule preempts the first launches"
    segments = {a["segment_index"] for a in detail["attempts"]}
    assert segments == {0, 1, 2}
    assert dom.count('class="attempt ') == len(detail["attempts"])
    assert dom.count("⚡ preemption") == len(preemptions)
    for seg in segments:
        assert f"<td>{seg}</td>" in dom
    assert 'id="card-savings"' in dom and f"${detail['savings']:,.4f}" in dom
    assert "<svg" in dom and 'id="checkpoints"' in dom and 'id="offers"' in dom
