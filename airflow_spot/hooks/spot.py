"""``SpotHook``: the one place the Airflow layer gets a job's store, its backend and its market from.

Following the Amazon provider, operators and triggers never build cloud clients themselves: for an
``s3://`` checkpoint URI the hook asks the Amazon provider's :class:`S3Hook` (an Airflow AWS connection:
credentials, region, ``endpoint_url``) for a client and hands it to :class:`S3Store`; the ``ec2`` backend and
market get the Amazon provider's ``EC2Hook`` clients, one per region, sync for the worker and async
(``get_async_conn``) for the trigger, with botocore's adaptive retry mode (:attr:`SpotHook.clients`).
Everything the hook is built from is plain JSON, so a trigger recreated after a triggerer restart gets an
equivalent hook.
"""
from __future__ import annotations

import asyncio
import os
from functools import cached_property
from typing import Any
from urllib.parse import urlparse

from airflow.sdk import BaseHook

from airflow_spot.backends.base import Backend, Clients, get_backend
from airflow_spot.storage.object_store import ObjectStore, open_store


class SpotHook(BaseHook):
    """Store, backend and market of one spot training job.

    :param backend: backend name (see :func:`airflow_spot.backends.base.backend_names`).
    :param backend_options: plain JSON kwargs of the backend.
    :param market_options: plain JSON kwargs of the market (see :mod:`airflow_spot.market`).
    :param aws_conn_id: Airflow AWS connection for ``s3://`` stores and the ``ec2`` backend and market;
        ``None`` uses boto3's default chain.
    :param botocore_config: extra botocore ``Config`` kwargs for the EC2 clients; retries default to
        botocore's ``adaptive`` mode (client-side rate limiting when EC2 throttles).
    """

    #: connections of the hook's S3 client: a store's GETs go 8 at once beside a multipart transfer, and the
    #: UI's list reads 4 jobs' stores at once through one hook (botocore's default is 10; idle ones cost nothing)
    S3_POOL_CONNECTIONS = 32

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
        botocore_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.botocore_config = {"retries": {"mode": "adaptive", "max_attempts": 10}, **(botocore_config or {})}
        self.backend_name = backend
        self.backend_options = dict(backend_options or {})
        self.market_options = dict(market_options or {})
        self.aws_conn_id = aws_conn_id

    # ---------------------------------------------------------------- store
    @cached_property
    def _s3_hook(self):
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        self._check_connection()  # S3Hook itself would fall back to the machine's credentials
        return S3Hook(aws_conn_id=self.aws_conn_id)

    @cached_property
    def _s3_client(self):
        """The S3Hook's client with room for at least :attr:`S3_POOL_CONNECTIONS`, over the connection's own
        botocore config (its ``config_kwargs``: retries, proxies, a larger pool ... are kept)."""
        from botocore.config import Config

        hook = self._s3_hook
        pool = max(self.S3_POOL_CONNECTIONS, hook.config.max_pool_connections or 0)
        return hook.get_client_type(config=hook.config.merge(Config(max_pool_connections=pool)))

    def get_store(self, uri: str) -> ObjectStore:
        """Open the store at ``uri``; ``s3://`` goes through the Amazon provider's S3 client."""
        if urlparse(uri).scheme == "s3":
            return open_store(uri, client=self._s3_client)
        return open_store(uri)

    def instance_env(self, uri: str) -> dict[str, str]:
        """Environment the instance's agent needs to reach the same store (the endpoint, never secrets) and
        to write checkpoints the deployment can read (the workers' digest setting, ``block`` when unset: a warm
        instance launched while it was set must learn that it no longer is)."""
        from airflow_spot.storage.checkpoint import DIGEST_ENV, digest_setting

        env = {DIGEST_ENV: digest_setting(os.environ.get(DIGEST_ENV))}
        if urlparse(uri).scheme != "s3":
            return env
        endpoint = self._s3_hook.conn_config.get_service_endpoint_url("s3")
        return {**env, "AWS_ENDPOINT_URL_S3": endpoint} if endpoint else env

    # ---------------------------------------------------------------- backend and market
    def ec2_hook(self, region: str):
        """The Amazon provider's ``EC2Hook`` for ``region`` on this hook's connection (one per region)."""
        hooks = self.__dict__.setdefault("_ec2_hooks", {})
        if region not in hooks:
            from airflow.providers.amazon.aws.hooks.ec2 import EC2Hook

            self._check_connection()

            hooks[region] = EC2Hook(api_type="client_type", aws_conn_id=self.aws_conn_id, region_name=region,
                                    config=self.botocore_config)
        return hooks[region]

    def _check_connection(self) -> None:
        """A named AWS connection must exist: say which one and how to create it, rather than let boto3
        fall back to whatever credentials this machine happens to have."""
        if self.aws_conn_id is None or self.__dict__.get("_connection_checked"):
            return
        from airflow.exceptions import AirflowNotFoundException
        from airflow.sdk.exceptions import AirflowNotFoundException as SdkNotFound

        try:
            self.get_connection(self.aws_conn_id)
        except (AirflowNotFoundException, SdkNotFound):
            raise ValueError(
                f"the AWS connection {self.aws_conn_id!r} is not defined; create it (airflow connections add "
                f"{self.aws_conn_id} --conn-type aws ..., or AIRFLOW_CONN_{self.aws_conn_id.upper()}) or pass "
                "aws_conn_id=None to use boto3's default credential chain"
            ) from None
        self.__dict__["_connection_checked"] = True

    @cached_property
    def clients(self) -> Clients:
        """Cloud clients for backends and markets: the sync client and the async one (for triggers)."""
        async def ec2_async(region: str):
            # ec2_hook() reads the connection synchronously: never on the triggerer's event loop (there a sync
            # connection read works only inside a trigger's own task; the shared poller's task has none)
            hook = await asyncio.to_thread(self.ec2_hook, region)
            return await hook.get_async_conn()

        return Clients(
            ec2=lambda region: self.ec2_hook(region).conn,
            ec2_async=ec2_async,
            describe=f"conn:{self.aws_conn_id}",
        )

    @cached_property
    def backend(self) -> Backend:
        return get_backend(self.backend_name, clients=self.clients, **self.backend_options)

    def get_backend(self) -> Backend:
        return self.backend

    @cached_property
    def market(self):
        """The offer source for this backend (bundled catalog for ``local``; see ``airflow_spot.market``)."""
        from airflow_spot.market import get_market

        return get_market(self.backend_name, clients=self.clients, **market_options_for(
            self.backend_name, self.backend_options, self.market_options))

    def get_market(self):
        return self.market


def market_options_for(backend: str, backend_options: dict[str, Any], market_options: dict[str, Any]) -> dict[str, Any]:
    """The market's options: the ``ec2`` market offers from the ``ec2`` backend's regions unless
    ``market_options`` names its own (an offer from a region the backend cannot launch into fails its
    segment; ``operators.gpu_checks.validate_market_regions`` refuses one named so at parse time)."""
    if backend == "ec2" and market_options.get("kind") in (None, "ec2") and "regions" not in market_options \
            and backend_options.get("regions"):
        return {**market_options, "regions": backend_options["regions"]}
    return dict(market_options)
