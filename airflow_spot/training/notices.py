"""Where preemption notices come from: SIGTERM, a notice file, or the EC2 instance metadata service.

Each source calls ``on_notice(kind, detail)`` at most once per notice; ``kind`` is ``"preemption"`` (the
instance will be taken: save now and exit) or ``"rebalance"`` (risk has risen: take an insurance save).
Sources only set flags; the training loop acts between steps.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable

log = logging.getLogger(__name__)

NoticeCallback = Callable[[str, str], None]

PREEMPTION = "preemption"
REBALANCE = "rebalance"


class NoticeSource(ABC):
    name = "base"

    @abstractmethod
    def start(self, on_notice: NoticeCallback) -> None: ...

    def stop(self) -> None:
        pass


class SigtermNotice(NoticeSource):
    """SIGTERM means "you are about to be stopped": what an OS shutdown, Kubernetes or a scheduler sends."""

    name = "sigterm"

    def __init__(self) -> None:
        self._previous = None

    def start(self, on_notice: NoticeCallback) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("SIGTERM notices need the main thread; not installed")
            return

        def handler(signum, frame):
            on_notice(PREEMPTION, "SIGTERM received")

        self._previous = signal.signal(signal.SIGTERM, handler)

    def stop(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class _PollingSource(NoticeSource):
    """A daemon thread that calls ``poll()`` every ``interval`` seconds until stopped."""

    def __init__(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError(f"notice poll interval must be positive, got {interval}")
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @abstractmethod
    def poll(self, on_notice: NoticeCallback) -> bool:
        """Return True once a preemption notice was delivered (polling then stops)."""

    def start(self, on_notice: NoticeCallback) -> None:
        def loop():
            while not self._stop.is_set():
                try:
                    if self.poll(on_notice):
                        return
                except OSError as exc:  # a flaky endpoint must not kill training
                    log.debug("%s notice poll failed: %s", self.name, exc)
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=loop, name=f"spot-notice-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 1)


class FileNotice(_PollingSource):
    """A notice is the appearance of a file (the local backend's preemption injector creates it)."""

    name = "file"

    def __init__(self, path: str, interval: float = 0.1) -> None:
        super().__init__(interval)
        self.path = path

    def poll(self, on_notice: NoticeCallback) -> bool:
        if os.path.exists(self.path):
            try:
                with open(self.path) as f:
                    detail = f.read(500).strip()
            except OSError:
                detail = ""
            on_notice(PREEMPTION, detail or f"notice file {self.path}")
            return True
        return False


def imds_token(base_url: str, timeout: float = 2.0, ttl_seconds: int = 21600) -> str:
    """An IMDSv2 session token (``PUT /latest/api/token``)."""
    req = urllib.request.Request(base_url.rstrip("/") + "/latest/api/token", method="PUT",
                                 headers={"X-aws-ec2-metadata-token-ttl-seconds": str(ttl_seconds)})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


def instance_identity(base_url: str, timeout: float = 2.0, attempts: int = 10) -> tuple[str, str]:
    """``(instance id, region)`` of the instance this runs on, from IMDSv2 (token PUT, then GETs).

    Tried ``attempts`` times a second apart: right after boot the metadata service may not answer yet.

    :raises OSError: when the metadata service never answered.
    """
    base = base_url.rstrip("/")
    last: OSError | None = None
    for attempt in range(max(1, attempts)):
        try:
            headers = {"X-aws-ec2-metadata-token": imds_token(base, timeout)}
            values = []
            for path in ("/latest/meta-data/instance-id", "/latest/meta-data/placement/region"):
                req = urllib.request.Request(base + path, headers=headers)
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    values.append(resp.read().decode().strip())
            return values[0], values[1]
        except OSError as exc:  # URLError and HTTPError are OSErrors
            last = exc
            if attempt + 1 < attempts:
                threading.Event().wait(1.0)
    raise OSError(f"instance metadata at {base} did not tell this instance's id and region: {last}")


class ImdsNotice(_PollingSource):
    """EC2 instance metadata: ``spot/instance-action`` (2-minute notice) and the rebalance recommendation.

    Uses IMDSv2 (session token) and falls back to IMDSv1 when the token endpoint is absent. Both paths
    answer 404 until something is issued. AWS suggests polling every 5 seconds; we poll every second by
    default: each second before the notice is seen is taken from the emergency save's window and added to
    the recovery (a 5 s poll costs 2.5 s on average), while the instance-local endpoint allows 1,024
    requests a second (``SPOT_NOTICE_POLL_SECONDS`` sets it).
    """

    name = "imds"
    ACTION = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
    TOKEN = "/latest/api/token"

    def __init__(self, base_url: str = "http://169.254.169.254", interval: float = 1.0, timeout: float = 1.0):
        super().__init__(interval)
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._rebalance_seen = False
        self._token: str | None = None

    def _headers(self) -> dict[str, str]:
        if self._token is None:
            req = urllib.request.Request(
                self.base_url + self.TOKEN, method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"},
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    self._token = resp.read().decode()
            except urllib.error.HTTPError:
                self._token = ""  # IMDSv1 only
        return {"X-aws-ec2-metadata-token": self._token} if self._token else {}

    def _get(self, path: str) -> str | None:
        req = urllib.request.Request(self.base_url + path, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError as exc:
            if exc.code == 401:  # token expired
                self._token = None
            return None

    def poll(self, on_notice: NoticeCallback) -> bool:
        if not self._rebalance_seen and (body := self._get(self.REBALANCE_PATH)) is not None:
            self._rebalance_seen = True
            on_notice(REBALANCE, body)
        body = self._get(self.ACTION)
        if body is not None:
            on_notice(PREEMPTION, body)
            return True
        return False
