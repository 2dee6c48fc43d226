"""Test helpers shipped with the package, for this project's tests and for users' own DAG tests."""
from __future__ import annotations
