"""The Spot Training UI plugin, for deployments that install plugins by copying files into ``plugins/``.

An installed ``airflow-spot`` registers the same plugin through its ``airflow.plugins`` entry point;
Airflow loads a plugin name once, so having both does not mount the app twice.
"""
from __future__ import annotations

from airflow_spot.ui.plugin import SpotTrainingPlugin

__all__ = ["SpotTrainingPlugin"]
