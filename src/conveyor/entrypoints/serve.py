"""``conveyor serve``: the OpenAI-compatible HTTP server (also ``python -m conveyor.serve``)."""

from __future__ import annotations

import argparse

DESCRIPTION = ("Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
               "/v1/chat/completions, /v1/models, /health, /metrics). With no --model, a "
               "tiny dummy-weight model is served.")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from conveyor.entrypoints.openai.api_server import add_server_args

    return add_server_args(parser)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve over an OpenAI-compatible HTTP API",
                       description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from conveyor.entrypoints.openai.api_server import run_server

    return run_server(args)
