"""``python -m conveyor.serve``: the same server as ``conveyor serve``."""

from __future__ import annotations

import argparse
import sys

from conveyor.entrypoints.serve import DESCRIPTION, add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.serve", description=DESCRIPTION)
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = list(argv)  # --data-parallel-size re-launches replicas with these
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
