"""Extra link from a segment task to where its attempt lives in the store (status, heartbeat, launch).

``file://`` stores link to the attempt's folder; ``s3://`` stores to the S3 console page of its prefix.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlparse

from airflow.sdk import BaseOperatorLink
from airflow.sdk.execution_time.xcom import XCom

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator, Context
    from airflow.sdk.types import TaskInstanceKey


def attempt_location(store_uri: str, attempt_id: str) -> str:
    """A URL for the attempt's objects under ``control/attempts/<attempt_id>/``."""
    base = store_uri.rstrip("/") + f"/control/attempts/{attempt_id}/"
    parsed = urlparse(base)
    if parsed.scheme == "s3":
        return (
            "https://s3.console.aws.amazon.com/s3/buckets/"
            f"{parsed.netloc}?prefix={quote(parsed.path.lstrip('/'), safe='')}"
        )
    return base


class SpotAttemptLink(BaseOperatorLink):
    """"Spot attempt": the store location of the task's latest attempt."""

    name = "Spot attempt"
    key = "spot_attempt"

    @property
    def xcom_key(self) -> str:
        return self.key

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        value: Any = XCom.get_value(key=self.key, ti_key=ti_key)
        return value.get("url", "") if isinstance(value, dict) else ""

    @classmethod
    def persist(cls, context: Context, store_uri: str, attempt_id: str) -> None:
        context["ti"].xcom_push(
            key=cls.key, value={"url": attempt_location(store_uri, attempt_id), "attempt_id": attempt_id}
        )
