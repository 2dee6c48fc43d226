"""The "Spot attempt" extra link points at the attempt's objects in the store."""
from __future__ import annotations

from airflow_fixtures import airflow_db  # noqa: F401
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
    # the fields' key is not the link's xcom_key: the task runner writes the built URL under the latter
    assert SpotAttemptLink.key == "spot_attempt" and SpotAttemptLink().xcom_key != SpotAttemptLink.key


def test_s3_link_carries_the_connections_region_when_known():
    url = attempt_location("s3://ckpt/job", "seg.try1", region="eu-west-1")
    assert url.startswith("https://s3.console.aws.amazon.com/s3/buckets/ckpt?region=eu-west-1&prefix=job%2F")


def test_job_link_points_at_the_plugin_page():
    from airflow_spot.links.attempt import SpotJobLink, job_page

    assert job_page("my dag", "manual__2026-01-01T00:00:00+00:00") == (
        "/spot/jobs/my%20dag/manual__2026-01-01T00%3A00%3A00%2B00%3A00"
    )
    assert any(isinstance(link, SpotJobLink) for link in SpotSegmentOperator.operator_extra_links)


def test_after_a_run_the_fields_are_still_a_dict_and_both_links_resolve(airflow_db, tmp_path):  # noqa: F811
    """Under Airflow's own task runner (dag.test, as the scheduler's): the runner pushes each link's URL
    under its xcom_key when the try ends or defers; the fields the UI finds a running job by must survive."""
    from airflow_fixtures import FAST_SEGMENT_OPTIONS, backend_options, build_dag, protocol_command, run_dag, xcom_value

    from airflow_spot.links.attempt import LINK_XCOM_KEY, SpotJobLink

    dag = build_dag("link_fields", tmp_path, command=protocol_command("--step-seconds", "0.01"), total_steps=10,
                    steps_per_segment=10, backend_options=backend_options(tmp_path), max_preemptions=0, retries=0,
                    segment_options=FAST_SEGMENT_OPTIONS)
    dr = run_dag(dag)
    fields = xcom_value(dr, "train.segment_000", LINK_XCOM_KEY)
    assert isinstance(fields, dict) and fields["attempt_id"] == "train.segment_000.try1", fields
    attempt_url = xcom_value(dr, "train.segment_000", SpotAttemptLink().xcom_key)
    assert attempt_url == fields["job_uri"].rstrip("/") + "/control/attempts/train.segment_000.try1/"
    assert xcom_value(dr, "train.segment_000", SpotJobLink().xcom_key).startswith("/spot/jobs/link_fields/")
