"""A production-like Airflow for end-to-end tests and benchmarks: PostgreSQL + CeleryExecutor on Redis.

Recipe verified in ``NOTES.md`` ("A production-like Airflow for end-to-end tests"). One
:class:`AirflowStack` owns, for its lifetime:

- a fresh PostgreSQL database cloned from a migrated template (0.3 s instead of ~5 s for a migration),
  dropped ``WITH (FORCE)`` at the end;
- one Redis database, claimed in db 0 so parallel sessions never share one, ``FLUSHDB``'d before use
  (late acks of killed workers leave messages behind) and after;
- ``airflow api-server``, ``scheduler``, ``dag-processor``, ``triggerer`` and ``celery worker``, each its
  own process group with its own log file under ``<root>/logs``;
- a private ``AIRFLOW_HOME``, dags folder and ``AIRFLOW_SPOT_LOCAL_DIR`` (state of the ``local`` backend).

Every wait is bounded and ends in :class:`StackError` carrying the tails of the process logs. ``stop()``
signals every process group, waits for it, then sweeps any process that still carries this stack's
``AIRFLOW_HOME`` in its environment (task processes, training instances), so nothing outlives the stack.

Used by ``tests/e2e/conftest.py`` and ``benchmarks/bench_segments.py``; it imports no Airflow itself
(the processes do), so the calling process stays light.
"""
from __future__ import annotations

import base64
import contextlib
import json
import re
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg2
import redis

REPO_ROOT = Path(__file__).resolve().parents[2]
PG_DSN = os.environ.get("AIRFLOW_SPOT_E2E_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("AIRFLOW_SPOT_E2E_REDIS", "redis://127.0.0.1:6379")
DB_PREFIX = "airflow_spot_e2e_"
#: Redis databases this harness may claim (0 holds the claims; others may belong to other tools)
REDIS_DBS = range(8, 16)
CLAIM_TTL_SECONDS = 3 * 3600

TERMINAL_RUN_STATES = frozenset({"success", "failed"})
TERMINAL_TI_STATES = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})


class StackError(RuntimeError):
    """The stack did not start, or a bounded wait ran out; the message carries the process log tails."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def airflow_version() -> str:
    from importlib.metadata import version

    return version("apache-airflow")


def _pg_admin():
    conn = psycopg2.connect(PG_DSN)
    conn.autocommit = True
    return conn


def _pg_url(db: str) -> str:
    base = PG_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg2://", 1)
    return f"{base}/{db}"


def services_available() -> str | None:
    """``None`` when PostgreSQL and Redis answer, else why not (a skip reason)."""
    try:
        _pg_admin().close()
    except psycopg2.Error as exc:
        return f"PostgreSQL at {PG_DSN} is not reachable: {exc}"
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=3).ping()
    except redis.RedisError as exc:
        return f"Redis at {REDIS_URL} is not reachable: {exc}"
    return None


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None
    log_file: Any = None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def _same_machine_descendants(root: psutil.Process) -> list[psutil.Process]:
    """``root``'s descendants, less every subtree that starts a session of its own: the local backend
    starts each instance's agent (and its preemption supervisor) with ``start_new_session``, and those stand
    for other machines, which a crash of the worker's machine does not take down. (Airflow's task runners
    only move to process groups of their own, so they are killed with their worker.)"""
    found: list[psutil.Process] = []
    todo = list(root.children())
    while todo:
        p = todo.pop()
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(p.pid) == p.pid:
                continue
            found.append(p)
            todo.extend(p.children())
    return found


@dataclass
class AirflowStack:
    """One production-like Airflow; ``start()`` then ``stop()`` (or use it as a context manager).

    :param root: empty working directory owned by the stack (home, dags, logs, local-backend state).
    :param dag_files: DAG files copied into the dags folder before the processes start.
    :param extra_env: further environment for every Airflow process (e.g. ``AIRFLOW__...`` overrides).
    :param worker_concurrency: Celery worker slots.
    """

    root: Path
    dag_files: Iterable[Path] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    worker_concurrency: int = 2
    startup_timeout: float = 180.0  # a loaded 2-core machine needs more than the 15 s of an idle one

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.home = self.root / "airflow-home"
        self.dags_folder = self.root / "dags"
        self.logs = self.root / "logs"
        self.local_state_dir = self.root / "local-backend"
        self.work_dir = self.root / "work"
        self.db_name = f"{DB_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.redis_db: int | None = None
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, Proc] = {}
        self._all_procs: list[Proc] = []  # including replaced ones (a restarted triggerer)
        self._password = secrets.token_hex(12)
        self._secret = secrets.token_hex(16)
        self._fernet_key = base64.urlsafe_b64encode(os.urandom(32)).decode()
        self._token: str | None = None
        self._db_created = False
        self._client = httpx.Client(base_url=self.base_url, timeout=40.0)

    # ------------------------------------------------------------------ environment
    def env(self) -> dict[str, str]:
        """Environment of every Airflow process: the caller's minus its Airflow settings, plus ours."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        pg = _pg_url(self.db_name)
        broker = f"{REDIS_URL}/{self.redis_db}"
        env.update(
            AIRFLOW_HOME=str(self.home),
            AIRFLOW_SPOT_LOCAL_DIR=str(self.local_state_dir),
            SPOT_E2E_ROOT=str(self.work_dir),
            AIRFLOW__CORE__DAGS_FOLDER=str(self.dags_folder),
            AIRFLOW__CORE__EXECUTOR="CeleryExecutor",
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
            AIRFLOW__CORE__PARALLELISM="8",
            AIRFLOW__CORE__FERNET_KEY=self._fernet_key,
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"{self.base_url}/execution/",
            AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin",
            AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(self.home / "passwords.json"),
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=pg,
            AIRFLOW__CELERY__BROKER_URL=broker,
            AIRFLOW__CELERY__RESULT_BACKEND=f"db+{pg}",
            AIRFLOW__CELERY__WORKER_CONCURRENCY=str(self.worker_concurrency),
            AIRFLOW__API__HOST="127.0.0.1",
            AIRFLOW__API__PORT=str(self.port),
            AIRFLOW__API__WORKERS="1",
            AIRFLOW__API__BASE_URL=self.base_url,
            AIRFLOW__API__SECRET_KEY=self._secret,
            AIRFLOW__API_AUTH__JWT_SECRET=self._secret,
            # A killed triggerer's triggers are picked up by another one once its heartbeat is stale:
            # ~5 s with these (threshold > 2 x heartbeat + ~2 s, NOTES.md) instead of ~24 s.
            AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC="1",
            AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD="6",
            # A task whose worker died is failed (and retried) after 30 s of silence instead of 300 s.
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="30",
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL="3",
            # DAG files a test adds after start are listed within seconds.
            AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="3",
            AIRFLOW__LOGGING__LOGGING_LEVEL="INFO",
        )
        env.update(self.extra_env)
        return env

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> AirflowStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for d in (self.home, self.dags_folder, self.logs, self.local_state_dir, self.work_dir):
            d.mkdir(parents=True, exist_ok=True)
        (self.home / "passwords.json").write_text(json.dumps({"admin": self._password}))
        for f in self.dag_files:
            shutil.copy(f, self.dags_folder / Path(f).name)
        started = time.monotonic()
        try:
            self._create_database()
            self._claim_redis_db()
            for name in ("api-server", "scheduler", "dag-processor", "triggerer", "worker"):
                self._start(name, self._args(name))
            self._wait_healthy(deadline=started + self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def stop(self) -> None:
        """Stop everything this stack started; safe to call twice and after a failed start."""
        for name in reversed(list(self.procs)):
            self._stop_proc(self.procs[name])
        self.sweep_processes()
        self._client.close()
        if self._db_created:
            try:
                with contextlib.closing(_pg_admin()) as conn, conn.cursor() as cur:
                    cur.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
                self._db_created = False
            except psycopg2.Error as exc:  # leave it to the next session's sweep, but say so
                print(f"[airflow-stack] could not drop {self.db_name}: {exc}", file=sys.stderr)
        self._release_redis_db()

    def _args(self, name: str) -> list[str]:
        """The ``airflow`` arguments of one process kind (a restarted worker gets a new Celery hostname)."""
        return {
            "api-server": ["api-server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            "scheduler": ["scheduler", "--skip-serve-logs"],
            "dag-processor": ["dag-processor"],
            "triggerer": ["triggerer", "--skip-serve-logs"],
            "worker": ["celery", "worker", "--skip-serve-logs", "--concurrency", str(self.worker_concurrency),
                       "--celery-hostname", f"e2e-{uuid.uuid4().hex[:8]}@127.0.0.1"],
        }[name]

    def _start(self, name: str, args: list[str], log_suffix: str = "") -> Proc:
        log_path = self.logs / f"{name}{log_suffix}.log"
        proc = Proc(name=name, argv=[str(Path(sys.executable).parent / "airflow"), *args], log_path=log_path)
        proc.log_file = open(log_path, "ab")
        proc.popen = subprocess.Popen(
            proc.argv, env=self.env(), cwd=self.root, stdout=proc.log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.procs[name] = proc
        self._all_procs.append(proc)
        return proc

    @staticmethod
    def _stop_proc(proc: Proc, sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
        if proc.popen is None:
            return
        pgid = proc.popen.pid  # start_new_session: the leader's pid is the group id
        for s, wait in ((sig, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, s)
            except ProcessLookupError:
                pass
            try:
                proc.popen.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # children of the leader in the same group (e.g. celery pool, api workers) may outlive it briefly
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        if proc.log_file is not None:
            proc.log_file.close()
            proc.log_file = None

    def processes_of_stack(self) -> list[psutil.Process]:
        """Every live process (not this one) whose environment carries this stack's ``AIRFLOW_HOME``."""
        mine = str(self.home)
        found = []
        for p in psutil.process_iter(["pid"]):
            if p.pid == os.getpid():
                continue
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if p.environ().get("AIRFLOW_HOME") == mine:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def instance_processes(self) -> list[tuple[int, str]]:
        """Processes of this stack outside the sessions of its Airflow processes: ``(pid, command line)``.

        Airflow's own processes (and the task runners they fork, which only change process group) stay in
        the session each was started in; the ``local`` backend starts every instance (agent, training
        command) and every preemption supervisor in a session of its own. So whatever is found here is
        an instance-side process that is still alive.
        """
        airflow_sessions = {p.popen.pid for p in self._all_procs if p.popen is not None}
        found = []
        for p in self.processes_of_stack():
            try:
                sid = os.getsid(p.pid)
            except ProcessLookupError:
                continue
            if sid not in airflow_sessions:
                found.append((p.pid, " ".join(_cmdline(p))))
        return found

    def sweep_processes(self, timeout: float = 10.0) -> list[str]:
        """Kill whatever of this stack is still alive after the process groups stopped; return what."""
        left = self.processes_of_stack()
        described = [f"{p.pid}: {' '.join(_cmdline(p))[:160]}" for p in left]
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=timeout)
        if described:
            print("[airflow-stack] swept leftover processes:\n  " + "\n  ".join(described), file=sys.stderr)
        return described

    # ------------------------------------------------------------------ database and broker
    def _create_database(self) -> None:
        template = f"{DB_PREFIX}tmpl_" + airflow_version().replace(".", "_")
        with contextlib.closing(_pg_admin()) as conn, conn.cursor() as cur:
            self._drop_orphaned_databases(cur)
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (template,))
            if cur.fetchone() is None:
                self._build_template(cur, template)
            deadline = time.monotonic() + 30
            while True:  # CREATE ... TEMPLATE fails while another session clones the same template
                try:
                    cur.execute(f'CREATE DATABASE "{self.db_name}" TEMPLATE "{template}"')
                    break
                except psycopg2.errors.ObjectInUse:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        self._db_created = True

    def _build_template(self, cur, template: str) -> None:
        building = f"{DB_PREFIX}build_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        cur.execute(f'CREATE DATABASE "{building}"')
        env = self.env() | {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": _pg_url(building)}
        result = subprocess.run(
            [str(Path(sys.executable).parent / "airflow"), "db", "migrate"], env=env, cwd=self.root,
            capture_output=True, text=True, timeout=180,
        )
        if result.returncode != 0:
            cur.execute(f'DROP DATABASE IF EXISTS "{building}" WITH (FORCE)')
            raise StackError(f"airflow db migrate failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        try:  # the rename publishes the template atomically; a racing session may have won
            cur.execute(f'ALTER DATABASE "{building}" RENAME TO "{template}"')
        except psycopg2.errors.DuplicateDatabase:
            cur.execute(f'DROP DATABASE IF EXISTS "{building}" WITH (FORCE)')

    @staticmethod
    def _drop_orphaned_databases(cur) -> None:
        """Drop databases of earlier sessions whose process is gone (a crash skipped their teardown)."""
        cur.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", (DB_PREFIX + "%",))
        for (name,) in cur.fetchall():
            owner = re.fullmatch(re.escape(DB_PREFIX) + r"(?:build_)?(\d+)_[0-9a-f]+", name)
            if owner and not psutil.pid_exists(int(owner.group(1))):
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _claim_redis_db(self) -> None:
        claims = redis.Redis.from_url(f"{REDIS_URL}/0", socket_timeout=5)
        for n in REDIS_DBS:
            key = f"airflow-spot-e2e:db:{n}"
            holder = claims.get(key)
            if holder is not None and psutil.pid_exists(int(holder)):
                continue
            if holder is not None:
                claims.delete(key)
            if claims.set(key, os.getpid(), nx=True, ex=CLAIM_TTL_SECONDS):
                self.redis_db = n
                redis.Redis.from_url(f"{REDIS_URL}/{n}", socket_timeout=5).flushdb()
                return
        raise StackError(f"every Redis database {REDIS_DBS.start}..{REDIS_DBS.stop - 1} is claimed by a live session")

    def _release_redis_db(self) -> None:
        if self.redis_db is None:
            return
        with contextlib.suppress(redis.RedisError):
            redis.Redis.from_url(f"{REDIS_URL}/{self.redis_db}", socket_timeout=5).flushdb()
            redis.Redis.from_url(f"{REDIS_URL}/0", socket_timeout=5).delete(f"airflow-spot-e2e:db:{self.redis_db}")
        self.redis_db = None

    # ------------------------------------------------------------------ health
    def _wait_healthy(self, deadline: float) -> None:
        def healthy() -> bool:
            self._check_alive()
            try:
                r = self._client.get("/api/v2/monitor/health")
            except httpx.HTTPError:
                return False
            if r.status_code != 200:
                return False
            h = r.json()
            parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
            return all((h.get(p) or {}).get("status") == "healthy" for p in parts)

        self._poll(healthy, deadline - time.monotonic(), "Airflow health (api, scheduler, triggerer, dag processor)")
        self._poll(lambda: self._check_alive() or b" ready." in self.procs["worker"].log_path.read_bytes(),
                   deadline - time.monotonic(), "the Celery worker's 'ready.' line")

    def _check_alive(self) -> None:
        dead = [f"{p.name} (exit {p.popen.returncode})" for p in self.procs.values() if not p.alive]
        if dead:
            raise StackError(f"Airflow processes exited: {', '.join(dead)}\n{self.log_tails()}")

    def _poll(self, ready: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            value = ready()
            if value:
                return value
            if time.monotonic() > deadline:
                raise StackError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.log_tails()}")
            time.sleep(interval)

    def log_tails(self, lines: int = 40) -> str:
        out = []
        for path in sorted(self.logs.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"----- {path.name} (last {len(text)} lines) -----\n" + "\n".join(text))
        return "\n".join(out)

    # ------------------------------------------------------------------ killing and restarting processes
    def kill(self, name: str) -> list[int]:
        """SIGKILL one Airflow process as a machine crash would: its process group and every other process
        of its session (task runners move to process groups of their own). Returns the pids killed."""
        proc = self.procs[name]
        session = proc.popen.pid
        members = []
        with contextlib.suppress(psutil.Error):  # descendants too: a task process outlived a session-only kill
            members += _same_machine_descendants(psutil.Process(session))
        for p in self.processes_of_stack():
            with contextlib.suppress(ProcessLookupError, psutil.Error):
                if os.getsid(p.pid) == session and p not in members:
                    members.append(p)
        for p in members:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self._stop_proc(proc, sig=signal.SIGKILL, grace=10.0)
        psutil.wait_procs(members, timeout=10)
        return [p.pid for p in members]

    def restart(self, name: str) -> Proc:
        """Start a new process of the kind ``name`` (after :meth:`kill`), logging to ``<name>-<n>.log``."""
        self._restarts = getattr(self, "_restarts", 0) + 1
        return self._start(name, self._args(name), log_suffix=f"-{self._restarts}")

    def kill_triggerer(self) -> None:
        """SIGKILL the triggerer's process group (no clean shutdown: its triggers are orphaned)."""
        self.kill("triggerer")

    def start_triggerer(self) -> None:
        self.restart("triggerer")

    # ------------------------------------------------------------------ REST
    def _auth(self) -> dict[str, str]:
        if self._token is None:
            r = self._client.post("/auth/token", json={"username": "admin", "password": self._password})
            r.raise_for_status()
            self._token = r.json()["access_token"]
        return {"Authorization": f"Bearer {self._token}"}

    def api(self, method: str, path: str, ok: Iterable[int] = (200,), **kwargs: Any) -> Any:
        headers = {**self._auth(), **kwargs.pop("headers", {})}
        # A loaded 2-core machine can stall the API server past the client timeout: reads are retried
        # (bounded); a write is not, since it may have happened.
        for attempt in range(3 if method == "GET" else 1):
            try:
                r = self._client.request(method, "/api/v2" + path, headers=headers, **kwargs)
                break
            except httpx.TimeoutException:
                if attempt == 2 or method != "GET":
                    raise
        if r.status_code not in tuple(ok):
            raise StackError(f"{method} {path} -> {r.status_code}: {r.text[:2000]}")
        if r.headers.get("content-type", "").startswith("application/json"):
            return r.json()
        return r.text

    def wait_dag(self, dag_id: str, timeout: float = 60.0) -> dict:
        """Wait until the DAG is parsed, serialised and free of import errors."""
        def known():
            self._check_alive()
            r = self._client.get(f"/api/v2/dags/{dag_id}", headers=self._auth())
            if r.status_code == 200:
                return r.json()
            errors = self.api("GET", "/importErrors").get("import_errors", [])
            ours = {p.name for p in self.dags_folder.iterdir()}
            mine = [e for e in errors if Path(e.get("filename", "")).name in ours]
            if mine:
                raise StackError(f"import errors while waiting for DAG {dag_id}: {json.dumps(mine, indent=1)[:4000]}")
            return None

        return self._poll(known, timeout, f"DAG {dag_id} to be parsed")

    def add_dag_file(self, path: Path, dag_ids: Iterable[str], timeout: float = 60.0) -> None:
        shutil.copy(path, self.dags_folder / Path(path).name)
        for dag_id in dag_ids:
            self.wait_dag(dag_id, timeout)

    def trigger(self, dag_id: str, conf: dict | None = None, run_id: str | None = None) -> str:
        body: dict[str, Any] = {"logical_date": None, "conf": conf or {}}
        if run_id:
            body["dag_run_id"] = run_id
        return self.api("POST", f"/dags/{dag_id}/dagRuns", json=body)["dag_run_id"]

    def dag_run(self, dag_id: str, run_id: str) -> dict:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")

    def wait_run(self, dag_id: str, run_id: str, timeout: float, states: Iterable[str] = TERMINAL_RUN_STATES) -> str:
        wanted = set(states)

        def reached():
            self._check_alive()
            state = self.dag_run(dag_id, run_id)["state"]
            return state if state in wanted else None

        return self._poll(reached, timeout, f"run {dag_id}/{run_id} to reach {sorted(wanted)}", interval=1.0)

    def task_instances(self, dag_id: str, run_id: str) -> dict[str, dict]:
        tis = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 1000})
        return {ti["task_id"]: ti for ti in tis["task_instances"]}

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}")

    def wait_task(
        self, dag_id: str, run_id: str, task_id: str, states: Iterable[str], timeout: float,
        min_try: int = 0,
    ) -> dict:
        """Wait until the task instance is in one of ``states`` (at try ``min_try`` or later)."""
        wanted = set(states)

        def reached():
            self._check_alive()
            ti = self.task_instance(dag_id, run_id, task_id)
            return ti if ti["state"] in wanted and ti["try_number"] >= min_try else None

        return self._poll(reached, timeout, f"task {task_id} of {dag_id}/{run_id} to reach {sorted(wanted)}")

    def tries(self, dag_id: str, run_id: str, task_id: str) -> list[dict]:
        """Every try of a task instance (history and current), ordered by try number."""
        r = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/tries")
        return sorted(r["task_instances"], key=lambda t: t["try_number"])

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        r = self.api(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
            params={"deserialize": "true"},
        )
        return r["value"]

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """The task log of one try as text (one line per structured log record)."""
        r = self.api(
            "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
            params={"full_content": "true"}, headers={"Accept": "application/json"},
        )
        lines = []
        for rec in r.get("content", []):
            if isinstance(rec, dict):
                extra = {k: v for k, v in rec.items() if k not in ("event", "timestamp", "level", "logger")}
                lines.append(f"{rec.get('timestamp', '')} {rec.get('level', '')} {rec.get('event', '')} {extra or ''}")
            else:
                lines.append(str(rec))
        return "\n".join(lines)

    def set_task_state(self, dag_id: str, run_id: str, task_id: str, state: str) -> Any:
        return self.api(
            "PATCH", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}", json={"new_state": state},
        )


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return ["?"]
