"""airflow-spot: run long GPU training jobs on spot instances under Apache Airflow without losing work.

The package is layered (see DESIGN.md): ``training``, ``storage`` and ``policy`` never import Airflow, so
they run on a bare training instance; the Airflow layer (operators, triggers, hooks, ui) sits on top.
"""
from __future__ import annotations

__version__ = "0.1.0"
