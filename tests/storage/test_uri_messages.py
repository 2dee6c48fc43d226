"""A malformed checkpoint URI is reported as what it is (issue 8: "s3:/bad" was said to have no scheme)."""
from __future__ import annotations

import pytest

from airflow_spot.storage.object_store import StoreConfigError, open_store


@pytest.mark.parametrize("uri,fix", [("s3:/bad", "s3://bad"), ("s3:bad/x", "s3://bad/x"), ("file:/tmp/x", "file:///tmp/x")])
def test_scheme_without_slashes_is_named_at_run_time_and_at_parse_time(uri, fix):
    from airflow_spot.operators.validation import SpotTrainingConfigError, validate_checkpoint_uri

    with pytest.raises(StoreConfigError) as at_run:
        open_store(uri)
    with pytest.raises(SpotTrainingConfigError) as at_parse:
        validate_checkpoint_uri(uri)
    for err in (at_run, at_parse):
        message = str(err.value)
        assert "no scheme" not in message
        assert f"has the scheme {uri.split(':')[0]!r} but not the '//'" in message and f"write {fix}" in message


def test_other_uri_messages_are_unchanged():
    with pytest.raises(StoreConfigError, match="needs a bucket"):
        open_store("s3://")
    with pytest.raises(StoreConfigError, match="unsupported checkpoint URI scheme 'gs'"):
        open_store("gs://bucket/x")
    with pytest.raises(StoreConfigError, match="must be absolute"):
        open_store("file://host/x")


def test_store_errors_a_user_can_fix_say_how():
    from botocore.exceptions import ClientError, NoCredentialsError, NoRegionError

    from airflow_spot.storage.object_store import store_error_hint

    assert "AWS_ACCESS_KEY_ID" in store_error_hint(NoCredentialsError())
    assert "AWS_DEFAULT_REGION" in store_error_hint(NoRegionError())
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "denied"}}, "ListObjectsV2")
    assert "s3:ListBucket" in store_error_hint(denied)
    assert "bucket name" in store_error_hint(ClientError({"Error": {"Code": "NoSuchBucket"}}, "ListObjectsV2"))
    assert store_error_hint(OSError("disk")) == ""


def test_a_file_given_as_a_store_is_named(tmp_path):
    from airflow_spot.storage.object_store import StoreConfigError, open_existing_store

    f = tmp_path / "state.pt"
    f.write_bytes(b"x")
    with pytest.raises(StoreConfigError, match="state.pt is a file, not a folder; give a job root"):
        open_existing_store(str(f), what="a job root")


def test_an_error_whose_response_is_not_botocores_gets_no_hint_and_no_new_error():
    """Other libraries' exceptions carry ``response`` too (requests' HTTPError: None or a Response object):
    the hint and the not-found check read a botocore error code only, instead of raising AttributeError
    while reporting the error they were given."""
    from botocore.exceptions import ClientError

    from airflow_spot.storage.object_store import error_code, store_error_hint
    from airflow_spot.storage.s3_store import _is_not_found

    class HttpError(Exception):
        def __init__(self, response):
            super().__init__("http")
            self.response = response

    for response in (None, object(), {"Error": None}, {"Error": "denied"}):
        assert error_code(HttpError(response)) is None
        assert store_error_hint(HttpError(response)) == ""
        assert _is_not_found(HttpError(response)) is False
    assert error_code(ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")) == "NoSuchKey"
    assert _is_not_found(ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject"))


@pytest.mark.parametrize("name", ["run#3", "what?", "100%", "my job", "a%20b", "manual__2026-12-02T02:33:00+00:00"])
def test_a_file_store_names_itself_by_a_uri_that_opens_the_same_folder(tmp_path, name):
    """A job's processes open its store from ``store.uri``: a folder whose name holds a character a URI's
    path cannot hold as it is must come back as the same folder, not one cut at '#' or '?'."""
    from airflow_spot.storage.object_store import store_uri

    store = open_store(str(tmp_path / name))
    assert store.root == tmp_path / name
    assert open_store(store.uri).root == tmp_path / name
    assert store_uri(str(tmp_path / name)) == store.uri
    if name == "manual__2026-12-02T02:33:00+00:00":
        assert store.uri.endswith(name)  # run ids stay readable


def test_a_file_uri_is_percent_decoded_as_rfc_8089_says():
    assert open_store("file:///tmp/my%20job%2523").root.as_posix() == "/tmp/my job%23"


@pytest.mark.parametrize("uri,char,escape,cut", [("file:///data/exp#3", "#", "%23", "/data/exp"),
                                                 ("file:///data/what?x", "?", "%3F", "/data/what")])
def test_a_file_uri_that_a_uri_parser_would_cut_short_is_refused_at_parse_and_run_time(uri, char, escape, cut):
    # before, file:///data/exp#3 wrote to /data/exp: another job's folder, silently
    from airflow_spot.operators.validation import SpotTrainingConfigError, validate_checkpoint_uri

    with pytest.raises(StoreConfigError) as at_run:
        open_store(uri)
    with pytest.raises(SpotTrainingConfigError) as at_parse:
        validate_checkpoint_uri(uri)
    for err in (at_run, at_parse):
        assert f"holds {char!r}" in str(err.value) and f"would go to {cut!r}" in str(err.value)
        assert f"write {char!r} as {escape}" in str(err.value)
    validate_checkpoint_uri("file:///data/{{ run_id }}/{# a comment #}")  # a template's own '#' is not one


def test_an_s3_prefix_is_kept_as_written():
    # the AWS CLI reads s3://bucket/exp#3 as the key prefix exp#3; it used to become exp
    from airflow_spot.storage.object_store import store_uri

    for uri in ("s3://bucket/exp#3", "s3://bucket/q?x=1", "s3://bucket/a%20b"):
        assert store_uri(uri) == uri
