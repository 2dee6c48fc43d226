"""Runs ON the training instance: the session API for torch scripts, notice sources and the agent.

Never imports Airflow. Imported lazily so the Airflow side can read ``training.env`` without torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_spot.training.data import ResumableLoader
    from airflow_spot.training.sampler import ResumableSampler
    from airflow_spot.training.session import SpotSession

__all__ = ["ResumableLoader", "ResumableSampler", "SpotSession"]


def __getattr__(name: str) -> Any:
    if name == "SpotSession":
        from airflow_spot.training.session import SpotSession

        return SpotSession
    if name == "ResumableSampler":
        from airflow_spot.training.sampler import ResumableSampler

        return ResumableSampler
    if name == "ResumableLoader":
        from airflow_spot.training.data import ResumableLoader

        return ResumableLoader
    raise AttributeError(name)
