"""``conveyor`` command line: serve | router | generate | bench | sim | profile.

Each subcommand lives in its own module and registers itself through
``add_parser(subparsers)`` returning the function to run, so this file only
dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module providing add_parser(subparsers) -> None (sets func default)
SUBCOMMANDS = {
    "generate": "conveyor.entrypoints.generate",
    "serve": "conveyor.entrypoints.serve",
    "router": "conveyor.entrypoints.router",
    "bench": "conveyor.bench.cli",
    "sim": "conveyor.sim.cli",
    "profile": "conveyor.sim.profile_cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``only`` just that subcommand's parser: building
    one imports its module, and `conveyor sim` must not pay for (or import) torch
    because `conveyor serve`'s options live next to the server."""
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    names = [only] if only in SUBCOMMANDS else list(SUBCOMMANDS)
    for module_name in (SUBCOMMANDS[name] for name in names):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue  # not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    # `conveyor bench` with no arguments is the main job; other commands need a subcommand.
    args = parser.parse_args(argv)
    if argv and argv[0] == "serve":
        args.argv = argv[1:]  # --data-parallel-size re-launches replicas with these
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
