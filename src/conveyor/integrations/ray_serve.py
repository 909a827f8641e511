"""conveyor on a Ray cluster through Ray Serve (``pip install conveyor[ray]``).

    serve run conveyor.integrations.ray_serve:build_app model=/path/to/ckpt num_replicas=2

``build_app(args)`` returns a Ray Serve application: ``num_replicas`` replicas of one
deployment, each an engine (``AsyncEngine``) behind conveyor's own OpenAI app (the
FastAPI app ``conveyor serve`` runs, built on the replica at start). Ray Serve's proxy
routes requests over the replicas (its power-of-two-choices router: least queued of
two); conveyor's prefix-aware router stays with ``conveyor router``. Every other key is
an engine flag without its dashes (``tensor_parallel_size=2``,
``distributed_executor_backend=ray``, ``max_num_seqs=16``, ``warmup=false``), parsed by
the same CLI parser as ``conveyor serve``; ``num_cpus_per_replica`` sets the replica's
Ray resources (default 1).
"""

from __future__ import annotations

import argparse
from typing import Any

from ray import serve

from conveyor.config import EngineArgs

REPLICA_HEADER = "x-conveyor-replica"
# build_app keys that are not engine flags.
_APP_KEYS = ("num_replicas", "num_cpus_per_replica", "engine_core")


def engine_args_from(args: dict[str, Any]) -> EngineArgs:
    """Engine args from ``key=value`` pairs, through the CLI parser (types, choices,
    defaults as ``conveyor serve`` has them); ``true``/``false`` turn boolean flags
    on and off."""
    argv: list[str] = []
    for key, value in args.items():
        if key in _APP_KEYS:
            continue
        flag = "--" + key.replace("_", "-")
        text = str(value)
        if text.lower() in ("true", "false") and key not in ("model", "tokenizer"):
            argv.append(flag if text.lower() == "true" else "--no-" + flag[2:])
        else:
            argv += [flag, text]
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(prog="build_app"))
    return EngineArgs.from_cli_args(parser.parse_args(argv))


@serve.deployment
@serve.ingress()
class ConveyorReplica:
    """One engine and its OpenAI app; the app's lifespan starts and stops the engine."""

    def __init__(self, engine_args: EngineArgs, process: bool = False) -> None:
        from conveyor.engine.async_engine import AsyncEngine

        self.engine = AsyncEngine.from_engine_args(engine_args, process=process,
                                                   keep_metrics=False)

    def __serve_build_asgi_app__(self):
        from conveyor.entrypoints.openai.api_server import build_app as build_openai_app
        from conveyor.entrypoints.openai.api_server import make_state

        app = build_openai_app(make_state(self.engine))
        replica = serve.get_replica_context().replica_id.unique_id

        @app.middleware("http")
        async def _name_replica(request, call_next):  # which replica answered (logs, tests)
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = replica
            return response

        return app


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application ``serve run`` (or ``serve.run``) deploys."""
    engine_args = engine_args_from(args)
    replicas = int(args.get("num_replicas", 1))
    cpus = float(args.get("num_cpus_per_replica", 1))
    process = str(args.get("engine_core", "thread")) == "process"
    return ConveyorReplica.options(
        num_replicas=replicas, ray_actor_options={"num_cpus": cpus},
    ).bind(engine_args, process)
