"""spot_training_demo: a small torch model trained on the local backend through injected preemptions.

Three segments of ``airflow_spot.examples.train_tiny`` (CPU, about a minute); the local backend's injector
preempts the first five instances it launches four seconds after they start (an instance that finishes
its segment between notice and kill escapes; at most one per segment boundary), so the job survives at
least three preemptions and still ends with the same weights as an uninterrupted run. Checkpoints and instance state
live under ``$AIRFLOW_SPOT_DEMO_DIR`` (default ``$AIRFLOW_HOME/spot-demo``). ``airflow-spot demo`` runs
this same DAG and prints its summary.
"""
from __future__ import annotations

from airflow_spot.demo import build_demo_dag

dag = build_demo_dag()
