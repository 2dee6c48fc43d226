"""The backend interface: launch, describe, terminate and list instances.

A backend is built from plain JSON kwargs (``get_backend(name, **kwargs)``) so the operator, the trigger
(in another process, after a restart) and ``airflow-spot reap`` all reach the same instances. Calls are
idempotent where the cloud allows: ``launch`` with the same ``idempotency_token`` returns the instance
it launched before instead of a second one (EC2: ClientToken; local: a token file).
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import ClassVar

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
    """No instance could be had. ``capacity`` separates "try another offer" from "fix your config"."""

    def __init__(self, message: str, *, capacity: bool, tried: list[str] | None = None) -> None:
        super().__init__(message)
        self.capacity = capacity
        self.tried = tried or []


class Backend(ABC):
    name: ClassVar[str]

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
}


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def register_backend(name: str, dotted: str) -> None:
    _REGISTRY[name] = dotted


def get_backend(name: str, **kwargs) -> Backend:
    """Build a backend by name; an unknown name fails with the list of valid ones."""
    try:
        dotted = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(backend_names())}") from None
    import importlib

    module, _, cls = dotted.partition(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
