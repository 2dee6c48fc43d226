"""Provider metadata for Airflow's ``apache_airflow_provider`` entry point."""
from __future__ import annotations


def get_provider_info() -> dict:
    from airflow_spot import __version__

    return {
        "package-name": "airflow-spot",
        "name": "Spot Training",
        "description": "Run long GPU training jobs on spot instances in checkpoint-bounded, deferrable segments.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Spot Training",
                "external-doc-url": "https://github.com/airflow-spot/airflow-spot",
                "tags": ["service"],
            }
        ],
        "operators": [
            {
                "integration-name": "Spot Training",
                "python-modules": ["airflow_spot.operators.segment", "airflow_spot.operators.training"],
            }
        ],
        "triggers": [
            {"integration-name": "Spot Training", "python-modules": ["airflow_spot.triggers.segment"]}
        ],
        "hooks": [{"integration-name": "Spot Training", "python-modules": ["airflow_spot.hooks.spot"]}],
        "extra-links": ["airflow_spot.links.attempt.SpotAttemptLink", "airflow_spot.links.attempt.SpotJobLink"],
    }
