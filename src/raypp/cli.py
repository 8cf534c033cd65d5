"""``raypp generate | serve | bench`` (also ``python -m raypp``): parse and dispatch.

What callers may rely on: :func:`build_parser` registers every subcommand, each
setting ``func``; :func:`main` runs it and returns its exit status. ``serve`` is
always listed: without the server's extra installed it exits 1 with the ``pip install``
command that adds it. ``bench`` is left out when its modules cannot be imported.
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
    except ImportError as e:
        _add_missing_extra(sub, "serve", "OpenAI-compatible HTTP server", "serve", e)
    else:
        add_serve_parser(sub)
    try:
        from raypp.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def _add_missing_extra(sub: argparse._SubParsersAction, name: str, help: str, extra: str,
                       error: ImportError) -> None:
    """List ``name`` anyway; running it says which extra to install (exit status 1)."""
    command = f"pip install 'raypp[{extra}]'"
    parser = sub.add_parser(name, help=f"{help} (needs: {command})", add_help=False)

    def missing(_: argparse.Namespace) -> int:
        print(f"raypp {name} needs the '{extra}' extra ({error.name or error} is not "
              f"installed): {command}", file=sys.stderr, flush=True)
        return 1

    parser.set_defaults(func=missing, accepts_any_arguments=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=envs.RAYPP_LOG_LEVEL or "INFO",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
