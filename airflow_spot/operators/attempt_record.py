"""What the operator remembers about one attempt, kept in the job's store rather than in the worker.

Under a real scheduler the worker process that ran ``execute`` is gone by the time ``execute_complete``
runs (possibly on another worker), and ``dag.test()`` drops ``defer(kwargs=...)``. So everything
``execute_complete`` and the final task need is written next to the attempt's other objects::

    control/job.json                          the job's start and deadline-policy state
    control/attempts/<attempt_id>/launch.json which instance, offer and start time this attempt got
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_spot.policy.offers import Offer
from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore
from airflow_spot.storage.protocol import SCHEMA_VERSION, JobLayout, SchemaError

JOB_KEY = JobLayout.JOB_KEY


def launch_key(attempt_id: str) -> str:
    return JobLayout.launch_key(attempt_id)


@dataclass
class AttemptLaunch:
    """One attempt as the operator started it.

    :param billed_from: when billing for this attempt starts: the instance's launch for a fresh instance,
        the request time for a warm one (its earlier time is billed to the attempts that ran on it).
    """

    attempt_id: str
    segment_index: int
    start_step: int
    end_step: int
    instance_id: str
    offer: dict[str, Any]
    requested_at: float
    billed_from: float
    reused_instance: bool
    try_number: int
    task_id: str
    #: the job's newest committed step when the attempt was requested (where it resumes)
    resume_step: int = 0
    #: egress this attempt pays to restore from a checkpoint store in another region
    transfer_dollars: float = 0.0
    #: egress per billed hour for its saves written back to a store in another region
    remote_dollars_per_hour: float = 0.0
    #: the DAG run that launched it (empty in records written before 2026-11-27): a store shared by runs
    #: holds other runs' attempts, which only their own run bills
    run_id: str = ""
    schema: int = field(default=SCHEMA_VERSION)

    @property
    def offer_obj(self) -> Offer:
        return Offer.from_dict(self.offer)

    def write(self, store: ObjectStore) -> None:
        store.put_bytes(launch_key(self.attempt_id), json.dumps(asdict(self), sort_keys=True).encode())

    @classmethod
    def read(cls, store: ObjectStore, attempt_id: str) -> AttemptLaunch | None:
        try:
            data = json.loads(store.get_bytes(launch_key(attempt_id)))
        except ObjectNotFound:
            return None
        if int(data.get("schema", 0)) > SCHEMA_VERSION:
            raise SchemaError(f"attempt record {attempt_id}: unsupported schema {data.get('schema')}")
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def read_job(store: ObjectStore, now: float) -> dict[str, Any]:
    """The job record: ``started_at`` (set by the job's first attempt) and ``deadline_committed`` (the
    deadline policy's safety net fired: on-demand to the end). Created on first use."""
    try:
        return json.loads(store.get_bytes(JOB_KEY))
    except ObjectNotFound:
        job = {"started_at": now, "deadline_committed": False, "schema": SCHEMA_VERSION}
        store.put_bytes(JOB_KEY, json.dumps(job, sort_keys=True).encode())
        return job


def write_job(store: ObjectStore, job: dict[str, Any]) -> None:
    store.put_bytes(JOB_KEY, json.dumps(job, sort_keys=True).encode())
