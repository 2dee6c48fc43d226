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


def test_s3_link_carries_the_connections_region_when_known():
    url = attempt_location("s3://ckpt/job", "seg.try1", region="eu-west-1")
    assert url.startswith("https://s3.console.aws.amazon.com/s3/buckets/ckpt?region=eu-west-1&prefix=job%2F")


def test_job_link_points_at_the_plugin_page():
    from airflow_spot.links.attempt import SpotJobLink, job_page

    assert job_page("my dag", "manual__2026-01-01T00:00:00+00:00") == (
        "/spot/jobs/my%20dag/manual__2026-01-01T00%3A00%3A00%2B00%3A00"
    )
    assert any(isinstance(link, SpotJobLink) for link in SpotSegmentOperator.operator_extra_links)
