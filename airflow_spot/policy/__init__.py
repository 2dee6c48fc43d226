"""Pure decisions shared by the operators and the simulator.

Nothing here does I/O, reads a clock or imports Airflow: time and observations are passed in, so the
simulator and the tests can drive every policy without sleeping.
"""
from __future__ import annotations
