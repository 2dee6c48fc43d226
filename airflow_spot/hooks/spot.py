"""``SpotHook``: the one place the Airflow layer gets a job's store, its backend and its market from.

Following the Amazon provider, operators and triggers never build cloud clients themselves: for an
``s3://`` checkpoint URI the hook asks the Amazon provider's :class:`S3Hook` (an Airflow AWS connection:
credentials, region, ``endpoint_url``) for a client and hands it to :class:`S3Store`. Everything the hook
is built from is plain JSON, so a trigger recreated after a triggerer restart gets an equivalent hook.
"""
from __future__ import annotations

from functools import cached_property
from typing import Any
from urllib.parse import urlparse

from airflow.sdk import BaseHook

from airflow_spot.backends.base import Backend, get_backend
from airflow_spot.storage.object_store import ObjectStore, open_store


class SpotHook(BaseHook):
    """Store, backend and market of one spot training job.

    :param backend: backend name (see :func:`airflow_spot.backends.base.backend_names`).
    :param backend_options: plain JSON kwargs of the backend.
    :param market_options: plain JSON kwargs of the market (see :mod:`airflow_spot.market`).
    :param aws_conn_id: Airflow AWS connection for ``s3://`` stores; ``None`` uses boto3's default chain.
    """

    conn_name_attr = "aws_conn_id"
    default_conn_name = "aws_default"
    conn_type = "aws"
    hook_name = "Spot Training"

    def __init__(
        self,
        backend: str = "local",
        backend_options: dict[str, Any] | None = None,
        market_options: dict[str, Any] | None = None,
        aws_conn_id: str | None = "aws_default",
    ) -> None:
        super().__init__()
        self.backend_name = backend
        self.backend_options = dict(backend_options or {})
        self.market_options = dict(market_options or {})
        self.aws_conn_id = aws_conn_id

    # ---------------------------------------------------------------- store
    @cached_property
    def _s3_hook(self):
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.aws_conn_id)

    def get_store(self, uri: str) -> ObjectStore:
        """Open the store at ``uri``; ``s3://`` goes through the Amazon provider's S3 client."""
        if urlparse(uri).scheme == "s3":
            client = self._s3_hook.get_conn()
            return open_store(uri, client=client)
        return open_store(uri)

    def instance_env(self, uri: str) -> dict[str, str]:
        """Environment the instance's agent needs to reach the same store (the endpoint, never secrets)."""
        if urlparse(uri).scheme != "s3":
            return {}
        endpoint = self._s3_hook.conn_config.get_service_endpoint_url("s3")
        return {"AWS_ENDPOINT_URL_S3": endpoint} if endpoint else {}

    # ---------------------------------------------------------------- backend and market
    @cached_property
    def backend(self) -> Backend:
        return get_backend(self.backend_name, **self.backend_options)

    def get_backend(self) -> Backend:
        return self.backend

    @cached_property
    def market(self):
        """The offer source for this backend (bundled catalog for ``local``; see ``airflow_spot.market``)."""
        from airflow_spot.market import get_market

        return get_market(self.backend_name, **self.market_options)

    def get_market(self):
        return self.market
