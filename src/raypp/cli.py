"""``raypp generate | serve | bench`` (also ``python -m raypp``): parse and dispatch.

What callers may rely on: :func:`build_parser` registers every subcommand, each
setting ``func``; :func:`main` runs it and returns its exit status. ``serve`` and
``bench`` are left out when their modules cannot be imported (a slim install).
The front door above both rooms it dispatches to: :mod:`raypp.entrypoints` (generate,
serve) and :mod:`raypp.bench` (which reuses the engine options of
:mod:`raypp.entrypoints.args`), so neither imports the other's dispatcher.
"""

from __future__ import annotations

import argparse
import logging
import sys

from raypp import envs
from raypp.entrypoints.generate import add_generate_parser

_DESCRIPTION = "``raypp generate | serve | bench`` (also ``python -m raypp``)."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypp", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    try:
        from raypp.entrypoints.openai.server import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    try:
        from raypp.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=envs.RAYPP_LOG_LEVEL or "INFO",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
