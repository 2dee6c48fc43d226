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
``<pool>/<time>-<job>-<nonce>.<pool tag>.<kind>.json``, written once (no read-modify-write, no lock).
The name carries the event: the folder is the pool's name made key-safe, the tag a hash of the exact
name (it tells apart pools whose names differ only in characters a key cannot hold), then the time, the
job's key-safe id and the kind. So a reader lists (one LIST call per folder and per 1000 entries) and
reads one body per pool, to learn its exact name, not one per event: a job reads the log at every
decision, and one GET per event made a decision's read grow with the whole history
(``benchmarks/bench_availability_log.py``). A reader of given pools lists only their folders, from a
time on if asked. The body repeats the event for anyone reading objects one by one. Entries of the first layout, ``<pool>/<time>-<job>-<nonce>.json``, are still read, one GET
each. The events no decision reads (repeats inside a run of one pool's up-events) are deleted by
:meth:`AvailabilityLog.compact` (each job's finish task; ``airflow-spot availability compact``); old events
can be dropped with :meth:`AvailabilityLog.prune` (`airflow-spot availability prune`), or on S3 by a
lifecycle rule expiring the log's prefix (README).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import uuid
from collections.abc import Iterable

from airflow_spot.policy.observations import EVENT_KINDS, UP_KINDS, PoolEvent
from airflow_spot.storage.object_store import ObjectStore, open_store
from airflow_spot.storage.protocol import safe_id

ENV_URI = "AIRFLOW_SPOT_AVAILABILITY_URI"
#: :meth:`AvailabilityLog.compact` leaves the events of the last hours alone: an event can be written late
#: (a preemption is logged when its attempt is accounted), and one landing inside a compacted run would
#: split it where the dropped events stood
COMPACT_AFTER_HOURS = 6.0
#: compaction keeps one event every this many hours of a run of ups, so that expiry shortens a pool's
#: observed up-time by at most this much
COMPACT_KEEP_EVERY_HOURS = 6.0
DEFAULT_DIR = "_availability"
SCHEMA = 1
#: ``<time>-<job>-<nonce>`` of an entry's name (``.<pool tag>.<kind>.json`` follows in the current layout)
_NAME = re.compile(r"^(\d+\.\d+)-(.*)-([0-9a-f]{12})$")
_TAG = re.compile(r"^[0-9a-f]{8}$")


def _pool_tag(pool: str) -> str:
    return hashlib.sha1(pool.encode()).hexdigest()[:8]


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


def _entry_time(key: str) -> float | None:
    """The time an entry's name starts with (both layouts), or None for a key that is no entry."""
    try:
        return float(key.rsplit("/", 1)[-1].split("-", 1)[0]) if key.endswith(".json") else None
    except ValueError:
        return None


class AvailabilityLog:
    """Append and read :class:`~airflow_spot.policy.observations.PoolEvent` objects under one store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @classmethod
    def open(cls, uri: str, **options) -> AvailabilityLog:
        return cls(open_store(uri, **options))

    @staticmethod
    def key(event: PoolEvent, nonce: str) -> str:
        # the time first, 13 integer digits as in the first layout, so a listing is in time order per pool
        # and can start at a time; 7 decimals: 17 significant digits for times since 2001, which a float
        # reads back exactly. An empty job (this job's own) stays empty.
        job = safe_id(event.job) if event.job else ""
        return f"{safe_id(event.pool)}/{event.at:021.7f}-{job}-{nonce}.{_pool_tag(event.pool)}.{event.kind}.json"

    @staticmethod
    def _parse_name(key: str) -> tuple[str, str, float, str, str] | None:
        """``(folder, tag, time, kind, job)`` of a current-layout name, or None (the first layout, or not an
        entry); the job as its key-safe id."""
        folder, _, name = key.rpartition("/")
        rest, _, kind = name.removesuffix(".json").rpartition(".")
        stem, _, tag = rest.rpartition(".")
        m = _NAME.match(stem) if name.endswith(".json") and kind in EVENT_KINDS and _TAG.match(tag) else None
        return None if m is None else (folder, tag, float(m.group(1)), kind, m.group(2))

    def append(self, event: PoolEvent) -> str:
        """Write one event (one new object); returns its key."""
        body = {"schema": SCHEMA, "pool": event.pool, "kind": event.kind, "at": event.at, "job": event.job}
        key = self.key(event, uuid.uuid4().hex[:12])
        self.store.put_bytes(key, json.dumps(body, sort_keys=True).encode())
        return key

    def extend(self, events: Iterable[PoolEvent]) -> None:
        for e in events:
            self.append(e)

    def read(self, *, since: float | None = None, until: float | None = None,
             pools: Iterable[str] | None = None) -> list[PoolEvent]:
        """Every event with ``since <= at <= until`` (of ``pools`` only, when given), in time order; the
        job of an event read from its name is its key-safe id (``safe_id``: the operators' job ids are).

        Events come from the names: one body is read per pool, to learn its exact name (the folder holds
        it made key-safe), unless ``pools`` names it; entries of the first layout are read one body each.
        With ``pools``, only their folders are listed, each from ``since`` on. Entries that cannot be read
        (a newer schema, a partial write of a store without atomic puts) are skipped: a log entry is a
        hint."""
        if since is not None and not math.isfinite(since):
            return [] if since > 0 else self.read(until=until, pools=pools)
        if pools is None:
            keys, named = self.store.list(""), {}
        else:
            named = {_pool_tag(pool): pool for pool in pools}
            # from the second before ``since``: both layouts' names start with the time's 13 integer digits
            start = f"{max(0, int(since) - 1):013d}" if since is not None and since >= 1 else None
            keys = []
            for folder in sorted({safe_id(pool) for pool in named.values()}):
                keys.extend(self.store.list(f"{folder}/", start_after=f"{folder}/{start}" if start else None))
        parsed, bodies = [], []
        for key in keys:
            at = _entry_time(key)
            if at is None:
                continue
            # the first layout's names round the time to the ms: its bodies decide below
            if (since is not None and at < since - 0.001) or (until is not None and at > until + 0.001):
                continue
            name = self._parse_name(key)
            if name is None:
                bodies.append(key)
            elif pools is None or name[1] in named:
                parsed.append((key, name))
        # a pool not named by the caller: its exact name from one of its entries' bodies
        unknown = {}
        for key, (folder, tag, *_rest) in parsed:
            if tag not in named:
                unknown.setdefault((folder, tag), key)
        samples = self.store.get_many(list(unknown.values()))
        for (folder, tag), key in unknown.items():
            body = self._from_body(samples[key]) if key in samples else None
            if body is not None and _pool_tag(body.pool) == tag and safe_id(body.pool) == folder:
                named[tag] = body.pool
        events = [PoolEvent(named[tag], kind, at, job) for _key, (_folder, tag, at, kind, job) in parsed if tag in named]
        # a pool whose sampled entry could not be read: its entries' bodies, one by one
        bodies += [key for key, (_folder, tag, *_rest) in parsed if tag not in named]
        events += [e for e in map(self._from_body, self.store.get_many(bodies).values()) if e is not None]
        wanted = None if pools is None else set(named.values())
        return sorted((e for e in events if (wanted is None or e.pool in wanted)
                       and (since is None or e.at >= since) and (until is None or e.at <= until)),
                      key=lambda e: (e.at, e.pool, e.kind))

    @staticmethod
    def _from_body(raw: bytes) -> PoolEvent | None:
        try:
            d = json.loads(raw)
            if int(d.get("schema", 0)) > SCHEMA:
                return None
            return PoolEvent(str(d["pool"]), str(d["kind"]), float(d["at"]), str(d.get("job", "")))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def compact(self, before: float, dry_run: bool = False) -> int:
        """Delete the events no decision reads; returns how many (``dry_run``: only count them).

        Of a run of one pool's events that all say it held capacity (launches, probes that got it), a
        decision reads only the first and the newest (:func:`~airflow_spot.policy.observations.pool_views`:
        since when the pool is up, and the newest sighting); the events between them go when they and the
        next one are older than ``before``. A job on on-demand probes every pool every 15 minutes, so where
        pools are mostly up, most of a busy log is such repeats. The replay's jobs keep their events the same way
        (``ObservedController._record``). Kept besides: one event every :data:`COMPACT_KEEP_EVERY_HOURS` of
        a run, so that when expiry (:meth:`prune`, an S3 lifecycle rule) takes a run's first event, the pool
        looks up at most that much shorter than it was, not since its newest repeats.

        Runs of down-events (refusals) are kept whole: a job merges the log with its own ledger, whose
        up-events (its instance still running at an attempt's end) are not in the log, and one of them
        inside a run of refusals splits it where dropped events would have stood. An up-event inside a run
        of up-events changes nothing, so what a decision reading the log at or after ``before`` concludes
        does not change, as long as the down-events it merges are in the log too (the operators write
        each refusal and preemption there) and none is written later than ``before`` (hence the hours of
        margin: a preemption is logged when its attempt is accounted).
        """
        runs: dict[tuple[str, str], list[tuple[float, bool, str]]] = {}
        first_layout = []
        for key in self.store.list(""):
            name = self._parse_name(key)
            if name is not None:
                folder, tag, at, kind, _job = name
                runs.setdefault((folder, tag), []).append((at, kind in UP_KINDS, key))
            elif _entry_time(key) is not None:
                first_layout.append(key)
        # the first layout's names do not say the kind: its bodies do (one GET each, as a read does)
        for key, raw in self.store.get_many(first_layout).items():
            event = self._from_body(raw)
            if event is not None:
                runs.setdefault((safe_id(event.pool), _pool_tag(event.pool)), []).append((event.at, event.up, key))
        keep_every = COMPACT_KEEP_EVERY_HOURS * 3600
        drop = []
        for entries in runs.values():
            entries.sort(key=lambda e: (e[0], e[1]))  # pool_views' order: a down-event first at equal times
            kept_at = -math.inf
            for i, (at, up, key) in enumerate(entries):
                inside = up and 0 < i < len(entries) - 1 and entries[i - 1][1] and entries[i + 1][1]
                if inside and entries[i + 1][0] < before and at - kept_at < keep_every:
                    drop.append(key)
                else:
                    kept_at = at
        if drop and not dry_run:
            self.store.delete(drop)
        return len(drop)

    def prune(self, before: float, dry_run: bool = False) -> int:
        """Delete the entries older than ``before`` (by the time their names carry); returns how many
        (``dry_run``: only count them)."""
        old = []
        for key in self.store.list(""):
            at = _entry_time(key)
            if at is not None and at < before:
                old.append(key)
        if old and not dry_run:
            self.store.delete(old)
        return len(old)


def job_availability_log(job_store: ObjectStore) -> AvailabilityLog:
    """The job's own log, in its store under :attr:`JobLayout.AVAILABILITY_PREFIX`."""
    from airflow_spot.storage.protocol import JobLayout

    return AvailabilityLog(job_store.child(JobLayout.AVAILABILITY_PREFIX))
