"""The tags that mark a job's instances: how warm reuse, the finish task and ``reap`` find them, and only them."""
from __future__ import annotations

from airflow_spot.backends.base import TAG_JOB_URI

TAG_DAG = "airflow-spot:dag"
TAG_RUN = "airflow-spot:run"
TAG_JOB = "airflow-spot:job"
TAG_TASK = "airflow-spot:task"
TAG_STORE = TAG_JOB_URI  # the job's store: what tells one deployment's job from another's


def job_tags(dag_id: str, run_id: str, job_name: str, job_uri: str) -> dict[str, str]:
    """Tags that find every instance of one job (warm reuse, final cleanup), and only its: ``job_uri`` is its
    store's (``ObjectStore.uri``)."""
    return {TAG_DAG: dag_id, TAG_RUN: run_id, TAG_JOB: job_name, TAG_STORE: job_uri}
