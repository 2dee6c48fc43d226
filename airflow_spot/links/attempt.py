"""Extra links of a segment task: where its attempt lives in the store, and the job's page in the UI plugin.

As the Amazon provider's links do, a task stores the link's *fields* in XCom (``job_uri``, ``attempt_id``,
``aws_conn_id``) and the URL is built when the link is read: a change of URL scheme (or of the console's
address) then applies to old runs too, and the fields double as the plugin's way to find a job while it
runs (``airflow_spot/ui/jobs.py``). ``file://`` stores link to the attempt's folder; ``s3://`` stores to the
S3 console page of its prefix (with the connection's region when it has one).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlparse

from airflow.sdk import BaseOperatorLink
from airflow.sdk.execution_time.xcom import XCom

from airflow_spot.storage.protocol import JobLayout

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator, Context
    from airflow.sdk.types import TaskInstanceKey

log = logging.getLogger(__name__)

#: XCom key of the link fields (kept from the first version of this link, so old runs still resolve)
LINK_XCOM_KEY = "spot_attempt"


def attempt_location(store_uri: str, attempt_id: str, region: str | None = None) -> str:
    """A URL for the attempt's objects under ``control/attempts/<attempt_id>/``."""
    base = store_uri.rstrip("/") + "/" + JobLayout.attempt_prefix(attempt_id)
    parsed = urlparse(base)
    if parsed.scheme == "s3":
        region_part = f"region={quote(region, safe='')}&" if region else ""
        return (
            "https://s3.console.aws.amazon.com/s3/buckets/"
            f"{parsed.netloc}?{region_part}prefix={quote(parsed.path.lstrip('/'), safe='')}"
        )
    return base


def job_page(dag_id: str, run_id: str) -> str:
    """The job's page in the UI plugin (relative to the API server's root)."""
    return f"/spot/jobs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}"


def _connection_region(aws_conn_id: str | None) -> str | None:
    """The region of an AWS connection, or None (no connection, or it cannot be read here)."""
    if not aws_conn_id:
        return None
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsGenericHook

        return AwsGenericHook(aws_conn_id=aws_conn_id, client_type="s3").conn_region_name
    except Exception as exc:  # noqa: BLE001 - a link must render even when the connection is unusable
        log.debug("no region for connection %s: %s", aws_conn_id, exc)
        return None


def _fields(ti_key: TaskInstanceKey) -> dict[str, Any]:
    value: Any = XCom.get_value(key=LINK_XCOM_KEY, ti_key=ti_key)
    return value if isinstance(value, dict) else {}


class SpotAttemptLink(BaseOperatorLink):
    """"Spot attempt": the store location of the task's latest attempt.

    The fields live under :data:`LINK_XCOM_KEY`; the link's own ``xcom_key`` stays Airflow's default
    (``_link_SpotAttemptLink``): at the end of each try, and at each deferral, the task runner pushes the
    built URL under ``xcom_key``, which, were it the fields' key, would overwrite them with a string (the
    UI then lost every running job, and both links came out empty).
    """

    name = "Spot attempt"
    key = LINK_XCOM_KEY

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        f = _fields(ti_key)
        if "job_uri" in f and "attempt_id" in f:
            region = _connection_region(f.get("aws_conn_id")) if str(f["job_uri"]).startswith("s3://") else None
            return attempt_location(f["job_uri"], f["attempt_id"], region)
        return str(f.get("url", ""))  # written by the first version of this link

    @classmethod
    def persist(cls, context: Context, job_uri: str, attempt_id: str, aws_conn_id: str | None = None) -> None:
        """Store the link's fields; also what the UI plugin finds a running job by."""
        ti = context["ti"]
        ti.xcom_push(
            key=cls.key,
            value={"job_uri": job_uri, "attempt_id": attempt_id, "aws_conn_id": aws_conn_id,
                   "dag_id": ti.dag_id, "run_id": ti.run_id},
        )


class SpotJobLink(BaseOperatorLink):
    """"Spot Training": the job's page in the airflow-spot UI plugin."""

    name = "Spot Training"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return job_page(ti_key.dag_id, ti_key.run_id) if _fields(ti_key) else ""
