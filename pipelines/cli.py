"""The ``graphmax`` console script: one sub-command per job module."""

from __future__ import annotations

import argparse
import sys

from gm_graphs.errors import GraphmaxError

from . import build, demo, eval, generate, tune


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphmax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for job in (build, generate, demo, tune, eval):
        job.register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except GraphmaxError as e:
        print(f"graphmax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
