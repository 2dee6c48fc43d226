"""The protocol between Airflow and an instance, carried only by objects in the job's store.

Layout under a job URI (the user's ``checkpoint_uri``)::

    checkpoints/<step:012d>-<writer>/state.pt       data first ...
    checkpoints/<step:012d>-<writer>/MANIFEST.json  ... manifest last (see checkpoint.py)
    control/instances/<instance_id>/requests/<attempt_id>.json   operator -> agent
    control/attempts/<attempt_id>/heartbeat.json                 training session -> trigger
    control/attempts/<attempt_id>/status.json                    agent -> trigger (final, written once)
    control/ledger/<attempt_id>.json                             operator (see policy.ledger)

(:class:`JobLayout` lists every key of a job and is the only place that spells one.)

Every object is one atomic write of JSON carrying ``schema``; readers reject a newer major schema.
State diagram of an attempt::

    requested --agent picks up--> running --exit 0--------------------> completed
                                          --exit PREEMPTED_EXIT_CODE--> preempted (state saved)
                                          --other exit---------------> failed (user code)
                                          --instance gone / silent---> lost (decided by the trigger)
                                          --"segment done" marker-----> completed (warm process: the
                                            process stays alive and may continue with the instance's next
                                            compatible request; see training/handoff.py)
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar

from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore

SCHEMA_VERSION = 1

#: Exit code of a training process that saw a preemption notice and committed its emergency save
#: (EX_TEMPFAIL from sysexits.h: "temporary failure, the user is invited to retry").
PREEMPTED_EXIT_CODE = 75


class Outcome(str, Enum):  # noqa: UP042 - StrEnum would change str(), which logs rely on
    COMPLETED = "completed"
    PREEMPTED = "preempted"
    FAILED = "failed"
    LOST = "lost"
    #: nobody waited for its end: its task was killed (marked failed or success, cleared) while it ran, or
    #: its worker went and its instance ended without a status. Only a ledger row says it (the operators'
    #: and the finish task's, so its time is billed); it spends neither budget.
    ABANDONED = "abandoned"

    def is_retryable(self) -> bool:
        """Preempted and lost attempts spend the preemption budget, not the user-code budget."""
        return self in (Outcome.PREEMPTED, Outcome.LOST)

    def is_success(self) -> bool:
        return self is Outcome.COMPLETED


_SAFE = re.compile(r"[^A-Za-z0-9_.=-]+")


def safe_id(*parts: object) -> str:
    """Join parts into one object-key-safe identifier."""
    return _SAFE.sub("_", ".".join(str(p) for p in parts))


class SchemaError(ValueError):
    """A protocol object this code cannot read (newer schema or malformed)."""


_NUMBER = (int, float)
#: field name -> the type its value must have
_Kinds = dict[str, type | tuple[type, ...]]


def _wrong_type(record: Any, name: str, kind: type | tuple[type, ...], nullable: bool) -> str | None:
    """What is wrong with ``record.name`` (None: an instance of ``kind``, or None where ``nullable``)."""
    value = getattr(record, name)
    if (value is None and nullable) or (isinstance(value, kind) and not isinstance(value, bool)):
        return None
    what = "an integer" if kind is int else "a number" if kind == _NUMBER else "a string"
    return f"{type(record).__name__}.{name} must be {what}{' or null' if nullable else ''}, got {value!r}"


@dataclass
class _Record:
    schema: int = field(default=SCHEMA_VERSION, kw_only=True)
    #: the fields a reader computes with, by the type each must hold: decoded with another (a null step, a
    #: time that is a string) the object is refused (``SchemaError`` naming the field), as a torn one is,
    #: instead of failing whoever reads it later. Checked on read only: a writer's own record is not.
    _REQUIRED: ClassVar[_Kinds] = {}
    _OPTIONAL: ClassVar[_Kinds] = {}

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Any:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise SchemaError(f"{cls.__name__}: not JSON ({exc})") from exc
        found = data.get("schema", 0) if isinstance(data, dict) else data
        if not isinstance(data, dict) or isinstance(found, bool) or not isinstance(found, int) or found > SCHEMA_VERSION:
            raise SchemaError(f"{cls.__name__}: unsupported schema {found!r}")
        known = {f.name for f in fields(cls)}
        try:
            record = cls(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError) as exc:  # a field missing, or one a record checks (LivePrice's price)
            raise SchemaError(f"{cls.__name__}: malformed ({exc})") from exc
        wrong = [w for nullable, kinds in ((False, cls._REQUIRED), (True, cls._OPTIONAL))
                 for name, kind in kinds.items() if (w := _wrong_type(record, name, kind, nullable))]
        if wrong:
            raise SchemaError(f"{cls.__name__}: malformed ({'; '.join(wrong)})")
        return record


@dataclass
class SegmentRequest(_Record):
    """What one attempt of one segment must do. Written by the operator, read by the agent."""

    attempt_id: str
    job_uri: str
    segment_index: int
    start_step: int
    end_step: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    created_at: float = 0.0
    #: checkpoint-interval inputs for the session (see policy.checkpoint_interval)
    mtbf_seconds: float | None = None
    min_interval_seconds: float | None = None
    max_interval_seconds: float | None = None
    keep_checkpoints: int = 3
    notice_window_seconds: float = 120.0
    warm_start_uri: str | None = None
    #: length of the whole job (a segment ending there is the last: its process simply exits)
    total_steps: int | None = None
    #: let the agent keep the training process alive for the next compatible segment
    #: (see ``training/handoff.py``); False for scripts that do per-segment work after their loop
    warm_process: bool = True


@dataclass
class Heartbeat(_Record):
    """Progress of a running attempt, written by the training session at a bounded rate."""

    attempt_id: str
    step: int
    time: float
    step_time_ewma: float | None = None
    last_committed_step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    pid: int | None = None
    save_cost_seconds: float | None = None
    interval_seconds: float | None = None
    #: when the training process saw a preemption notice (EC2: IMDS ``spot/instance-action``; local: the
    #: notice file; SIGTERM), so the Airflow side sees it before the attempt ends; ``notice`` its detail
    notice_at: float | None = None
    notice: str | None = None
    #: when this attempt finished its first training step, and which step that was: its start-up (launch,
    #: python, restore, first step) ends there; the UI's remaining-time estimate measures it so
    first_step_at: float | None = None
    first_step: int | None = None

    _REQUIRED: ClassVar[_Kinds] = {"attempt_id": str, "step": int, "time": _NUMBER}
    _OPTIONAL: ClassVar[_Kinds] = {
        "step_time_ewma": _NUMBER, "last_committed_step": int, "save_cost_seconds": _NUMBER,
        "interval_seconds": _NUMBER, "notice_at": _NUMBER, "first_step_at": _NUMBER,
        "first_step": int}


@dataclass
class AttemptStatus(_Record):
    """Final word on an attempt, written once by the agent when the command exits."""

    attempt_id: str
    outcome: str
    exit_code: int | None
    started_at: float
    ended_at: float
    last_committed_step: int | None = None
    error_tail: str = ""
    instance_id: str | None = None
    #: whether the attempt's kill record (``JobLayout.write_kill``, written before its instance is ended)
    #: was there when the agent wrote this status, so the status is the kill's doing; None: not known (an
    #: agent of an older version, or the store did not answer), then the clocks decide (:meth:`before_kill`)
    kill_seen: bool | None = None

    _REQUIRED: ClassVar[_Kinds] = {
        "attempt_id": str, "outcome": str, "started_at": _NUMBER, "ended_at": _NUMBER}
    _OPTIONAL: ClassVar[_Kinds] = {"exit_code": int, "last_committed_step": int}

    @property
    def outcome_enum(self) -> Outcome:
        return Outcome(self.outcome)

    def completed_through(self, end_step: int) -> bool:
        """A ``completed`` status that committed ``end_step`` (its segment's end): the attempt's own end
        whatever kill came after the work (one can land between the command's exit and this status)."""
        return (self.outcome == Outcome.COMPLETED.value and self.last_committed_step is not None
                and self.last_committed_step >= end_step)

    def before_kill(self, killed_at: float | None, end_step: int | None = None) -> bool:
        """Whether this status is the attempt's own end and not its task's kill recorded at ``killed_at``
        (None: no kill recorded): always when it completed through ``end_step`` (:meth:`completed_through`).
        The agent's answer (``kill_seen``) needs no clocks; without it, the instance's clock (``ended_at``)
        is compared with the killer's (``killed_at``), which a skew fools."""
        if killed_at is None or (end_step is not None and self.completed_through(end_step)):
            return True
        if self.kill_seen is not None:
            return not self.kill_seen
        return self.ended_at < killed_at


@dataclass
class LivePrice(_Record):
    """A running attempt's price so far, from its market's price history: the time-weighted mean $/h from
    the attempt's billing start to ``through``. Written by the segment's trigger every so often, and only
    for a market that keeps a history (the live EC2 market); the attempt's ledger row supersedes it."""

    attempt_id: str
    price_per_hour: float
    through: float

    def __post_init__(self) -> None:
        for name in ("price_per_hour", "through"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"LivePrice.{name} must be a finite number >= 0, got {value!r}")


class JobLayout:
    """Keys of every object of one job in its store, and typed reads/writes of the protocol objects.

    This class is the only place that spells a key; other modules call these methods (a key renamed
    here is renamed everywhere). Layout::

        checkpoints/...                                   CHECKPOINTS (see checkpoint.py)
        control/job.json                                  JOB_KEY: start time, deadline-policy state
        control/summary.json                              SUMMARY_KEY: the finish task's job summary
        control/tries/<task-instance id>.json             try_key: a try's attempt id
        control/instances/<instance_id>/agent.json        agent_key: the agent's liveness (its last: why it exited)
        control/instances/<instance_id>/requests/<a>.json request_key
        control/attempts/<attempt_id>/launch.json         launch_key
        control/attempts/<attempt_id>/heartbeat.json      heartbeat_key
        control/attempts/<attempt_id>/status.json         status_key
        control/attempts/<attempt_id>/price.json          price_key: a running attempt's price so far
        control/attempts/<attempt_id>/killed.json         killed_key: when its task was killed (the first kill)
        control/ledger/<attempt_id>.json                  ledger_key
        control/probes/<probe_id>.json                    probe_key: a probe's bill (a ledger row, no work)
        control/idle/<instance_id>.json                   idle_key: a warm instance's bill between its last
                                                          attempt and its termination (a ledger row, no work)
        control/availability/<pool>/<time>-<job>-<n>.<tag>.<kind>.json
                                                          AVAILABILITY_PREFIX: the job's pool events
                                                          (storage/availability.py)
    """

    CHECKPOINTS = "checkpoints"
    INSTANCES_PREFIX = "control/instances/"
    ATTEMPTS_PREFIX = "control/attempts/"
    LEDGER_PREFIX = "control/ledger/"
    PROBES_PREFIX = "control/probes/"
    IDLE_PREFIX = "control/idle/"
    AVAILABILITY_PREFIX = "control/availability/"
    JOB_KEY = "control/job.json"
    SUMMARY_KEY = "control/summary.json"
    HEARTBEAT_NAME = "heartbeat.json"
    STATUS_NAME = "status.json"
    LAUNCH_NAME = "launch.json"
    PRICE_NAME = "price.json"
    KILLED_NAME = "killed.json"

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    # keys
    @classmethod
    def request_prefix(cls, instance_id: str) -> str:
        return f"{cls.INSTANCES_PREFIX}{instance_id}/requests/"

    @classmethod
    def request_key(cls, instance_id: str, attempt_id: str) -> str:
        return cls.request_prefix(instance_id) + f"{attempt_id}.json"

    @classmethod
    def agent_key(cls, instance_id: str) -> str:
        return f"{cls.INSTANCES_PREFIX}{instance_id}/agent.json"

    def agent_exits(self, instance_ids: Iterable[str]) -> dict[str, float]:
        """Those of ``instance_ids`` whose agent has exited, each with when: it shut its instance down for
        want of work (its idle timeout, ``idle``), or the instance was ended under it (a termination, a stop,
        a spot reclaim: ``sigterm``); the agent's last liveness says ``exited`` with the reason."""
        keys = {self.agent_key(i): i for i in instance_ids}
        exits = {}
        for key, raw in self.store.get_many(sorted(keys)).items():
            try:
                body = json.loads(raw)
                if body.get("state") == "exited" and body.get("exit_reason") in ("idle", "sigterm"):
                    exits[keys[key]] = float(body["time"])
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # torn or foreign: this instance's idle time is not billed, nothing else is lost
        return exits

    @classmethod
    def attempt_prefix(cls, attempt_id: str) -> str:
        return f"{cls.ATTEMPTS_PREFIX}{attempt_id}/"

    @classmethod
    def heartbeat_key(cls, attempt_id: str) -> str:
        return cls.attempt_prefix(attempt_id) + cls.HEARTBEAT_NAME

    @classmethod
    def status_key(cls, attempt_id: str) -> str:
        return cls.attempt_prefix(attempt_id) + cls.STATUS_NAME

    @classmethod
    def launch_key(cls, attempt_id: str) -> str:
        return cls.attempt_prefix(attempt_id) + cls.LAUNCH_NAME

    @classmethod
    def price_key(cls, attempt_id: str) -> str:
        return cls.attempt_prefix(attempt_id) + cls.PRICE_NAME

    @classmethod
    def killed_key(cls, attempt_id: str) -> str:
        return cls.attempt_prefix(attempt_id) + cls.KILLED_NAME

    @classmethod
    def ledger_key(cls, attempt_id: str) -> str:
        return f"{cls.LEDGER_PREFIX}{safe_id(attempt_id)}.json"

    @classmethod
    def probe_key(cls, probe_id: str) -> str:
        return f"{cls.PROBES_PREFIX}{safe_id(probe_id)}.json"

    @classmethod
    def idle_key(cls, instance_id: str) -> str:
        return f"{cls.IDLE_PREFIX}{safe_id(instance_id)}.json"

    @staticmethod
    def try_key(ti_id: object) -> str:
        return f"control/tries/{safe_id(ti_id)}.json"

    @classmethod
    def attempt_keys(cls, store: ObjectStore, name: str, listing: list[str] | None = None) -> list[str]:
        """Keys of one kind of per-attempt object (``HEARTBEAT_NAME``, ``STATUS_NAME``, ...) of every attempt
        (from ``listing``, a listing of ``ATTEMPTS_PREFIX`` already made, when given)."""
        keys = store.list(cls.ATTEMPTS_PREFIX) if listing is None else listing
        return [k for k in keys if k.endswith("/" + name)]

    def checkpoint_store(self, writer: str = "local"):
        """The job's :class:`~airflow_spot.storage.checkpoint.CheckpointStore`."""
        from airflow_spot.storage.checkpoint import CheckpointStore  # checkpoint.py needs nothing from here

        return CheckpointStore(self.store.child(self.CHECKPOINTS), writer=writer)

    def latest_step(self) -> int | None:
        """The job's newest committed checkpoint step, or None before the first."""
        return self.checkpoint_store().latest_step()

    # typed access
    def write_request(self, instance_id: str, req: SegmentRequest) -> None:
        self.store.put_bytes(self.request_key(instance_id, req.attempt_id), req.to_json())

    def pending_requests(self, instance_id: str) -> list[SegmentRequest]:
        out = []
        for key in self.store.list(self.request_prefix(instance_id)):
            if key.endswith(".json"):
                try:
                    out.append(SegmentRequest.from_json(self.store.get_bytes(key)))
                except (ObjectNotFound, SchemaError):
                    continue
        return sorted(out, key=lambda r: (r.created_at, r.attempt_id))

    def write_heartbeat(self, hb: Heartbeat) -> None:
        self.store.put_bytes(self.heartbeat_key(hb.attempt_id), hb.to_json())

    def read_heartbeat(self, attempt_id: str) -> Heartbeat | None:
        return self._read(self.heartbeat_key(attempt_id), Heartbeat)

    def write_status(self, status: AttemptStatus) -> None:
        self.store.put_bytes(self.status_key(status.attempt_id), status.to_json())

    def read_status(self, attempt_id: str) -> AttemptStatus | None:
        return self._read(self.status_key(attempt_id), AttemptStatus)

    def write_kill(self, attempt_id: str, at: float) -> None:
        """Record that the attempt's task was killed at ``at`` (before its instance is terminated): a status
        its agent writes after that is the kill's doing (a termination reads as ``preempted``), which whoever
        bills the attempt later must know (``accounting.account_abandoned``). The first kill stands."""
        if self.read_kill(attempt_id) is None:
            self.store.put_bytes(self.killed_key(attempt_id), json.dumps({"killed_at": float(at)}).encode())

    def read_kill(self, attempt_id: str) -> float | None:
        try:
            return float(json.loads(self.store.get_bytes(self.killed_key(attempt_id)))["killed_at"])
        except ObjectNotFound:
            return None
        except (ValueError, TypeError, KeyError):  # torn: the kill is known to have happened, not when
            return None

    def write_live_price(self, price: LivePrice) -> None:
        self.store.put_bytes(self.price_key(price.attempt_id), price.to_json())

    def _read(self, key: str, cls):
        try:
            return cls.from_json(self.store.get_bytes(key))
        except ObjectNotFound:
            return None
