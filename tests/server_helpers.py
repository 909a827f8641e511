"""Start the real server in a subprocess on a free loopback port, and read its metrics."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

import conveyor

from helpers import cpu_threads

SRC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(conveyor.__file__)))
# Serving runs the default decode attention (the native kernel on CPU); test_exactness
# and test_decode_attention cover both backends.
ATTENTION_BACKEND = "auto"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: str
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready in {timeout_s} s:\n{self.log()[-4000:]}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics: ``name`` or ``name{label="value"}`` -> value."""
        r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10.0)
        r.raise_for_status()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())
                                  if k != "le")
                if "le" in s.labels:
                    continue  # buckets are not needed by the tests
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out


@contextlib.contextmanager
def serve(model: str, *args: str, api_key: str | None = None, wait: bool = True,
          ready_timeout_s: float = 180.0, port: int | None = None) -> Iterator[ServerProcess]:
    """``python -m conveyor.serve --model MODEL ARGS`` until the block ends (then SIGTERM).

    With ``wait=False`` the caller does other work while the server boots, then calls
    ``wait_ready``. ``port``: a given one (a replica restarted where it was), else a free one.
    """
    cmd = [sys.executable, "-m", "conveyor.serve", "--model", model,
           "--dtype", "float32", "--num-threads", str(cpu_threads()), "--log-level", "warning",
           "--attention-backend", ATTENTION_BACKEND, *args]
    if api_key:
        cmd += ["--api-key", api_key]
    with _spawn(cmd, port, api_key, wait, ready_timeout_s) as server:
        yield server


@contextlib.contextmanager
def router(replica_urls: list[str], *args: str, wait: bool = True,
           ready_timeout_s: float = 60.0) -> Iterator[ServerProcess]:
    """``conveyor router --replica URL ... ARGS`` until the block ends (then SIGTERM)."""
    cmd = [sys.executable, "-m", "conveyor.entrypoints.cli", "router", "--log-level", "warning",
           *(a for url in replica_urls for a in ("--replica", url)), *args]
    with _spawn(cmd, None, None, wait, ready_timeout_s) as server:
        yield server


@contextlib.contextmanager
def _spawn(cmd: list[str], port: int | None, api_key: str | None, wait: bool,
           ready_timeout_s: float) -> Iterator[ServerProcess]:
    port = free_port() if port is None else port
    cmd = [*cmd, "--port", str(port)]
    fd, log_path = tempfile.mkstemp(prefix="conveyor-server-", suffix=".log")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH")) if p)
    env.pop("CONVEYOR_API_KEY", None)
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, env=env)
    os.close(fd)  # the child holds its own copy
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path, api_key)
    try:
        if wait:
            server.wait_ready(ready_timeout_s)
        yield server
    finally:
        server.stop()
        os.unlink(log_path)


def engine_core_pid(server: ServerProcess) -> int:
    """The pid of the server's engine-core process (its multiprocessing spawn child)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue  # gone already, or not ours to read
        if ppid == server.proc.pid and b"spawn_main" in cmdline:
            return int(entry)
    raise RuntimeError(f"no engine-core process under the server (pid {server.proc.pid})")


@contextlib.contextmanager
def engine_frozen(server: ServerProcess) -> Iterator[None]:
    """Stop the server's engine-core process (SIGSTOP) until the block ends: no step runs,
    so no request can finish or be admitted, however fast the machine; the HTTP front end
    (its own process) goes on answering and timing requests out."""
    pid = engine_core_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.05)
