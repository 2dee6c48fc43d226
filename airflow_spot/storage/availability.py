"""The availability log: every launch outcome, capacity refusal and preemption, per spot pool.

Two logs of the same format:

* the **job's own** (``control/availability/`` in the job's store, :meth:`JobLayout.availability_log`):
  what this job met — the part of its ledger that is not an attempt (capacity refusals) plus launches
  and preemptions;
* the **deployment's** (``availability_uri``): the same events of every job of the deployment, so two
  jobs learn from each other and a new job starts with the deployment's history. Read through the
  market (:meth:`airflow_spot.market.base.MarketSource.observations`).

Where the deployment log lives (:func:`deployment_availability_uri`): the ``availability_uri`` the
caller gives, else the environment variable ``AIRFLOW_SPOT_AVAILABILITY_URI`` (one value for the whole
deployment), else ``_availability`` beside the job's root (the parent of its ``checkpoint_uri``: with
the usual ``s3://bucket/{{ dag.dag_id }}/{{ run_id }}`` the runs of one DAG share it).

Concurrent writers never conflict: every event is one object of its own,
``<pool>/<time>-<job>-<nonce>.json``, written once (no read-modify-write, no lock); readers list the
prefix. Old events can be dropped with :meth:`AvailabilityLog.prune`.
"""
from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable

from airflow_spot.policy.observations import PoolEvent
from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore, open_store
from airflow_spot.storage.protocol import safe_id

ENV_URI = "AIRFLOW_SPOT_AVAILABILITY_URI"
DEFAULT_DIR = "_availability"
SCHEMA = 1


def deployment_availability_uri(job_uri: str, availability_uri: str | None = None, environ=None) -> str:
    """The deployment log's URI (see the module docstring for the order of precedence)."""
    if availability_uri:
        return availability_uri
    env = os.environ if environ is None else environ
    if env.get(ENV_URI):
        return env[ENV_URI]
    return beside_job_root(job_uri, DEFAULT_DIR)


def beside_job_root(job_uri: str, name: str) -> str:
    """``name`` in the parent of the job's root, where the runs of one DAG meet (inside the root when the
    job is at the root of its bucket or file system)."""
    root = job_uri.rstrip("/")
    parent, _, last = root.rpartition("/")
    if not last or parent.endswith(":/") or parent.endswith(":") or not parent:
        return f"{root}/{name}"
    return f"{parent}/{name}"


class AvailabilityLog:
    """Append and read :class:`~airflow_spot.policy.observations.PoolEvent` objects under one store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @classmethod
    def open(cls, uri: str, **options) -> AvailabilityLog:
        return cls(open_store(uri, **options))

    @staticmethod
    def key(event: PoolEvent, nonce: str) -> str:
        # the time first in the name so a listing is in time order per pool
        return f"{safe_id(event.pool)}/{event.at:017.3f}-{safe_id(event.job or 'job')}-{nonce}.json"

    def append(self, event: PoolEvent) -> str:
        """Write one event (one new object); returns its key."""
        body = {"schema": SCHEMA, "pool": event.pool, "kind": event.kind, "at": event.at, "job": event.job}
        key = self.key(event, uuid.uuid4().hex[:12])
        self.store.put_bytes(key, json.dumps(body, sort_keys=True).encode())
        return key

    def extend(self, events: Iterable[PoolEvent]) -> None:
        for e in events:
            self.append(e)

    def read(self, *, since: float | None = None, until: float | None = None) -> list[PoolEvent]:
        """Every event with ``since <= at <= until``, in time order. Objects that cannot be read (a newer
        schema, a partial write of a store without atomic puts) are skipped: a log entry is a hint."""
        out = []
        for key in self.store.list(""):
            if not key.endswith(".json"):
                continue
            try:
                at = float(key.rsplit("/", 1)[-1].split("-", 1)[0])
            except ValueError:
                continue
            if (since is not None and at < since) or (until is not None and at > until):
                continue
            try:
                d = json.loads(self.store.get_bytes(key))
                if int(d.get("schema", 0)) > SCHEMA:
                    continue
                out.append(PoolEvent(str(d["pool"]), str(d["kind"]), float(d["at"]), str(d.get("job", ""))))
            except (ObjectNotFound, ValueError, KeyError, TypeError):
                continue
        return sorted(out, key=lambda e: (e.at, e.pool, e.kind))

    def prune(self, before: float) -> int:
        """Delete events older than ``before``; returns how many."""
        old = []
        for key in self.store.list(""):
            try:
                if float(key.rsplit("/", 1)[-1].split("-", 1)[0]) < before:
                    old.append(key)
            except ValueError:
                continue
        if old:
            self.store.delete(old)
        return len(old)


def job_availability_log(job_store: ObjectStore) -> AvailabilityLog:
    """The job's own log, in its store under :attr:`JobLayout.AVAILABILITY_PREFIX`."""
    from airflow_spot.storage.protocol import JobLayout

    return AvailabilityLog(job_store.child(JobLayout.AVAILABILITY_PREFIX))
