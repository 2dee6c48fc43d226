"""The "Spot attempt" extra link points at the attempt's objects in the store."""
from __future__ import annotations

from airflow_spot.links.attempt import SpotAttemptLink, attempt_location
from airflow_spot.operators.segment import SpotSegmentOperator


def test_file_store_links_to_the_attempt_folder():
    assert attempt_location("file:///data/jobs/run1", "train.segment_000.try2") == (
        "file:///data/jobs/run1/control/attempts/train.segment_000.try2/"
    )


def test_s3_store_links_to_the_console_prefix():
    url = attempt_location("s3://ckpt/dag/run 1", "seg.try1")
    assert url == (
        "https://s3.console.aws.amazon.com/s3/buckets/ckpt?prefix=dag%2Frun%201%2Fcontrol%2Fattempts%2Fseg.try1%2F"
    )


def test_segment_operator_declares_the_link():
    assert any(isinstance(link, SpotAttemptLink) for link in SpotSegmentOperator.operator_extra_links)
    assert SpotAttemptLink().xcom_key == "spot_attempt"
