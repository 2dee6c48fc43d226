"""The instance side (training, storage, policy) must import and work where Airflow is not installed."""
from __future__ import annotations

import subprocess
import sys

BLOCK_AIRFLOW = """
import importlib.abc, sys
class NoAirflow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "airflow" or name.startswith("airflow."):
            raise ImportError("airflow is not installed here")
sys.meta_path.insert(0, NoAirflow())
"""


def test_instance_side_imports_without_airflow():
    code = BLOCK_AIRFLOW + """
import pkgutil, importlib, airflow_spot
for pkg in ("training", "storage", "policy", "examples"):
    mod = importlib.import_module(f"airflow_spot.{pkg}")
    for info in pkgutil.walk_packages(mod.__path__, mod.__name__ + "."):
        importlib.import_module(info.name)
from airflow_spot.training import SpotSession, ResumableSampler
assert not any(m == "airflow" or m.startswith("airflow.") for m in sys.modules), "airflow got imported"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_policy_imports_nothing_else_of_the_project():
    code = """
import importlib, pkgutil, sys, airflow_spot.policy as p
for info in pkgutil.walk_packages(p.__path__, "airflow_spot.policy."):
    importlib.import_module(info.name)
others = sorted(m for m in sys.modules if m.startswith("airflow_spot.") and not m.startswith("airflow_spot.policy"))
assert not others, others
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
