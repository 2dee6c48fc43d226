"""Operators of the provider: ``SpotTraining`` (the job), ``SpotSegmentOperator``, ``SpotJobSummaryOperator``.

Imported lazily so that the helpers next to them (validation, planning) load without Airflow.
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {
    "SpotTraining": "airflow_spot.operators.training",
    "SpotJobSummaryOperator": "airflow_spot.operators.training",
    "SpotSegmentOperator": "airflow_spot.operators.segment",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
