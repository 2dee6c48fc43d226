"""docker/ without a container engine: the files parse, the runner image's entrypoint runs outside a
container, its pip list is the `training` extra (no Airflow on an instance), and the compose services
are the components tests/e2e starts."""
from __future__ import annotations

import ast
import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import JobLayout, SegmentRequest
from airflow_spot.testing.polling import wait_for

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
E2E_STACK = ROOT / "tests" / "e2e" / "airflow_stack.py"
#: compose `command` of each Airflow service -> the component it is
AIRFLOW_COMPONENTS = {"api-server", "scheduler", "dag-processor", "triggerer", "celery worker"}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def entrypoint(path: Path) -> list[str]:
    (value,) = [rest for word, rest in dockerfile_instructions(path) if word == "ENTRYPOINT"]
    argv = json.loads(value)  # the exec form: a JSON array
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def e2e_components() -> set[str]:
    """The Airflow commands tests/e2e/airflow_stack.py starts: the list literals of its argument table
    (``_args``) or of direct ``self._start(name, [args...])`` calls."""
    tree = ast.parse(E2E_STACK.read_text())
    lists: list[ast.List] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_args":
            lists += [v for d in ast.walk(node) if isinstance(d, ast.Dict) for v in d.values if isinstance(v, ast.List)]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "_start" and len(node.args) >= 2:
            lists += [node.args[1]] if isinstance(node.args[1], ast.List) else []
    started = set()
    for args in lists:
        words = [a.value for a in args.elts if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        command = [w for w in words if not w.startswith("-")]
        if command:
            started.add(" ".join(command[:2]) if command[0] == "celery" else command[0])
    return started


def test_both_dockerfiles_have_the_instructions_a_build_needs():
    for name in ("Dockerfile", "runner.Dockerfile"):
        words = [w for w, _ in dockerfile_instructions(DOCKER / name)]
        assert words and words[0] in ("ARG", "FROM") and "FROM" in words and "RUN" in words, name


def test_runner_entrypoint_runs_the_agent_outside_a_container(tmp_path):
    argv = entrypoint(DOCKER / "runner.Dockerfile")
    assert argv[:3] == ["python", "-m", "airflow_spot.training.agent"]
    command = [sys.executable, *argv[1:]]
    shown = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "--job-uri" in shown.stdout, shown.stderr
    # Serve one segment request as the instance would, then exit on the idle timeout.
    uri = f"file://{tmp_path}/job"
    JobLayout(open_store(uri)).write_request(
        "i-runner", SegmentRequest("seg.try1", uri, 0, 0, 1, [sys.executable, "-c", "print('segment ran')"],
                                   created_at=0.0))
    done = subprocess.run(
        [*command, "--job-uri", uri, "--instance-id", "i-runner", "--idle-timeout", "2",
         "--work-dir", str(tmp_path / "work"), "--heartbeat-seconds", "0.5"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    status = wait_for(lambda: JobLayout(open_store(uri)).read_status("seg.try1"), 10, "the attempt's status")
    assert status.outcome == "completed" and status.exit_code == 0


def test_runner_installs_exactly_the_training_extra_and_no_airflow():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extra = {r.strip() for r in cfg["options.extras_require"]["training"].splitlines() if r.strip()}
    runs = " ".join(rest for word, rest in dockerfile_instructions(DOCKER / "runner.Dockerfile") if word == "RUN")
    quoted = set(re.findall(r'"([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?[<>=!~][^"]*)"', runs))
    assert quoted == extra, f"runner image installs {sorted(quoted)}, the training extra is {sorted(extra)}"
    assert "--no-deps /opt/airflow-spot" in runs, "the package's core requirements (Airflow) must stay out"
    assert "airflow" not in " ".join(quoted)


def test_compose_services_match_what_the_e2e_stack_starts():
    services = compose()["services"]
    commands = {name: s["command"] for name, s in services.items() if isinstance(s.get("command"), str)}
    airflow_services = {cmd for cmd in commands.values() if cmd in AIRFLOW_COMPONENTS}
    assert airflow_services == AIRFLOW_COMPONENTS
    assert e2e_components() == AIRFLOW_COMPONENTS
    images = {s.get("image", "").split(":")[0] for s in services.values()}
    assert {"postgres", "redis"} <= images, "the e2e stack runs on PostgreSQL and Redis"
    env = compose()["x-airflow-common"]["environment"]
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
    assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://")
    # Every component shares the secrets the e2e stack also shares, or workers cannot reach the execution API.
    for key in ("AIRFLOW__API__SECRET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__CORE__EXECUTION_API_SERVER_URL"):
        assert key in env


def test_airflow_image_installs_the_provider_and_pins_celery_below_5_7():
    runs = " ".join(rest for word, rest in dockerfile_instructions(DOCKER / "Dockerfile") if word == "RUN")
    assert "celery[redis]>=5.5,<5.7" in runs
    assert "/opt/airflow-spot[training]" in runs and "airflow providers list" in runs
