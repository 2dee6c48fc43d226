"""An S3 endpoint on 127.0.0.1 served by moto's threaded server (a real HTTP endpoint, not a mock)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def fake_aws_env() -> Iterator[None]:
    """Fake credentials so boto3 never looks for real ones; restored on exit."""
    saved = {k: os.environ.get(k) for k in FAKE_CREDENTIALS}
    os.environ.update(FAKE_CREDENTIALS)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Start ``ThreadedMotoServer`` on a free loopback port; yields its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with fake_aws_env():
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


def create_bucket(endpoint_url: str, bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1").create_bucket(Bucket=bucket)


@contextlib.contextmanager
def moto_server_process() -> Iterator[str]:
    """``ThreadedMotoServer`` in a child process: keeps the caller thread-free (safe to fork) and off
    the caller's GIL (fair throughput measurements). Yields the endpoint URL."""
    import subprocess
    import sys

    code = (
        "import logging,sys;from moto.server import ThreadedMotoServer;"
        "logging.getLogger('werkzeug').setLevel(logging.ERROR);"
        "s=ThreadedMotoServer(ip_address='127.0.0.1',port=0);s.start();"
        "print('ENDPOINT %s:%s'%s.get_host_and_port(),flush=True);sys.stdin.read()"
    )
    with fake_aws_env():
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ)
        )
        try:
            line = ""
            for _ in range(20):  # moto prints a banner first
                line = proc.stdout.readline().decode().strip()
                if line.startswith("ENDPOINT ") or not line:
                    break
            if not line.startswith("ENDPOINT "):
                raise RuntimeError(f"moto server did not start: {line!r}")
            yield "http://" + line.split()[1]
        finally:
            proc.stdin.close()
            proc.terminate()
            proc.wait(timeout=10)
