"""A fork server for kill tests: training scripts started in milliseconds instead of an interpreter start.

Hundreds of kills of a torch script would spend most of their time importing torch (seconds each on a
loaded machine). The server (a separate process) imports the script modules once, without running any
torch op (forking a process whose thread pools are running is unsafe), then forks one child per
request; each child runs ``python -m <module> <argv>`` in the request's environment with its output in
a file. The test signals children by pid and learns their exit status from the server.

Protocol, one JSON object per line: requests on the server's stdin ``{"id", "module", "argv", "env",
"output"}``; replies on its stdout ``{"id", "pid"}`` when started and ``{"pid", "returncode"}`` when
reaped (``returncode`` as ``subprocess`` reports it: negative for a death by signal).
"""
from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m module argv`` and never return."""
    code = 1
    try:
        fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["argv"]]
        module = importlib.import_module(request["module"])
        code = module.main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the child's output, as an interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code or 0)


def serve(preload: list[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    stdin = sys.stdin.fileno()
    buffer = b""
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.005)
        if ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                break  # the test went away: its children are killed below
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children.add(pid)
                out.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
                out.flush()
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            out.write(json.dumps({"pid": pid, "returncode": code}) + "\n")
            out.flush()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ForkedProcess:
    """The part of ``subprocess.Popen`` kill tests use, for a child of a :class:`ForkServer`."""

    def __init__(self, server: ForkServer, pid: int, output: str) -> None:
        self.server, self.pid, self.output = server, pid, output
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncodes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.005)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float) -> tuple[bytes, None]:
        self.wait(timeout)
        with open(self.output, "rb") as f:
            return f.read(), None


class ForkServer:
    """Starts the server process; :meth:`spawn` runs a module's ``main(argv)`` in a fresh fork of it.

    :param preload: modules imported once by the server (the scripts and what they import).
    :param threads: intra-op threads of torch in every child (set at the server's import of torch, so
        children ignore their own ``OMP_NUM_THREADS``). One by default: on a loaded machine torch's
        parallel kernels spin at barriers (measured 77 ms per step of a tiny MLP on two threads against
        10 ms on one); every run of a comparison then uses the same count, which bit-exactness needs.
    """

    def __init__(self, preload: list[str], threads: int = 1) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "airflow_spot.testing.forkserver", *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)},
        )
        self.returncodes: dict[int, int] = {}
        self._started: dict[int, int] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        first = json.loads(self.proc.stdout.readline() or b'{"ready": null}')
        if not first.get("ready"):
            raise RuntimeError("the fork server did not start (see its stderr)")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            if "returncode" in reply:
                self.returncodes[reply["pid"]] = reply["returncode"]
            else:
                self._started[reply["id"]] = reply["pid"]

    def spawn(self, module: str, argv: list[str], env: dict[str, str], output: str,
              timeout: float = 30.0) -> ForkedProcess:
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            request = {"id": rid, "module": module, "argv": argv, "env": dict(env), "output": output}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while rid not in self._started:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the fork server did not start the child")
            time.sleep(0.002)
        return ForkedProcess(self, self._started.pop(rid), output)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    serve(sys.argv[1:])
