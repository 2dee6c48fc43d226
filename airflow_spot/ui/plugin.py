"""The Spot Training Airflow plugin: the FastAPI app under ``/spot`` and its places in the Airflow UI.

Registered through the ``airflow.plugins`` entry point of the installed package (setup.cfg), so nothing
needs copying into a deployment's plugins folder (``plugins/spot_training.py`` is the same plugin for
those who install by copying). The views are ``external_views``: Airflow shows them in an iframe, and the
iframe's requests carry the UI's ``_token`` cookie, which the app's authentication accepts.
"""
from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from airflow_spot.ui.app import app

URL_PREFIX = "/spot"


class SpotTrainingPlugin(AirflowPlugin):
    name = "spot_training"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "Spot Training"}]
    external_views = [
        {"name": "Spot Training", "href": f"{URL_PREFIX}/", "destination": "nav", "nav_top_level": True,
         "url_route": "spot-training"},
        {"name": "Spot Training", "href": f"{URL_PREFIX}/jobs/{{DAG_ID}}/{{RUN_ID}}", "destination": "dag_run",
         "url_route": "spot-training-run"},
        {"name": "Spot Training", "href": f"{URL_PREFIX}/jobs/{{DAG_ID}}/{{RUN_ID}}", "destination": "task_instance",
         "url_route": "spot-training-ti"},
    ]
