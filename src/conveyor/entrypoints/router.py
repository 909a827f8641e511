"""``conveyor router``: one OpenAI-compatible endpoint in front of ``conveyor serve`` replicas.

Two modes, one parser: data parallelism (``--replica URL`` repeated, ``--routing``:
``conveyor.router.app``) and prefill/decode disaggregation (``--prefill URL[,URL...]
--decode URL[,URL...]``: ``conveyor.router.disagg``); they exclude each other.
"""

from __future__ import annotations

import argparse

from conveyor.router.policies import POLICIES

DESCRIPTION = ("Route OpenAI-compatible requests over conveyor serve replicas: prefix "
               "(KV-cache aware: uncached prompt tokens plus load), least-loaded or "
               "round-robin; a replica that fails leaves rotation until /health passes.")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="route requests over several conveyor serve replicas",
                       description=DESCRIPTION)
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat per replica)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL[,URL...]",
                   help="prefill/decode mode: a prefill engine (conveyor serve --kv-role "
                        "prefill) that computes each prompt first")
    p.add_argument("--decode", action="append", default=[], metavar="URL[,URL...]",
                   help="prefill/decode mode: a decode engine (conveyor serve --kv-role "
                        "decode) that pulls the prompt's KV and generates")
    p.add_argument("--routing", default="prefix", choices=sorted(POLICIES),
                   help="how a request picks its replica (default prefix)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS",
                   help="check each replica's /health (and, for prefix, /v1/kv_summary) "
                        "this often")
    p.add_argument("--health-timeout", type=float, default=5.0, metavar="SECONDS")
    p.add_argument("--connect-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="a replica that does not accept a connection in this long leaves "
                        "rotation and the request goes to another")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="fail a request (504, or an error event in a stream) that a replica "
                        "has not finished in this long; the replica's connection is closed, "
                        "so it aborts the request (default: none; the replicas' own "
                        "--request-timeout still applies)")
    p.add_argument("--summary-blocks", type=int, default=8192, metavar="N",
                   help="cached block hashes to read from each replica's summary")
    p.add_argument("--replica-api-key", default=None,
                   help="the replicas' --api-key, for the router's own health and summary "
                        "calls (clients' Authorization headers are forwarded as they are)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--no-access-log", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from conveyor.router.app import RouterConfig, build_router_app

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.prefill or args.decode:
        return _run_disagg(args)
    try:
        config = RouterConfig(args.replica, routing=args.routing,
                              health_interval_s=args.health_interval,
                              health_timeout_s=args.health_timeout,
                              connect_timeout_s=args.connect_timeout,
                              summary_blocks=args.summary_blocks,
                              request_timeout_s=args.request_timeout,
                              replica_api_key=args.replica_api_key)
    except ValueError as e:
        raise SystemExit(f"conveyor router: {e}") from None
    logging.getLogger("conveyor.router").info(
        "routing (%s) over %s on http://%s:%d", args.routing, ", ".join(args.replica),
        args.host, args.port)
    uvicorn.run(build_router_app(config), host=args.host, port=args.port,
                log_level=args.log_level, access_log=not args.no_access_log,
                timeout_graceful_shutdown=None)
    return 0


def _urls(values: list[str]) -> list[str]:
    return [u.strip() for v in values for u in v.split(",") if u.strip()]


def _run_disagg(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from conveyor.router.disagg import DisaggConfig, build_disagg_app

    if args.replica:
        raise SystemExit("conveyor router: --replica (data parallel) and --prefill/--decode "
                         "(disaggregation) exclude each other")
    try:
        config = DisaggConfig(_urls(args.prefill), _urls(args.decode),
                              connect_timeout_s=args.connect_timeout,
                              request_timeout_s=args.request_timeout)
    except ValueError as e:
        raise SystemExit(f"conveyor router: {e}") from None
    logging.getLogger("conveyor.router").info(
        "prefill %s, decode %s on http://%s:%d", ", ".join(config.prefill),
        ", ".join(config.decode), args.host, args.port)
    uvicorn.run(build_disagg_app(config), host=args.host, port=args.port,
                log_level=args.log_level, access_log=not args.no_access_log,
                timeout_graceful_shutdown=None)
    return 0
