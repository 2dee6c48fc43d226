"""Checkpoint store and protocol objects. Runs on the instance and in Airflow; never imports Airflow."""
from __future__ import annotations

from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore, open_store

__all__ = ["ObjectNotFound", "ObjectStore", "open_store"]
