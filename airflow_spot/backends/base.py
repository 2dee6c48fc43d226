"""The backend interface: launch, describe, terminate and list instances.

A backend is built from plain JSON kwargs plus the cloud clients the Airflow layer hands down
(``get_backend(name, clients=..., **kwargs)``), so the operator, the trigger (in another process, after a
restart) and ``airflow-spot reap`` all reach the same instances, and nothing here reads an Airflow
connection. Calls are idempotent where the cloud allows: ``launch`` with the same ``idempotency_token``
returns the instance it launched before instead of a second one (EC2: ClientToken; local: a token file);
:func:`launch_token` builds one that fits EC2's 64-character limit.

Every backend starts the same agent the same way (:mod:`airflow_spot.backends.bootstrap`); each declares
where its instances get preemption notices (``notice_source``) and how a command can be checked before
launch (``command_problem``), so the operators never branch on a backend's name.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, ClassVar

from airflow_spot.policy.offers import Offer


class InstanceState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    TERMINATED = "terminated"

    def is_terminal(self) -> bool:
        return self is InstanceState.TERMINATED


class TerminationReason(str, Enum):
    NONE = ""
    PREEMPTED = "preempted"  # the market took it back (EC2: Server.SpotInstanceTermination)
    USER = "user"  # we terminated it (task end, on_kill, reap)
    IDLE = "idle"  # the agent shut itself down after its idle timeout
    FAILED = "failed"  # launch or agent failure


@dataclass
class LaunchSpec:
    """Everything a backend needs to start one instance running the agent for one job."""

    offer: Offer
    job_uri: str
    idempotency_token: str
    tags: dict[str, str] = field(default_factory=dict)
    idle_timeout_seconds: float = 300.0
    #: extra environment for the agent (e.g. the store endpoint); never secrets in tags
    env: dict[str, str] = field(default_factory=dict)
    # What a cloud launch needs; ``None``/empty takes the backend's configured default.
    #: machine image (EC2: an AMI id); a launch template may give it instead
    image_id: str | None = None
    #: EC2 launch template: ``{"LaunchTemplateId"|"LaunchTemplateName": ..., "Version": ...}``
    launch_template: dict[str, str] | None = None
    #: subnets to launch into; the one in the offer's zone is used when known
    subnet_ids: tuple[str, ...] = ()
    security_group_ids: tuple[str, ...] = ()
    #: instance profile name or ARN: how the instance gets its store access (never keys in user data)
    instance_profile: str | None = None
    #: root volume size in GiB (``None``: the image's default)
    block_device_gib: int | None = None
    #: replaces the generated bootstrap script entirely (advanced; it must start the agent itself)
    user_data: str | None = None
    #: spot: the most $/h the instance may ever pay (the request's ``max_price_per_hour``). The cloud
    #: interrupts it, with its usual notice, when the pool's price rises above; None: up to on-demand
    max_price_per_hour: float | None = None


def launch_token(*parts: object) -> str:
    """An idempotency token for one launch: the sha256 of the parts, 64 hex characters (EC2's ClientToken
    allows 64 ASCII characters; dag/run/task ids together can be far longer)."""
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()


@dataclass
class Clients:
    """Cloud clients handed down by the Airflow layer (``SpotHook``), one per region on demand.

    :param ec2: ``region -> boto3 EC2 client`` (the Amazon provider's ``EC2Hook(...).conn``).
    :param ec2_async: ``region -> awaitable of an aiobotocore client context`` (``EC2Hook.get_async_conn``);
        ``None``: async describes run the sync client in a thread.
    :param describe: where the clients point (connection id, endpoint); backends that share it share a poller.
    """

    ec2: Callable[[str], Any] | None = None
    ec2_async: Callable[[str], Any] | None = None
    describe: str = ""


@dataclass
class InstanceInfo:
    instance_id: str
    state: InstanceState
    offer: Offer
    job_uri: str
    tags: dict[str, str] = field(default_factory=dict)
    launched_at: float | None = None
    terminated_at: float | None = None
    reason: TerminationReason = TerminationReason.NONE
    #: a preemption notice has been issued for this instance (and at what time)
    notice_at: float | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["state"] = InstanceState(self.state).value
        d["reason"] = TerminationReason(self.reason).value
        d["offer"] = self.offer.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "InstanceInfo":
        d = dict(d)
        d["state"] = InstanceState(d["state"])
        d["reason"] = TerminationReason(d.get("reason", ""))
        d["offer"] = Offer.from_dict(d["offer"])
        return cls(**d)


class LaunchError(RuntimeError):
    """No instance could be had. ``capacity`` separates "try another offer" from "fix your config";
    ``transient`` (with ``capacity=False``): try again soon; nothing to fix (throttling, a 5xx from the cloud,
    no answer on the network, after the client's own retries). It is not a capacity refusal of the pool.
    ``unusable`` (with ``capacity=False``): this account or configuration cannot launch this offer (a quota
    used up, no configured subnet in its zone) while another offer may be launched; the message says what to
    fix, and nothing is learnt of the pool's capacity."""

    def __init__(self, message: str, *, capacity: bool, transient: bool = False, unusable: bool = False,
                 tried: list[str] | None = None) -> None:
        super().__init__(message)
        self.capacity = capacity
        self.transient = transient
        self.unusable = unusable
        self.tried = tried or []


#: the job's store (``ObjectStore.uri``), on every instance a backend launches: the job's dag, run and job tags
#: repeat across deployments that run one DAG file (a scheduled run's id is its date), its store does not
TAG_JOB_URI = "airflow-spot:job-uri"
#: the deployment that launched an instance: ``reap`` ends only its own deployment's instances, as several
#: deployments (teams, staging and production) may share one cloud account and run the same DAG files
TAG_DEPLOYMENT = "airflow-spot:deployment"
DEPLOYMENT_ENV = "AIRFLOW_SPOT_DEPLOYMENT"
_DEPLOYMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/=+@-]{0,127}$")


def deployment_id(value: str | None = None) -> str:
    """This deployment's id (``AIRFLOW_SPOT_DEPLOYMENT``, ``default`` when unset), as its instances carry it."""
    value = os.environ.get(DEPLOYMENT_ENV) if value is None else value
    value = (value or "").strip() or "default"
    if not _DEPLOYMENT_RE.match(value):
        raise ValueError(f"{DEPLOYMENT_ENV}={value!r} is not a deployment id: use up to 128 letters, digits and "
                         "._:/=+@- (e.g. ml-prod), the same in every Airflow component of the deployment")
    return value


class Backend(ABC):
    name: ClassVar[str]
    #: where the training process on an instance gets preemption notices: ``file`` (a file the backend
    #: creates), ``imds`` (the EC2 instance metadata service)
    notice_source: ClassVar[str] = "file"
    #: seconds from a preemption notice to the kill (the session judges its emergency save by it); None: unknown
    notice_window_seconds: float | None = None
    #: ``reap`` leaves alone instances whose DAG run is still going (cloud instances cost money but a live
    #: run needs them); local instances are all reaped unless asked otherwise
    reaps_by_run_state: ClassVar[bool] = False

    @classmethod
    def command_problem(cls, command: list[str]) -> str | None:
        """What is wrong with ``command`` as far as this backend can tell before launching, or ``None``.
        Remote backends cannot see the instance's image, so they check nothing by default."""
        return None

    def search_scope(self) -> str | None:
        """Where ``list_instances`` looks, when that is not everywhere (a cloud backend's regions): said
        with an empty answer, so "nothing" is not read as "nothing anywhere"."""
        return None

    @classmethod
    def options_problem(cls, options: dict) -> str | None:
        """What is wrong with the values of ``backend_options`` as far as this backend can tell without
        building it (at DAG parse time), or ``None``. The names are checked against ``__init__`` elsewhere."""
        return None

    @abstractmethod
    def launch(self, spec: LaunchSpec) -> InstanceInfo: ...

    @abstractmethod
    def describe(self, instance_ids: list[str]) -> dict[str, InstanceInfo]:
        """One batched call; unknown ids are absent from the result."""

    @abstractmethod
    def terminate(self, instance_ids: list[str]) -> None: ...

    @abstractmethod
    def list_instances(self, tags: dict[str, str] | None = None) -> list[InstanceInfo]:
        """Instances carrying all the given tags (for reuse and ``reap``)."""

    def serialize(self) -> dict:
        """Plain JSON kwargs that rebuild an equivalent backend with ``get_backend(name, **kwargs)``."""
        return {}

    async def adescribe(self, instance_ids: list[str]) -> dict[str, InstanceInfo]:
        """Async describe for triggers; backends with native async clients override it."""
        return await asyncio.to_thread(self.describe, instance_ids)


_REGISTRY: dict[str, str] = {
    "local": "airflow_spot.backends.local:LocalBackend",
    "ec2": "airflow_spot.backends.ec2:Ec2Backend",
}


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def register_backend(name: str, dotted: str) -> None:
    _REGISTRY[name] = dotted


def backend_class(name: str) -> type[Backend]:
    """The class registered under ``name``; an unknown name fails with the list of valid ones."""
    try:
        dotted = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(backend_names())}") from None
    import importlib

    module, _, cls = dotted.partition(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str, clients: Clients | None = None, **kwargs) -> Backend:
    """Build a backend by name from its JSON kwargs and, for cloud backends, the clients to use.

    :param clients: cloud clients from the Airflow layer; backends that need none ignore them.
    """
    cls = backend_class(name)
    if getattr(cls, "uses_clients", False):
        return cls(clients=clients, **kwargs)
    return cls(**kwargs)
