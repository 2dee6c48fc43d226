"""A minimal object store chosen by URI: ``file://`` (default for bare paths) and ``s3://``.

Call order and guarantees (the same for every backend):

* ``put_bytes`` / ``writing`` make an object visible only once it is complete: ``file://`` writes a
  temporary name, fsyncs and renames; ``s3://`` relies on a single PUT or a completed multipart upload.
* ``writing(key)`` yields a local path to write; on a clean exit the file becomes the object, on an
  exception nothing is published and the temporary file is removed.
* ``reading(key)`` yields a local path holding the whole object (``file://``: the object itself).
* ``list(prefix)`` returns keys under ``prefix`` (relative to the store root), sorted.

Keys are ``/``-separated and relative to the store's root URI.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse


class ObjectNotFound(KeyError):
    """The key does not exist in the store."""


class StoreConfigError(ValueError):
    """A checkpoint URI that cannot be used (bad scheme, unwritable, missing bucket)."""


class ObjectStore(ABC):
    uri: str

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """:raises ObjectNotFound: when the key does not exist."""

    @abstractmethod
    def list(self, prefix: str = "", *, include_temporary: bool = False, start_after: str | None = None) -> list[str]:
        """Keys under ``prefix``, sorted; ``include_temporary`` adds writes that never completed (file://
        temp files left by a killed writer) so retention can delete them; ``start_after``: only keys that
        sort after this one (S3 then lists only those: a time-ordered log is read from a time on)."""

    def list_versions(self, prefix: str = "", *, start_after: str | None = None) -> dict[str, str | None]:
        """:meth:`list`, each key with a version that changes whenever its object is written again (S3: the
        ETag; file://: modification time, size and inode), from the same listing; None where a store
        has none (a reader then cannot tell that an object it read before is unchanged)."""
        return dict.fromkeys(self.list(prefix, start_after=start_after))

    def get_many_versioned(self, keys: list[str]) -> dict[str, tuple[bytes, str | None]]:
        """:meth:`get_many`, each object with the version of the bytes read (as :meth:`list_versions` gives
        it; None where a store cannot tell)."""
        return {k: (raw, None) for k, raw in self.get_many(keys).items()}

    @abstractmethod
    def delete(self, keys: list[str]) -> None: ...

    @abstractmethod
    def writing(self, key: str) -> contextlib.AbstractContextManager[str]: ...

    @abstractmethod
    def reading(self, key: str, hasher=None) -> contextlib.AbstractContextManager[str]:
        """Yield a local path holding the object; ``hasher`` (a hashlib object) is fed its bytes."""

    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        """Yield a writable binary file; the object is published when the block exits cleanly."""
        with self.writing(key) as path, open(path, "wb") as f:
            yield f

    def size(self, key: str) -> int:
        """Size in bytes of an object, without fetching it.

        :raises ObjectNotFound: when the key does not exist.
        """
        return len(self.get_bytes(key))

    def exists(self, key: str) -> bool:
        try:
            self.get_bytes(key)
        except ObjectNotFound:
            return False
        return True

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """The objects of ``keys`` that exist (a key deleted since it was listed is left out)."""
        out = {}
        for key in keys:
            try:
                out[key] = self.get_bytes(key)
            except ObjectNotFound:
                continue
        return out

    def tidy(self) -> None:  # noqa: B027 - a no-op by default, on purpose
        """Remove what a killed writer can leave behind that is not an object (file://: empty folders)."""

    def child(self, prefix: str) -> ObjectStore:
        """A store rooted at ``prefix`` inside this one."""
        return open_store(self.uri.rstrip("/") + "/" + prefix.strip("/"), **self._child_options())

    def at(self, uri: str) -> ObjectStore:
        """The store at another ``uri`` of the same service, opened through this one's client."""
        return open_store(uri, **self._child_options())

    def _child_options(self) -> dict:
        return {}

    def region(self) -> str | None:
        """The cloud region the store's objects live in; None where a store has none (``file://``)."""
        return None

    def check_writable(self) -> None:
        """Write and delete a probe object, so a bad URI fails before any training starts."""
        key = f".probe-{uuid.uuid4().hex}"
        try:
            self.put_bytes(key, b"ok")
            self.delete([key])
        except Exception as exc:  # any backend failure means the same thing to the user
            raise StoreConfigError(
                f"checkpoint store {self.uri!r} is not writable ({type(exc).__name__}: {exc}); "
                "pass a checkpoint_uri the workers and instances can write to"
            ) from exc


class LocalStore(ObjectStore):
    """``file://`` store: commit by write-to-temp, fsync, rename (atomic on POSIX)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.uri = "file://" + str(self.root)

    def _path(self, key: str) -> Path:
        key = key.strip("/")
        if ".." in key.split("/"):
            raise ValueError(f"object key must not contain '..': {key!r}")
        return self.root / key if key else self.root

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.writing(key) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key) from None

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            if path.is_file():
                return path.stat().st_size
        except FileNotFoundError:
            pass  # removed between the two calls
        raise ObjectNotFound(key)

    def list(self, prefix: str = "", *, include_temporary: bool = False, start_after: str | None = None) -> list[str]:
        return sorted(rel for rel, _path in self._walk(prefix, include_temporary, start_after))

    #: a file modified less than this before it is listed has no version: a file system's clock ticks
    #: (1 s on some) could give a rewrite within the same tick the same time, size and a reused inode
    #: (git's "racy clean" rule)
    RACY_SECONDS = 2.0

    def list_versions(self, prefix: str = "", *, start_after: str | None = None) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        now = time.time()
        for rel, path in sorted(self._walk(prefix, False, start_after)):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue  # deleted since the walk saw it, as list() would have left it out a moment later
            out[rel] = self._version(st, now)
        return out

    @classmethod
    def _version(cls, st: os.stat_result, now: float) -> str | None:
        # a write renames a new file into place: its time moves on by at least RACY_SECONDS once settled
        if now - st.st_mtime < cls.RACY_SECONDS:
            return None
        return f"{st.st_mtime_ns}-{st.st_size}-{st.st_ino}"

    def get_many_versioned(self, keys: list[str]) -> dict[str, tuple[bytes, str | None]]:
        out = {}
        now = time.time()
        for key in keys:
            try:
                with open(self._path(key), "rb") as f:  # the version of the very file read, not of a later one
                    out[key] = (f.read(), self._version(os.fstat(f.fileno()), now))
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                continue
        return out

    def _walk(self, prefix: str, include_temporary: bool, start_after: str | None) -> Iterator[tuple[str, str]]:
        if self.root.exists() and not self.root.is_dir():  # not "empty": the store is gone or replaced
            raise NotADirectoryError(f"store root {self.root} exists but is not a directory")
        base = self._path(prefix) if prefix.endswith("/") or not prefix else self._path(prefix).parent
        if not base.is_dir():
            return
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-") and not include_temporary:
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, self.root).replace(os.sep, "/")
                if rel.startswith(prefix.lstrip("/")) and (start_after is None or rel > start_after):
                    yield rel, path

    def delete(self, keys: list[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            parents.add(path.parent)
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            if parent != self.root:
                with contextlib.suppress(OSError):  # not empty: something else lives there
                    parent.rmdir()

    def tidy(self) -> None:
        for dirpath, dirs, files in os.walk(self.root, topdown=False):
            if not dirs and not files and dirpath != str(self.root):
                with contextlib.suppress(OSError):  # a writer may have just created it
                    os.rmdir(dirpath)

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[str]:
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            yield str(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        with self.writing(key) as path, open(path, "wb") as f, _EarlyWriteback(f) as w:
            yield w

    @contextlib.contextmanager
    def reading(self, key: str, hasher=None) -> Iterator[str]:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(key)
        if hasher is not None:
            feed = _feeder(hasher)
            with open(path, "rb") as f:
                while block := f.read(8 * 1024 * 1024):
                    feed(block)
        yield str(path)


class _EarlyWriteback:
    """A file whose dirty pages go to the disk while it is still being written.

    The commit fsyncs the payload; left to the end, that fsync writes the whole file after the
    serialising and hashing are done, so a save costs their sum. Here, every ``EVERY_BYTES`` written, a
    helper thread flushes what is written so far (``fdatasync``, which releases the GIL) while the
    writer goes on, so the final fsync has only the tail left (``benchmarks/results/gpu_staging.txt``)."""

    EVERY_BYTES: float = 128 * 1024 * 1024

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._unsynced = 0
        self._pool: ThreadPoolExecutor | None = None
        self._sync: Future | None = None

    def __enter__(self) -> _EarlyWriteback:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # the commit's own fsync follows
            self._pool = None
        if self._sync is not None and exc[0] is None:
            self._sync.result()  # a failed flush fails the save

    def write(self, data) -> int:
        n = self._f.write(data)
        if n is None:  # a raw file may not report what it took; a buffered one always took it all
            n = memoryview(data).nbytes
        self._unsynced += n
        if self._unsynced >= self.EVERY_BYTES and (self._sync is None or self._sync.done()):
            if self._sync is not None:
                self._sync.result()
            self._f.flush()  # hand Python's buffer to the kernel first
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spot-writeback")
            self._sync = self._pool.submit(_fdatasync, self._f.fileno())
            self._unsynced = 0
        return n

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()


_fdatasync = getattr(os, "fdatasync", os.fsync)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _feeder(hasher):
    """How to hand a hasher bytes read from a file: without waiting, where it can (a block SHA-256
    hashes its blocks on other cores while the next bytes are read)."""
    return getattr(hasher, "update_owned", hasher.update)


def _is_not_found(exc: Exception) -> bool:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code")
    return code in ("404", "NoSuchKey", "NotFound")


def store_errors() -> tuple[type[BaseException], ...]:
    """What a store call raises when the store is unreachable, refuses, or lost a file under it."""
    errors: list[type[BaseException]] = [OSError]
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # an instance with file:// stores only
        pass
    else:
        errors += [BotoCoreError, ClientError]
    return tuple(errors)


def store_error_hint(exc: BaseException) -> str:
    """What to do about a store error a user can fix (credentials, region, access), or ``""``."""
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return ("; no AWS credentials were found: set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or run where an instance role grants them (a local S3 such as moto or MinIO: --endpoint-url "
                "and any key pair)")
    if name == "NoRegionError":
        return "; no AWS region is set: set AWS_DEFAULT_REGION (or the profile's region)"
    code = getattr(exc, "response", {}).get("Error", {}).get("Code") if hasattr(exc, "response") else None
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
        return "; the credentials in use may not read this bucket: they need s3:ListBucket and s3:GetObject on it"
    if code in ("NoSuchBucket",):
        return "; the bucket does not exist: check the URI's bucket name"
    return ""


def uri_problem(uri: str) -> str | None:
    """What is wrong with the shape of a checkpoint URI (None when nothing is), shared by
    :func:`open_store` and the operator's parse-time checks so both say the same thing."""
    parsed = urlparse(uri)
    if parsed.scheme and parsed.scheme not in ("file", "s3"):
        return f"unsupported checkpoint URI scheme {parsed.scheme!r} in {uri!r}; use file:// or s3://"
    if parsed.scheme and not uri.startswith(parsed.scheme + "://"):
        rest = uri[len(parsed.scheme) + 1:].lstrip("/")
        example = f"s3://{rest}" if parsed.scheme == "s3" else f"file:///{rest}"
        return (
            f"checkpoint URI {uri!r} has the scheme {parsed.scheme!r} but not the '//' that must follow "
            f"'{parsed.scheme}:'; write {example}"
        )
    if parsed.scheme == "file" and parsed.netloc:
        return f"file URIs must be absolute (file:///path), got {uri!r}"
    if parsed.scheme == "s3" and not parsed.netloc:
        return f"s3 URI needs a bucket (s3://bucket/prefix), got {uri!r}"
    return None


def _place(uri: str) -> tuple[str | None, str]:
    """``(bucket, prefix)`` of an ``s3://`` URI, ``(None, absolute path)`` of a local one; checked."""
    if not uri or not isinstance(uri, str):
        raise StoreConfigError(f"checkpoint URI must be a non-empty string, got {uri!r}")
    problem = uri_problem(uri)
    if problem:
        raise StoreConfigError(problem)
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return parsed.netloc, parsed.path
    return None, os.path.abspath(parsed.path if parsed.scheme == "file" else uri)


def open_store(uri: str, **options) -> ObjectStore:
    """Open the store for ``uri``: ``s3://bucket/prefix``, ``file:///abs/path`` or a plain path."""
    bucket, path = _place(uri)
    return S3Store(bucket, path, **options) if bucket is not None else LocalStore(path)


def store_uri(uri: str) -> str:
    """The ``uri`` a store opened at ``uri`` names itself (:func:`open_store`'s ``.uri``), without opening it:
    no client, no credentials."""
    bucket, path = _place(uri)
    if bucket is None:
        return "file://" + path
    prefix = path.strip("/")
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


def open_existing_store(uri: str, endpoint_url: str | None = None, what: str = "a store") -> ObjectStore:
    """:func:`open_store` for a command that reads what is there: a local path that does not exist is an
    error naming ``what`` was expected (read as empty, a mistyped path would look like an empty store; S3
    cannot tell a missing prefix from an empty one). ``endpoint_url`` applies to ``s3://`` only."""
    store = open_store(uri, **({"endpoint_url": endpoint_url} if endpoint_url and uri.startswith("s3://") else {}))
    if isinstance(store, LocalStore) and not store.root.exists():
        raise StoreConfigError(f"{store.root} does not exist; give {what}")
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise StoreConfigError(f"{store.root} is a file, not a folder; give {what}")
    return store


__all__ = [
    "LocalStore", "ObjectNotFound", "ObjectStore", "S3Store", "StoreConfigError", "open_existing_store", "open_store",
    "store_error_hint", "store_errors", "store_uri", "uri_problem",
]
