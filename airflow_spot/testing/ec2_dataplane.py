"""A local data plane for the ``ec2`` backend against moto: it plays the instances moto only pretends to run.

moto's EC2 keeps records, nothing runs. For each running moto instance carrying our tag
(``airflow-spot:managed``) and launched after the plane started, :class:`Ec2DataPlane` starts the agent locally *as that instance*: the agent's
command line and environment come from the instance's own user data (the same bootstrap a real instance
runs, :func:`~airflow_spot.backends.bootstrap.agent_argv_from_user_data`), with ``--imds-url`` pointed at
a small IMDSv2 server on 127.0.0.1 that serves that instance's id, region and zone, and answers 404 on
``spot/instance-action`` and the rebalance recommendation until the harness issues them.

What the cloud would do, the harness does:

* **Preemption** (:meth:`Ec2DataPlane.preempt`, or a schedule: the n-th instance seen is preempted
  ``after_seconds[n]`` after its agent starts): set the instance-action, wait the notice window, then
  terminate the instance in moto with ``Server.SpotInstanceTermination`` (by editing moto's backend
  object, which needs moto's server in this process: ``ThreadedMotoServer``) and kill its processes.
* **Termination by anyone** (our ``terminate``, ``reap``): the instance's processes get SIGTERM, then
  SIGKILL after a grace, like a shutdown.
* **An agent that exits by itself** (idle timeout): the user data's ``shutdown -h now`` terminates the
  instance with ``Client.InstanceInitiatedShutdown``.
* **Spot prices**: moto answers every ``DescribeSpotPriceHistory`` with 0.00001; :meth:`set_spot_prices`
  makes it answer with a table instead (seed it from the bundled catalog, move it between attempts).

Test and demo code only; never imported by the provider itself.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from airflow_spot.backends.bootstrap import agent_argv_from_user_data

log = logging.getLogger(__name__)

TAG_MANAGED = "airflow-spot:managed"
SPOT_REASON = ("Server.SpotInstanceTermination: Spot instance termination", "Server.SpotInstanceTermination")
IDLE_REASON = ("Client.InstanceInitiatedShutdown: Instance initiated shutdown", "Client.InstanceInitiatedShutdown")


class ImdsServer:
    """IMDSv2 of one instance on 127.0.0.1: a token from ``PUT /latest/api/token``, then GETs with it."""

    def __init__(self, instance_id: str, region: str, zone: str) -> None:
        self.values = {
            "/latest/meta-data/instance-id": instance_id,
            "/latest/meta-data/placement/region": region,
            "/latest/meta-data/placement/availability-zone": zone,
        }
        self.token = uuid.uuid4().hex
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # one line per request otherwise
                pass

            def _send(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(200, outer.token)
                else:
                    self._send(400, "missing X-aws-ec2-metadata-token-ttl-seconds")

            def do_GET(self):
                if self.headers.get("X-aws-ec2-metadata-token") != outer.token:
                    self._send(401)
                    return
                value = outer.values.get(self.path.rstrip("/"))
                self._send(404, "Not Found") if value is None else self._send(200, value)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name=f"imds-{instance_id}", daemon=True)
        self._thread.start()

    def issue_notice(self, action: str = "terminate", seconds_from_now: float = 120.0) -> None:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds_from_now))
        self.values["/latest/meta-data/spot/instance-action"] = json.dumps({"action": action, "time": when})

    def recommend_rebalance(self) -> None:
        self.values["/latest/meta-data/events/recommendations/rebalance"] = json.dumps(
            {"noticeTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class PlayedInstance:
    instance_id: str
    imds: ImdsServer
    agent: subprocess.Popen
    started_at: float
    log_path: Path
    preempt_at: float | None = None
    notice_issued_at: float | None = None
    ended: str | None = None


@dataclass
class Ec2DataPlane:
    """Plays every managed moto instance of ``region`` as a local agent (see the module doc).

    :param work_dir: agents' work directories and logs (``<work_dir>/<instance>/``).
    :param after_seconds: preemption schedule: the n-th instance seen is preempted this long after its
        agent starts; ``None`` entries and instances past the list are never preempted.
    :param notice_window_seconds: time between the instance-action and the termination (AWS: 120 s).
    :param grace_seconds: SIGTERM -> SIGKILL when an instance is terminated.
    """

    work_dir: Path
    region: str = "us-east-1"
    after_seconds: list[float | None] = field(default_factory=list)
    notice_window_seconds: float = 5.0
    grace_seconds: float = 5.0
    poll_seconds: float = 0.2
    env: dict[str, str] = field(default_factory=dict)
    #: called with (instance id, instance type, zone) at each interruption notice, e.g. to move spot prices
    on_notice: Callable[[str, str, str], None] | None = None
    played: dict[str, PlayedInstance] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir)
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._before: set[str] = set()

    # ------------------------------------------------------------------ moto's backend object
    def _ec2(self):
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.ec2.models import ec2_backends

        return ec2_backends[DEFAULT_ACCOUNT_ID][self.region]

    def _tags(self, inst) -> dict[str, str]:
        return dict(self._ec2().tags.get(inst.id, {}))

    # ------------------------------------------------------------------ life cycle
    def start(self) -> Ec2DataPlane:
        """Play every managed instance launched from now on; instances moto already holds (earlier tests in
        this process share moto's backend) are none of this plane's business."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._before = {i.id for r in list(self._ec2().reservations.values()) for i in r.instances}
        self._thread = threading.Thread(target=self._run, name="ec2-dataplane", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; kill every agent still running and close the metadata servers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            for played in self.played.values():
                self._kill(played, grace=1.0)
                played.imds.close()

    def __enter__(self) -> Ec2DataPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - keep playing; the test reads .errors
                log.exception("data plane step failed")
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.poll_seconds)

    def step(self) -> None:
        """One pass: start agents for new instances, follow terminations, run the preemption schedule."""
        now = time.time()
        with self._lock:
            for inst in self._instances_with_tag():
                played = self.played.get(inst.id)
                state = inst._state.name
                if played is None:
                    if state == "running":
                        self._play(inst)
                    continue
                if played.ended:
                    continue
                if state in ("terminated", "shutting-down", "stopped", "stopping"):
                    self._kill(played, grace=self.grace_seconds)
                    played.ended = inst.state_reason.code or state
                elif played.agent.poll() is not None:
                    # the user data's `shutdown -h now` after the agent exits (idle timeout)
                    played.ended = IDLE_REASON[1]
                    self._terminate_in_moto(inst, IDLE_REASON)
                elif played.notice_issued_at is not None:
                    if now >= played.notice_issued_at + self.notice_window_seconds:
                        # Recorded before moto shows the instance terminated: a reader that saw the
                        # termination must also see it listed here.
                        played.ended = SPOT_REASON[1]
                        self.preempted.append(inst.id)
                        self._terminate_in_moto(inst, SPOT_REASON)
                        self._kill(played, grace=0.0)
                elif played.preempt_at is not None and now >= played.preempt_at:
                    self._notice(inst, played)

    def _instances_with_tag(self) -> list:
        found = []
        for reservation in list(self._ec2().reservations.values()):
            for inst in reservation.instances:
                if inst.id in self.played or (inst.id not in self._before
                                              and self._tags(inst).get(TAG_MANAGED) == "true"):
                    found.append(inst)
        return found

    def _play(self, inst) -> None:
        import base64

        raw = inst.user_data[0] if isinstance(inst.user_data, list) else inst.user_data
        if hasattr(raw, "decode") and not isinstance(raw, (bytes, str)):
            script = raw.decode()  # moto's Base64EncodedString
        else:
            script = base64.b64decode(raw).decode() if raw else ""
        argv, env = agent_argv_from_user_data(script)
        imds = ImdsServer(inst.id, self.region, str(inst._placement.zone))
        argv = [sys.executable, *argv[1:]]  # the image's python3 is this interpreter here
        if "--imds-url" in argv:
            argv[argv.index("--imds-url") + 1] = imds.url
        else:
            argv += ["--imds-url", imds.url]
        instance_dir = self.work_dir / inst.id
        instance_dir.mkdir(parents=True, exist_ok=True)
        argv += ["--work-dir", str(instance_dir / "agent")]
        log_path = instance_dir / "agent.log"
        with open(log_path, "ab") as out:
            agent = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **self.env, **env})
        n = len(self.played)
        after = self.after_seconds[n] if n < len(self.after_seconds) else None
        now = time.time()
        self.played[inst.id] = PlayedInstance(inst.id, imds, agent, now, log_path,
                                              preempt_at=None if after is None else now + after)
        log.info("data plane: playing %s (%s) as pid %d%s", inst.id, inst.instance_type, agent.pid,
                 "" if after is None else f", preempted after {after:g} s")

    # ------------------------------------------------------------------ cloud actions
    def preempt(self, instance_id: str) -> None:
        """Issue the interruption notice now; the instance is reclaimed after the notice window."""
        with self._lock:
            played = self.played[instance_id]
            if played.notice_issued_at is None and not played.ended:
                self._notice(self._ec2().get_instance(instance_id), played)

    def _notice(self, inst, played: PlayedInstance) -> None:
        played.notice_issued_at = time.time()  # recorded first: whoever sees the notice sees it in .notices
        played.imds.issue_notice(seconds_from_now=self.notice_window_seconds)
        log.info("data plane: spot interruption notice for %s", inst.id)
        if self.on_notice is not None:
            self.on_notice(inst.id, inst.instance_type, str(inst._placement.zone))

    @property
    def notices(self) -> list[str]:
        """Instances that got an interruption notice (reclaimed after the window unless terminated first)."""
        return [i for i, p in self.played.items() if p.notice_issued_at is not None]

    def _terminate_in_moto(self, inst, reason: tuple[str, str]) -> None:
        from moto.ec2.models.instances import StateReason

        if inst._state.name == "terminated":
            return
        # The reason goes in before the state: moto's server answers describe calls on other threads, and
        # moto's own terminate() marks the instance terminated before it sets its user-initiated reason, so
        # a reader in between saw a terminated instance with no reason (billed as `failed`). Hence the
        # parts of terminate() that free what moto ties to the instance, in the order a reader needs.
        inst.state_reason = StateReason(*reason)
        inst._reason = reason[0]
        for nic in list(inst.nics.values()):
            nic.stop()
            if nic.delete_on_termination:
                nic.delete()
        inst.teardown_defaults()
        inst._state.name, inst._state.code = "terminated", 48

    @staticmethod
    def _kill(played: PlayedInstance, grace: float) -> None:
        if played.agent.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(played.agent.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        try:
            played.agent.wait(timeout=max(grace, 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(played.agent.pid, signal.SIGKILL)
            played.agent.wait(timeout=10)
        # anything the agent left in its session (its commands run in groups of their own), as a powered-off
        # instance ends every process
        from airflow_spot.backends.local_state import kill_group

        kill_group(played.agent.pid, signal.SIGKILL)

    def running_instances(self, tags: dict[str, str] | None = None) -> list[str]:
        """Managed instances moto still shows as pending or running (a leak check after a run), optionally
        only those carrying every one of ``tags``."""
        return [i.id for i in self.instances(tags) if i._state.name in ("pending", "running")]

    def instances(self, tags: dict[str, str] | None = None) -> list:
        """moto's records of the managed instances carrying every one of ``tags``, in launch order."""
        with self._lock:
            found = [i for i in self._instances_with_tag()
                     if all(self._tags(i).get(k) == v for k, v in (tags or {}).items())]
        return sorted(found, key=lambda i: (str(i.launch_time), i.id))


# ---------------------------------------------------------------------- spot prices
_PRICES: dict[tuple[str, str], float] = {}
_PATCHED = False


def set_spot_prices(prices: dict[tuple[str, str], float]) -> None:
    """Make moto's ``DescribeSpotPriceHistory`` answer ``{(instance type, zone): $/h}`` (other pools keep
    moto's 0.00001). Call again to move prices; needs moto's server in this process."""
    global _PATCHED
    _PRICES.clear()
    _PRICES.update({(t, z): float(p) for (t, z), p in prices.items()})
    if _PATCHED:
        return
    from moto.core.responses import ActionResult
    from moto.ec2.responses.spot_instances import SpotInstances

    original = SpotInstances.describe_spot_price_history

    def describe_spot_price_history(self):
        result = original(self)
        history = []
        for row in result.result["SpotPriceHistory"]:  # ActionResult keeps the dict it was given
            price = _PRICES.get((row["InstanceType"], row["AvailabilityZone"]))
            history.append({**row, "SpotPrice": f"{price:.6f}"} if price is not None else row)
        return ActionResult({"SpotPriceHistory": history})

    SpotInstances.describe_spot_price_history = describe_spot_price_history
    _PATCHED = True


def spot_prices() -> dict[tuple[str, str], float]:
    return dict(_PRICES)
