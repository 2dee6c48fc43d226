"""What the deployment's finished jobs measured about their overheads: the remaining-time estimate's prior.

A running job's estimate (:func:`airflow_spot.policy.estimate.estimate_remaining`) builds on the job's own
measured overheads. Some it meets only late: its first segment boundary (Airflow finishing one segment
task and starting the next, the warm instance taking the request), the exit of its last process, a
preemption's restart. Until then they counted as nothing, and every reading before the first boundary
came out short by what the boundaries left cost (the estimate benchmark: a median 9.3 % before, 1.1 %
after). The jobs of the same deployment — the earlier runs of a scheduled retraining DAG above all — run
on the same Airflow, backend and image and have measured them.

Each finished job appends the overheads it measured itself (:meth:`JobOverheads.measured_fields`), one
object per job under ``<time>-<job>.json`` (no read-modify-write, concurrent writers are safe); a reader
takes, per field, the median of the newest :data:`NEWEST` jobs that measured it. Where the histories live
(:func:`history_uris`): ``_overheads`` beside the job's root (the parent of its ``checkpoint_uri``), as the
deployment's availability log, so the runs of one DAG share it; and, when
``AIRFLOW_SPOT_OVERHEAD_HISTORY_URI`` names one, the whole deployment's. A job records its figures in both
and reads each field from the most specific history that has it: the DAG's own runs (same model, same
restore) first, the deployment's (same Airflow, same backend) for what they have not measured — a DAG's
first run above all.

Reading it is best effort: an unreadable entry is skipped, and a job whose history cannot be read
estimates from its own measurements alone.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics

from airflow_spot.policy.estimate import PRIOR_FIELDS
from airflow_spot.storage.availability import beside_job_root
from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore
from airflow_spot.storage.protocol import safe_id

log = logging.getLogger(__name__)

ENV_URI = "AIRFLOW_SPOT_OVERHEAD_HISTORY_URI"
DEFAULT_DIR = "_overheads"
SCHEMA = 1
#: the jobs a prior is the median of: recent enough to follow a change of image or Airflow, enough to
#: outvote one odd run
NEWEST = 10
#: entries kept: each append deletes the older ones, so reading the history lists a bounded directory
KEEP = 5 * NEWEST


def history_uris(job_uri: str, environ=None) -> list[str]:
    """The histories a job belongs to, most specific first: ``_overheads`` beside the job's root (inside it
    when the job is at the root of its bucket), then ``AIRFLOW_SPOT_OVERHEAD_HISTORY_URI`` when it is set
    (one history for the whole deployment) and is another place."""
    env = os.environ if environ is None else environ
    uris = [beside_job_root(job_uri, DEFAULT_DIR)]
    shared = env.get(ENV_URI)
    if shared and shared.rstrip("/") != uris[0].rstrip("/"):
        uris.append(shared)
    return uris


def job_name(job_uri: str) -> str:
    """How a job is named in the history: its root's last part (its run, among the runs beside it) and a
    digest of the whole root (the deployment's history holds every DAG's runs, whose run ids repeat)."""
    root = job_uri.rstrip("/")
    return f"{root.rsplit('/', 1)[-1]}.{hashlib.sha256(root.encode()).hexdigest()[:8]}"


class OverheadHistory:
    """Append and read the overheads the deployment's jobs measured."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def append(self, job: str, at: float, overheads: dict[str, float], keep: int = KEEP) -> str | None:
        """Record one finished job's measured overheads (fields outside :data:`PRIOR_FIELDS` and values that
        are not finite numbers >= 0 are dropped); nothing is written when none is left. Entries older than
        the newest ``keep`` are deleted (two jobs finishing together may both delete: both keep the newest)."""
        kept = {k: float(v) for k, v in overheads.items()
                if k in PRIOR_FIELDS and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0}
        if not kept:
            return None
        key = f"{at:017.3f}-{safe_id(job)}.json"
        body = {"schema": SCHEMA, "job": job, "at": at, "overheads": kept}
        self.store.put_bytes(key, json.dumps(body, sort_keys=True).encode())
        keys = self._keys()
        # one entry per job: a run cleared and finished again replaces its figures, not outvotes the others
        again = [k for k in keys if k != key and k.endswith(f"-{safe_id(job)}.json")]
        old = sorted(set(keys[keep:]) | set(again))
        if old:
            self.store.delete(old)
        return key

    def _keys(self) -> list[str]:
        """Entry keys, newest first (their names start with the time)."""
        return sorted((k for k in self.store.list("") if k.endswith(".json")), reverse=True)

    def prior(self, *, exclude_job: str | None = None, newest: int = NEWEST) -> dict[str, float]:
        """Per field, the median over the newest ``newest`` jobs that measured it (``exclude_job``: the
        reading job itself, which has its own figures)."""
        keys = self._keys()
        skip = f"-{safe_id(exclude_job)}.json" if exclude_job else None
        seen: dict[str, list[float]] = {}
        for key in keys:
            if skip and key.endswith(skip):
                continue
            try:
                d = json.loads(self.store.get_bytes(key))
                if int(d.get("schema", 0)) > SCHEMA:
                    continue
                for k, v in d["overheads"].items():
                    if k in PRIOR_FIELDS and len(seen.setdefault(k, [])) < newest:
                        seen[k].append(float(v))
            except (ObjectNotFound, ValueError, KeyError, TypeError, AttributeError):
                continue
            if len(seen) == len(PRIOR_FIELDS) and all(len(v) >= newest for v in seen.values()):
                break
        return {k: statistics.median(v) for k, v in seen.items() if v}


def record(job_store: ObjectStore, job: str, at: float, overheads: dict[str, float]) -> None:
    """Append one finished job's measured overheads to every history it belongs to; every history is tried,
    then the first error is raised (the caller logs it: a later job estimates from what it can read)."""
    first: Exception | None = None
    for uri in history_uris(job_store.uri):
        try:
            OverheadHistory(job_store.at(uri)).append(job, at, overheads)
        except Exception as exc:  # noqa: BLE001 - the other history may still take it
            first = first or exc
    if first is not None:
        raise first


def prior_for(job_store: ObjectStore, exclude_job: str | None = None) -> dict[str, float]:
    """Per field, the prior from the most specific history that has it (the DAG's runs, then the
    deployment's); a history that cannot be read is skipped with a warning."""
    merged: dict[str, float] = {}
    for uri in history_uris(job_store.uri):
        try:
            found = OverheadHistory(job_store.at(uri)).prior(exclude_job=exclude_job)
        except Exception as exc:  # noqa: BLE001 - a prior is a hint; the next history or the job's own figures stand
            log.warning("overhead history %s not read (%s: %s)", uri, type(exc).__name__, exc)
            continue
        for k, v in found.items():
            merged.setdefault(k, v)
    return merged


#: beside the job root, as ``_overheads``: the step time per GPU model each training job of a DAG last
#: measured, so its next run's first segment has a step time before its own first heartbeat
PACES_DIR = "_paces"


def _pace_store(job_store: ObjectStore) -> ObjectStore:
    return job_store.at(beside_job_root(job_store.uri, PACES_DIR))


def pace_key(dag_id: str, job: str) -> str:
    """One object per DAG and training job (the same model, run after run); the newest run's replaces it."""
    return f"{safe_id(dag_id, job)}.json"


def record_pace(job_store: ObjectStore, dag_id: str, job: str, profile: dict[str, float], at: float) -> None:
    """Keep the step time per GPU model ``profile`` this run measured for the DAG's next runs (only beside
    the job's root: another DAG's or job's model is not this one's)."""
    kept = {str(k): float(v) for k, v in profile.items() if isinstance(v, (int, float)) and 0 < v < math.inf}
    if not kept:
        return
    body = {"schema": SCHEMA, "dag_id": dag_id, "job": job, "at": at, "job_uri": job_store.uri, "profile": kept}
    _pace_store(job_store).put_bytes(pace_key(dag_id, job), json.dumps(body, sort_keys=True).encode())


def earlier_pace(job_store: ObjectStore, dag_id: str, job: str) -> dict[str, float]:
    """The step time per GPU model the DAG's last finished run of ``job`` measured (empty when none is
    readable); a hint for the first segment of a run, which has measured nothing yet."""
    try:
        body = json.loads(_pace_store(job_store).get_bytes(pace_key(dag_id, job)))
        if int(body.get("schema", 0)) > SCHEMA:
            return {}
        return {str(k): float(v) for k, v in body["profile"].items() if 0 < float(v) < math.inf}
    except ObjectNotFound:
        return {}
    except Exception as exc:  # noqa: BLE001 - a hint; the job measures its own
        log.warning("earlier runs' step times not read (%s: %s)", type(exc).__name__, exc)
        return {}
