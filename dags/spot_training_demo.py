"""spot_training_demo: a small torch model trained on the local backend through injected preemptions.

Four segments of ``airflow_spot.examples.train_tiny`` (CPU, about a minute); the local backend's injector
preempts the first three instances it launches a few seconds after they start, so the job survives three
preemptions and still ends with the same weights as an uninterrupted run. Checkpoints and instance state
live under ``$AIRFLOW_SPOT_DEMO_DIR`` (default ``$AIRFLOW_HOME/spot-demo``). ``airflow-spot demo`` runs
this same DAG and prints its summary.
"""
from __future__ import annotations

from airflow_spot.demo import build_demo_dag

dag = build_demo_dag()
