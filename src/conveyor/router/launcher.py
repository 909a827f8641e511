"""``conveyor serve --data-parallel-size N``: N replicas of the server on one host, each a
``python -m conveyor.serve`` process of its own with the same options on a free loopback
port, behind the router on ``--host``/``--port``. The replicas join rotation as their
health checks pass; one that exits leaves it (and is not restarted: a supervisor's job).
The router stops them all when it stops, and a launcher killed outright takes them with
it (Linux: the parent-death signal).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

from conveyor import envs

logger = logging.getLogger("conveyor.router")

# Options of the launcher itself, with the number of values each takes.
_OWN_OPTIONS = {"--data-parallel-size": 1, "--routing": 1, "--port": 1, "--host": 1}


def replica_argv(argv: Sequence[str]) -> list[str]:
    """``conveyor serve``'s arguments without the launcher's own (``--opt v`` or ``--opt=v``)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN_OPTIONS:
            skip = 0 if "=" in arg else _OWN_OPTIONS[name]
            continue
        out.append(arg)
    return out


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the launcher dies, even by SIGKILL,
    so that no replica outlives its router."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_data_parallel(args: argparse.Namespace) -> int:
    import uvicorn

    from conveyor.router.app import RouterConfig, build_router_app

    n = args.data_parallel_size
    if n < 1:
        raise SystemExit(f"conveyor serve: --data-parallel-size must be >= 1, got {n}")
    argv = getattr(args, "argv", None)
    if argv is None:
        raise SystemExit("conveyor serve: --data-parallel-size needs the command line "
                         "(run it as `conveyor serve` or `python -m conveyor.serve`)")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ports = [_free_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        config = RouterConfig(urls, routing=args.routing, replica_api_key=(
            args.api_key or envs.api_key()))
    except ValueError as e:
        raise SystemExit(f"conveyor serve: {e}") from None
    base = [sys.executable, "-m", "conveyor.serve", *replica_argv(argv), "--host", "127.0.0.1"]
    procs = [subprocess.Popen([*base, "--port", str(p)], preexec_fn=_die_with_parent)
             for p in ports]
    logger.info("data parallel: %d replicas (%s) behind the router (%s) on http://%s:%d", n,
                ", ".join(urls), args.routing, args.host, args.port)

    def stop_replicas() -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # each drains its requests, then stops
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                logger.error("replica pid %d did not stop in 60 s: killed", proc.pid)
                proc.kill()
                proc.wait()

    try:
        uvicorn.run(build_router_app(config, on_stop=stop_replicas), host=args.host,
                    port=args.port, log_level=args.log_level,
                    access_log=not args.no_access_log, timeout_graceful_shutdown=None)
    finally:
        stop_replicas()  # the router failed to start, or stopped without its lifespan
    return 0
