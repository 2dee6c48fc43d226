"""Example training scripts that use airflow_spot.training."""
