"""On-disk state of the ``local`` backend: one JSON record per instance, shared by every process.

The operator (a worker), the trigger (the triggerer, maybe after a restart), the preemption supervisor and
``airflow-spot reap`` are different processes; they agree on the instances only through this directory::

    <state_dir>/
      .lock                               held while launching (idempotency tokens, job counters)
      tokens/<sha256(token)>.json         idempotency token -> instance id
      jobs/<sha256(job_uri)>.json         job-wide launch counter and clock (preemption schedules)
      instances/<instance_id>/
        record.json                       InstanceRecord (InstanceInfo + process ids + flags)
        .lock                             held for every read-modify-write of record.json
        notice                            appears when a preemption notice is issued (SPOT_NOTICE_FILE)
        agent.log                         stdout/stderr of the agent
        agent_exit.json                   written by the agent when it exits on its own (idle, SIGTERM)
        attempts/<attempt_id>.log         full output of each attempt's command
        preemption.log                    output of the preemption supervisor

Liveness is decided from processes, not from the record alone: a process counts as alive only if its pid
still exists with the recorded start time and is not a zombie (nothing reaps orphans on some machines,
and ``kill(pid, 0)`` succeeds on a zombie).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from airflow_spot.backends.base import InstanceInfo

#: environment variable naming the state directory shared by all processes of one installation
STATE_DIR_ENV = "AIRFLOW_SPOT_LOCAL_DIR"
#: 2: ProcessRef carries start_ticks (code that predates it cannot read such a record)
RECORD_SCHEMA = 2


def default_state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV) or Path.home() / ".airflow-spot" / "local")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def write_json_atomic(path: Path, data: dict) -> None:
    """Write then rename, so a reader never sees half a record."""
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def boot_relative_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None where
    there is no ``/proc`` or no such process. Unlike a start time in seconds since the epoch (boot time plus
    this), it never moves when the system clock is stepped or slewed: ``btime`` in ``/proc/stat`` is
    recomputed from the wall clock on every read and can change by a second, which would make a live process
    look like another one (its instance called dead and killed)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'
    fields = raw[raw.rindex(b")") + 2:].split()
    return int(fields[19])


@dataclass
class ProcessRef:
    """A process identified by pid and start time, so a recycled pid is never mistaken for it.

    ``start_ticks`` (clock ticks since boot, Linux) is the identity where it is known; ``create_time``
    (seconds since the epoch, from psutil) is kept for records written before it and for systems without
    ``/proc``, compared to within psutil's 0.01 s precision."""

    pid: int
    create_time: float
    start_ticks: int | None = None

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        try:
            return cls(pid, psutil.Process(pid).create_time(), boot_relative_start(pid))
        except psutil.NoSuchProcess:
            return cls(pid, 0.0)

    def _is_this(self, proc: psutil.Process) -> bool:
        """Whether the live process ``proc`` (pid ``self.pid``) is the one recorded."""
        if self.start_ticks is not None:
            ticks = boot_relative_start(self.pid)
            if ticks is not None:
                return ticks == self.start_ticks
        return abs(proc.create_time() - self.create_time) < 0.01

    def reused(self) -> bool:
        """Another process holds this pid now (this one is gone and the pid was given out again). Linux gives
        out no pid still in use as a process group or session id, so that process's session is not this
        one's: nothing of it may be signalled."""
        try:
            return not self._is_this(psutil.Process(self.pid))
        except psutil.NoSuchProcess:
            return False

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return self._is_this(proc) and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


# An instance is the session its agent leads (launched with start_new_session, so the session id is the
# agent's pid and its process group's id, ``pgid``): the agent runs each training command in a process group
# of its own inside that session, so a signal reaches a command's whole tree, and ending the instance ends
# every group of the session.

def group_alive(pgid: int, leader: ProcessRef | None = None) -> bool:
    """Whether any non-zombie process is left in the instance (the session) led by ``pgid``; never when
    ``leader`` (the instance's agent, pid ``pgid``) is gone and its pid leads another session now."""
    if leader is not None and leader.reused():
        return False
    return bool(group_members(pgid))


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes of the instance (the session) led by ``pgid``."""
    out = []
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if os.getsid(proc.info["pid"]) == pgid:
                out.append(proc.info["pid"])
        except (ProcessLookupError, PermissionError):
            continue
    return out


def kill_group(pgid: int, sig: int, leader: ProcessRef | None = None) -> None:
    """Signal every process of the instance (the session) led by ``pgid``: its agent's group and its
    commands' groups. Nothing when ``leader`` (the instance's agent, pid ``pgid``) is gone and its pid was
    given to another process: that session is someone else's (another job's agent, a daemon)."""
    if leader is not None and leader.reused():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for pid in group_members(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@dataclass
class InstanceRecord:
    """Everything the backend knows about one local instance (stored as record.json)."""

    info: InstanceInfo
    agent: ProcessRef
    #: process group of the instance (the agent leads it; the training command runs inside it)
    pgid: int
    token: str
    #: 0-based position of this launch among the job's launches
    launch_index: int = 0
    #: 0-based position among the job's spot launches (preemption schedules consume by it); -1: on-demand
    spot_launch_index: int = -1
    running_at: float | None = None
    supervisor: ProcessRef | None = None
    #: wall-clock time the injector will issue the notice, if any
    preempt_at: float | None = None
    #: the injector started killing the instance (set before the SIGKILL, so describe() never races it)
    preempt_kill: bool = False
    #: we asked for termination (set before the SIGTERM)
    terminate_requested: bool = False
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["info"] = self.info.to_dict()
        d["schema"] = RECORD_SCHEMA
        return d

    @classmethod
    def from_dict(cls, d: dict) -> InstanceRecord:
        d = dict(d)
        if int(d.pop("schema", 0)) > RECORD_SCHEMA:
            raise ValueError(f"local instance record has a newer schema than this code understands: {d}")
        d["info"] = InstanceInfo.from_dict(d["info"])
        d["agent"] = ProcessRef(**d["agent"])
        if d.get("supervisor"):
            d["supervisor"] = ProcessRef(**d["supervisor"])
        return cls(**d)


def _check_private(path: Path) -> None:
    """Refuse a state directory another user owns or anyone may write: its records name the processes that
    terminate and reap signal, so whoever can plant one there could have this user's processes killed."""
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise ValueError(f"local backend state directory {str(path)!r} belongs to another user (uid {st.st_uid}): "
                         "its records name processes to signal; use a directory of your own (pass state_dir= or set "
                         f"{STATE_DIR_ENV})")
    if st.st_mode & stat.S_IWOTH:
        raise ValueError(f"local backend state directory {str(path)!r} may be written by any user: its records name "
                         f"processes to signal; run `chmod o-w {path}` or use a directory of your own")


class LocalState:
    """Paths and locked read-modify-writes under one state directory."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser().resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            for sub in ("instances", "tokens", "jobs"):
                (self.root / sub).mkdir(exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ValueError(
                f"local backend state directory {str(self.root)!r} cannot be created ({exc.strerror}); "
                f"pass state_dir= or set {STATE_DIR_ENV} to a writable directory"
            ) from exc
        for path in (self.root, *(self.root / sub for sub in ("instances", "tokens", "jobs"))):
            _check_private(path)

    # ---- paths
    def instance_dir(self, instance_id: str) -> Path:
        if not instance_id or "/" in instance_id or instance_id.startswith("."):
            raise ValueError(f"not a local instance id: {instance_id!r}")
        return self.root / "instances" / instance_id

    def record_path(self, instance_id: str) -> Path:
        return self.instance_dir(instance_id) / "record.json"

    def notice_path(self, instance_id: str) -> Path:
        return self.instance_dir(instance_id) / "notice"

    def agent_exit_path(self, instance_id: str) -> Path:
        return self.instance_dir(instance_id) / "agent_exit.json"

    # ---- locks
    def launch_lock(self) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.root / ".lock")

    def instance_lock(self, instance_id: str) -> contextlib.AbstractContextManager[None]:
        return file_lock(self.instance_dir(instance_id) / ".lock")

    # ---- records
    def instance_ids(self) -> list[str]:
        base = self.root / "instances"
        return sorted(p.name for p in base.iterdir() if (p / "record.json").is_file())

    def read(self, instance_id: str) -> InstanceRecord | None:
        try:
            data = read_json(self.record_path(instance_id))
        except ValueError:  # not a local id, or a corrupt record: unknown to this backend
            return None
        return InstanceRecord.from_dict(data) if data else None

    def write(self, record: InstanceRecord) -> None:
        write_json_atomic(self.record_path(record.info.instance_id), record.to_dict())

    def update(self, instance_id: str, change: Callable[[InstanceRecord], None]) -> InstanceRecord | None:
        """Apply ``change`` to the record under the instance's lock; returns the new record."""
        with self.instance_lock(instance_id):
            record = self.read(instance_id)
            if record is None:
                return None
            change(record)
            self.write(record)
            return record

    # ---- idempotency tokens and job counters (call under launch_lock)
    def token_instance(self, token: str) -> str | None:
        data = read_json(self.root / "tokens" / f"{_digest(token)}.json")
        return data["instance_id"] if data else None

    def forget_token(self, token: str, instance_id: str) -> None:
        path = self.root / "tokens" / f"{_digest(token)}.json"
        data = read_json(path)
        if data and data.get("instance_id") == instance_id:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def remember_token(self, token: str, instance_id: str) -> None:
        write_json_atomic(self.root / "tokens" / f"{_digest(token)}.json", {"token": token, "instance_id": instance_id})

    def job_clock(self, job_uri: str, now: float) -> float:
        """Origin of the job's clock (its first launch attempt), set to ``now`` on first use."""
        path = self.root / "jobs" / f"{_digest(job_uri)}.json"
        data = read_json(path)
        if data is None:
            data = {"job_uri": job_uri, "launches": 0, "t0": now}
            write_json_atomic(path, data)
        return float(data["t0"])

    def next_launch(self, job_uri: str, now: float, spot: bool) -> tuple[int, int, float]:
        """Count one more launch of ``job_uri``; returns (launch index, spot launch index or -1 for an
        on-demand launch, job clock origin)."""
        path = self.root / "jobs" / f"{_digest(job_uri)}.json"
        data = read_json(path) or {"job_uri": job_uri, "launches": 0, "t0": now}
        index, spot_index = int(data["launches"]), int(data.get("spot_launches", 0))
        data["launches"] = index + 1
        if spot:
            data["spot_launches"] = spot_index + 1
        write_json_atomic(path, data)
        return index, spot_index if spot else -1, float(data["t0"])

