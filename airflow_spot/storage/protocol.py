"""The protocol between Airflow and an instance, carried only by objects in the job's store.

Layout under a job URI (the user's ``checkpoint_uri``)::

    checkpoints/<step:012d>-<writer>/state.pt       data first ...
    checkpoints/<step:012d>-<writer>/MANIFEST.json  ... manifest last (see checkpoint.py)
    control/instances/<instance_id>/requests/<attempt_id>.json   operator -> agent
    control/attempts/<attempt_id>/heartbeat.json                 training session -> trigger
    control/attempts/<attempt_id>/status.json                    agent -> trigger (final, written once)
    control/ledger/<attempt_id>.json                             operator (see policy.ledger)

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
import re
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore

SCHEMA_VERSION = 1

#: Exit code of a training process that saw a preemption notice and committed its emergency save
#: (EX_TEMPFAIL from sysexits.h: "temporary failure, the user is invited to retry").
PREEMPTED_EXIT_CODE = 75


class Outcome(str, Enum):
    COMPLETED = "completed"
    PREEMPTED = "preempted"
    FAILED = "failed"
    LOST = "lost"

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


@dataclass
class _Record:
    schema: int = field(default=SCHEMA_VERSION, kw_only=True)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Any:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise SchemaError(f"{cls.__name__}: not JSON ({exc})") from exc
        if not isinstance(data, dict) or int(data.get("schema", 0)) > SCHEMA_VERSION:
            raise SchemaError(f"{cls.__name__}: unsupported schema {data.get('schema') if isinstance(data, dict) else data!r}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


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

    @property
    def outcome_enum(self) -> Outcome:
        return Outcome(self.outcome)


class JobLayout:
    """Keys of the protocol objects of one job, and typed reads/writes of them."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    # keys
    @staticmethod
    def request_prefix(instance_id: str) -> str:
        return f"control/instances/{instance_id}/requests/"

    @classmethod
    def request_key(cls, instance_id: str, attempt_id: str) -> str:
        return cls.request_prefix(instance_id) + f"{attempt_id}.json"

    @staticmethod
    def heartbeat_key(attempt_id: str) -> str:
        return f"control/attempts/{attempt_id}/heartbeat.json"

    @staticmethod
    def status_key(attempt_id: str) -> str:
        return f"control/attempts/{attempt_id}/status.json"

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

    def _read(self, key: str, cls):
        try:
            return cls.from_json(self.store.get_bytes(key))
        except ObjectNotFound:
            return None
