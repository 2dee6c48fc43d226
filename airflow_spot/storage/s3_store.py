"""The ``s3://`` backend of :class:`~airflow_spot.storage.object_store.ObjectStore`: a bucket and prefix
through boto3 (S3, MinIO or moto's server).

Kept apart from the interface and from ``file://`` because its guarantees come from S3 (an object appears
when its PUT or multipart upload completes) and its writes and reads stream through boto3's transfer manager
with the small pipe and sink helpers below. boto3 is imported when an ``S3Store`` is made, not when this
module is: an instance with ``file://`` stores only never loads it. Open it through
:func:`~airflow_spot.storage.object_store.open_store`; ``S3Store`` is importable from
:mod:`airflow_spot.storage.object_store` too.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore, _feeder, error_code


class S3Store(ObjectStore):
    """``s3://bucket/prefix`` through boto3; large files go through boto3's transfer manager.

    The endpoint comes from ``endpoint_url`` or the standard ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL`` variables, so the same code talks to S3, MinIO or moto's server.
    """

    #: multipart size and concurrency measured in benchmarks/bench_store_throughput.py
    MULTIPART_CHUNK = 64 * 1024 * 1024
    MAX_CONCURRENCY = 8
    #: GETs in flight at once in :meth:`get_many`
    GET_CONCURRENCY = 8

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        client=None,
        multipart_chunk: int | None = None,
        max_concurrency: int | None = None,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        # room for get_many's GETs and a transfer's parts at once (botocore keeps 10 connections by default)
        pool = Config(max_pool_connections=self.GET_CONCURRENCY + (max_concurrency or self.MAX_CONCURRENCY) + 2)
        self.client = client or boto3.client("s3", endpoint_url=endpoint_url, config=pool)
        chunk = multipart_chunk or self.MULTIPART_CHUNK
        self._options = {"multipart_chunk": multipart_chunk, "max_concurrency": max_concurrency}
        self.transfer_config = TransferConfig(
            multipart_threshold=chunk,
            multipart_chunksize=chunk,
            max_concurrency=max_concurrency or self.MAX_CONCURRENCY,
            use_threads=True,
        )

    def _child_options(self) -> dict:
        return {"endpoint_url": self.endpoint_url, "client": self.client, **self._options}

    def region(self) -> str:
        """The bucket's region (``GetBucketLocation``): S3 answers no constraint for us-east-1 and the legacy
        ``EU`` for the oldest eu-west-1 buckets."""
        location = self.client.get_bucket_location(Bucket=self.bucket).get("LocationConstraint")
        return {None: "us-east-1", "": "us-east-1", "EU": "eu-west-1"}.get(location, location)

    def _key(self, key: str) -> str:
        key = key.strip("/")
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise ObjectNotFound(key) from None


    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        # one request each, several at once: a job's ledger, heartbeats and log are many small objects read
        # at every segment start, where one after another paid each request's latency in turn
        if len(keys) < 2:
            return super().get_many(keys)
        return {k: raw for k, (raw, _etag) in self.get_many_versioned(keys).items()}

    def get_many_versioned(self, keys: list[str]) -> dict[str, tuple[bytes, str | None]]:
        def one(key: str) -> tuple[str, tuple[bytes, str | None] | None]:
            try:
                got = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            except self.client.exceptions.NoSuchKey:
                return key, None
            return key, (got["Body"].read(), got.get("ETag"))  # the ETag of the bytes read

        if not keys:
            return {}
        with ThreadPoolExecutor(min(self.GET_CONCURRENCY, len(keys)), thread_name_prefix="s3-get") as ex:
            return {k: v for k, v in ex.map(one, keys) if v is not None}

    def size(self, key: str) -> int:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except Exception as exc:
            if _is_not_found(exc):
                raise ObjectNotFound(key) from None
            raise

    def list(self, prefix: str = "", *, include_temporary: bool = False, start_after: str | None = None) -> list[str]:
        # An interrupted S3 upload is never an object; its parts are an incomplete multipart upload,
        # which a bucket lifecycle rule (AbortIncompleteMultipartUpload) cleans up.
        return sorted(self.list_versions(prefix, start_after=start_after))

    def list_versions(self, prefix: str = "", *, start_after: str | None = None) -> dict[str, str | None]:
        full = self._key(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if prefix.endswith("/") and not full.endswith("/"):
            full += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: dict[str, str | None] = {}
        extra = {"StartAfter": self._key(start_after)} if start_after else {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full, **extra):
            out.update((obj["Key"][strip:], obj.get("ETag")) for obj in page.get("Contents", ()))
        return dict(sorted(out.items()))

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            if batch:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[str]:
        # Spool locally, then one managed upload: S3 publishes an object only when the PUT or the
        # multipart upload completes, and the transfer manager aborts a failed multipart upload.
        fd, tmp = tempfile.mkstemp(prefix="airflow-spot-up-")
        os.close(fd)
        try:
            yield tmp
            self.client.upload_file(tmp, self.bucket, self._key(key), Config=self.transfer_config)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        # Stream through a pipe into a managed upload running in a thread: serialising, hashing and
        # uploading overlap, and memory stays at a few parts instead of a whole spooled copy.
        r, w = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # a 1 MiB pipe: 16x fewer context switches
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1024 * 1024)
        reader = _AbortableReader(os.fdopen(r, "rb"))
        writer = os.fdopen(w, "wb", buffering=1024 * 1024)
        errors: list[BaseException] = []

        def upload() -> None:
            try:
                self.client.upload_fileobj(reader, self.bucket, self._key(key), Config=self.transfer_config)
            except BaseException as exc:  # handed to the producer below
                errors.append(exc)
            finally:
                reader.drain_and_close()  # never leave the producer blocked on a full pipe

        thread = threading.Thread(target=upload, name="spot-s3-upload", daemon=True)
        thread.start()
        try:
            yield _GuardedWriter(writer, errors)
        except BaseException:
            reader.aborted = True  # EOF now fails the upload instead of publishing a truncated object
            raise
        finally:
            try:
                writer.close()
            except OSError:
                pass  # the uploader is gone; its error is raised below
            thread.join()
        if errors:
            raise errors[0]

    @contextlib.contextmanager
    def reading(self, key: str, hasher=None) -> Iterator[str]:
        fd, tmp = tempfile.mkstemp(prefix="airflow-spot-down-")
        os.close(fd)
        try:
            try:
                if hasher is None:
                    self.client.download_file(self.bucket, self._key(key), tmp, Config=self.transfer_config)
                else:  # hash while the bytes arrive instead of reading the file a second time
                    with open(tmp, "wb") as f:
                        self.client.download_fileobj(
                            self.bucket, self._key(key), _HashingSink(f, hasher), Config=self.transfer_config
                        )
            except Exception as exc:
                if _is_not_found(exc):
                    raise ObjectNotFound(key) from None
                raise
            yield tmp
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


class _AbortableReader:
    """Pipe reader for the uploader: at EOF after an abort it raises, so nothing half-written is published."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.aborted = False

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        if not data and self.aborted:
            raise OSError("upload aborted by the writer")
        return data

    def drain_and_close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while self.raw.read(1024 * 1024):
                pass
        with contextlib.suppress(OSError):
            self.raw.close()


class _GuardedWriter:
    """Writes to the pipe, failing fast with the uploader's error once it has given up."""

    def __init__(self, f: BinaryIO, errors: list[BaseException]) -> None:
        self._f = f
        self._errors = errors

    def write(self, data) -> int:
        if self._errors:
            raise self._errors[0]
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


class _HashingSink:
    """Write-only, non-seekable sink: the transfer manager then delivers parts in order."""

    def __init__(self, f: BinaryIO, hasher) -> None:
        self._f = f
        self._hasher = hasher
        self._feed = _feeder(hasher)

    def write(self, data) -> int:
        if isinstance(data, bytes):
            self._feed(data)
        else:  # a buffer the transfer manager may reuse
            self._hasher.update(data)
        return self._f.write(data)


def _is_not_found(exc: Exception) -> bool:
    return error_code(exc) in ("404", "NoSuchKey", "NotFound")
