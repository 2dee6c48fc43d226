"""A minimal object store chosen by URI: ``file://`` (default for bare paths) and ``s3://``.

Call order and guarantees (the same for every backend):

* ``put_bytes`` / ``writing`` make an object visible only once it is complete: ``file://`` writes a
  temporary name, fsyncs and renames; ``s3://`` relies on a single PUT or a completed multipart upload.
* ``writing(key)`` yields a local path to write; on a clean exit the file becomes the object, on an
  exception nothing is published and the temporary file is removed.
* ``reading(key)`` yields a local path holding the whole object (``file://``: the object itself).
* ``list(prefix)`` returns keys under ``prefix`` (relative to the store root), sorted.

Keys are ``/``-separated and relative to the store's root URI.

The interface, its errors and the URI parsing live here; the backends beside it: ``file://`` in
:mod:`airflow_spot.storage.file_store`, ``s3://`` in :mod:`airflow_spot.storage.s3_store`. Both are imported at
the bottom of this module (they subclass :class:`ObjectStore`, and :func:`open_store` builds them), so
``from airflow_spot.storage.object_store import LocalStore, S3Store`` works as before; boto3 is still imported
only when an :class:`S3Store` is made.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO
from urllib.parse import unquote, urlparse, urlsplit


class ObjectNotFound(KeyError):
    """The key does not exist in the store."""


class StoreConfigError(ValueError):
    """A checkpoint URI that cannot be used (bad scheme, unwritable, missing bucket)."""


class ObjectStore(ABC):
    uri: str
    #: :meth:`reading` yields the object's own file (``file://``), not a downloaded copy
    reads_in_place: bool = False

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
            self.size(key)  # S3: a HEAD, not a read of the whole object
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


# _EarlyWriteback is file://'s (LocalStore.open_write), but it stays here with _fdatasync: tests patch
# ``object_store._fdatasync``, which its write() looks up in this module's globals.
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


def _feeder(hasher):
    """How to hand a hasher bytes read from a file: without waiting, where it can (a block SHA-256
    hashes its blocks on other cores while the next bytes are read)."""
    return getattr(hasher, "update_owned", hasher.update)


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


def error_code(exc: BaseException) -> str | None:
    """The AWS error code of a botocore ``ClientError`` (``NoSuchKey``, ``AccessDenied``...), else None: other
    libraries' exceptions carry a ``response`` too (None, or an HTTP response object), which must not turn
    an error's hint or a not-found check into an AttributeError."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    error = response.get("Error")
    return error.get("Code") if isinstance(error, dict) else None


def store_error_hint(exc: BaseException) -> str:
    """What to do about a store error a user can fix (credentials, region, access), or ``""``."""
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return ("; no AWS credentials were found: set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or run where an instance role grants them (a local S3 such as moto or MinIO: --endpoint-url "
                "and any key pair)")
    if name == "NoRegionError":
        return "; no AWS region is set: set AWS_DEFAULT_REGION (or the profile's region)"
    code = error_code(exc)
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
    if parsed.scheme == "file":
        for char, part, escape in (("#", "a fragment", "%23"), ("?", "a query", "%3F")):
            if char in uri:
                cut = unquote(urlsplit(uri).path)
                return (f"file URI {uri!r} holds {char!r}, which ends a URI's path ({part} follows it): the "
                        f"checkpoints would go to {cut!r}; write {char!r} as {escape} or give the plain path")
    if parsed.scheme == "s3" and not parsed.netloc:
        return f"s3 URI needs a bucket (s3://bucket/prefix), got {uri!r}"
    return None


def file_uri(path: str) -> str:
    """The ``file://`` URI of an absolute ``path`` that :func:`open_store` reads back as that path: the
    characters a URI's path cannot hold as they are ('%' starts an escape, '?' a query, '#' a fragment)
    escaped, every other character as it is (so run ids such as ``manual__2026-12-02T02:33:00+00:00``
    stay readable)."""
    return "file://" + path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")


def _place(uri: str) -> tuple[str | None, str]:
    """``(bucket, prefix)`` of an ``s3://`` URI, ``(None, absolute path)`` of a local one; checked."""
    if not uri or not isinstance(uri, str):
        raise StoreConfigError(f"checkpoint URI must be a non-empty string, got {uri!r}")
    problem = uri_problem(uri)
    if problem:
        raise StoreConfigError(problem)
    if uri.startswith("s3://"):
        # the key prefix as written, as the AWS CLI reads s3:// URIs: '#', '?' and '%' are part of a key
        bucket, slash, prefix = uri[len("s3://"):].partition("/")
        return bucket, slash + prefix
    if uri.startswith("file://"):
        return None, os.path.abspath(unquote(urlsplit(uri).path))  # RFC 8089: the path is percent-encoded
    return None, os.path.abspath(uri)


def open_store(uri: str, **options) -> ObjectStore:
    """Open the store for ``uri``: ``s3://bucket/prefix``, ``file:///abs/path`` or a plain path."""
    bucket, path = _place(uri)
    return S3Store(bucket, path, **options) if bucket is not None else LocalStore(path)


def store_uri(uri: str) -> str:
    """The ``uri`` a store opened at ``uri`` names itself (:func:`open_store`'s ``.uri``), without opening it:
    no client, no credentials."""
    bucket, path = _place(uri)
    if bucket is None:
        return file_uri(path)
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


# The backends subclass ObjectStore, so they are imported once it exists: open_store builds them, and these
# names stay importable from here.
from airflow_spot.storage.file_store import LocalStore  # noqa: E402
from airflow_spot.storage.s3_store import S3Store  # noqa: E402


__all__ = [
    "LocalStore", "ObjectNotFound", "ObjectStore", "S3Store", "StoreConfigError", "open_existing_store", "open_store",
    "error_code", "store_error_hint", "store_errors", "store_uri", "uri_problem",
]
