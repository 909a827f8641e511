"""Start a server on a free loopback port, wait until it answers, and always stop it.

The server runs in its own process group (``start_new_session``), so stopping it
ends the workers it forked too (vLLM's engine core, uvicorn's reloader) and nothing
else: SIGTERM to that group, then SIGKILL if it has not exited after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on the loopback interface nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server exited or never became ready; the message names its log."""


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    port: int
    # Changes to this process's environment: a value sets, None removes.
    env: dict[str, str | None] = field(default_factory=dict)
    ready_path: str = "/v1/models"  # GET returns 200 once the model is loaded
    startup_timeout_s: float = 900.0

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"


class Server:
    """``with Server(spec, log_path) as s:`` starts, waits for readiness, stops on exit."""

    def __init__(self, spec: ServerSpec, log_path: str, stop_grace_s: float = 30.0) -> None:
        self.spec = spec
        self.log_path = log_path
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> Server:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        env = dict(os.environ)
        for key, value in self.spec.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        self._t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.spec.argv) + "\n")
            log.write("env: " + " ".join(f"{k}={'(unset)' if v is None else v}"
                                         for k, v in self.spec.env.items()) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.spec.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def wait_ready(self) -> float:
        """Seconds from start until the ready path answered 200."""
        url = self.spec.base_url + self.spec.ready_path
        deadline = self._t0 + self.spec.startup_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"{self.spec.name} exited with {code} while starting; "
                                  f"see {self.log_path}:\n{tail(self.log_path)}")
            if _answers(url):
                self.startup_s = time.perf_counter() - self._t0
                return self.startup_s
            if time.perf_counter() > deadline:
                raise ServerError(f"{self.spec.name} not ready after "
                                  f"{self.spec.startup_timeout_s:.0f}s; see {self.log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the server's group; SIGKILL what is left of it after the grace."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.perf_counter() + self.stop_grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(self.stop_grace_s)
        # The leader may be gone while its workers still wind down.
        while _group_alive(pgid) and time.perf_counter() < deadline:
            time.sleep(0.1)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)  # the group this script created for the server, by its id


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _answers(url: str) -> bool:
    # No proxy: the server is on loopback.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def cpu_counters(path: str = "/proc/stat") -> tuple[float, float] | None:
    """(busy, total) jiffies over every CPU since boot, or None where there is no
    /proc/stat (not Linux)."""
    try:
        with open(path) as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_until_quiet(threshold: float = 0.10, window_s: float = 0.25,
                     timeout_s: float = 10.0, read=cpu_counters, sleep=time.sleep) -> float:
    """Wait until the machine's CPUs were at most ``threshold`` busy over one window
    (every core counted): what the last run left spinning has stopped. vLLM's CPU worker
    keeps a core busy for about a second after its last step (its OpenMP threads spin
    down); a run started in that second shares the cores with it. Returns the
    seconds waited (windows x ``window_s``), ``timeout_s`` at most; 0 where the counters
    cannot be read."""
    before = read()
    if before is None:
        return 0.0
    waited = 0.0
    while waited < timeout_s:
        sleep(window_s)
        waited += window_s
        now = read()
        if now is None:
            return waited
        busy, total = now[0] - before[0], now[1] - before[1]
        if total > 0 and busy / total <= threshold:
            return waited
        before = now
    return waited
