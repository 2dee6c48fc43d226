"""The exceptions a segment ends its try with; :mod:`~airflow_spot.operators.retry` tells Airflow which to retry."""
from __future__ import annotations

from airflow.sdk.exceptions import AirflowException


class SegmentPreempted(AirflowException):
    """The attempt was preempted (or its instance lost); Airflow retries the segment on a fresh instance."""


class NoCapacityNow(SegmentPreempted):
    """Every offer of the plan refused for capacity: the segment waits (a timer, not a try) and decides again."""


class SegmentCodeFailure(AirflowException):
    """The user's command failed; Airflow retries it while the user-code budget lasts."""
