"""``raypp generate | serve | bench | fetch`` (also ``python -m raypp``): parse and dispatch.

What callers may rely on: :func:`build_parser` registers every subcommand, each
setting ``func``; ``bench`` is left out when its modules cannot be imported (a slim
install), ``serve`` is always listed: without the server's extra, running it exits 1
with the ``pip install`` command that adds it. :func:`main` runs one and returns its
exit status: a user error (a bad option value, a model that is missing or not a model,
a request that does not fit: ``ValueError``, ``FileNotFoundError`` and their kin, also
when a stage raised it) prints one line ``raypp: error: …`` on stderr and returns 2,
with the traceback only under ``--debug`` (which also sets raypp's log level to DEBUG)
or ``RAYPP_LOG_LEVEL=DEBUG``. Every ``--help`` shows each option's default.

``main`` imports only the module of the command it runs (``raypp --help`` imports
none of them, so it answers without loading torch or Ray). The front door above both
rooms it dispatches to: :mod:`raypp.entrypoints` (generate, serve, fetch) and
:mod:`raypp.bench` (which reuses the engine options of :mod:`raypp.entrypoints.args`),
so neither imports the other's dispatcher.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Callable, Collection

from raypp import envs
from raypp.errors import first_line

_DESCRIPTION = ("Pipeline-parallel LLM inference on Ray. A MODEL is a Hugging Face–format "
                "directory, a .gguf file, 'demo', or a Hugging Face Hub id (org/name).")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from raypp.entrypoints.generate import add_generate_parser

    add_generate_parser(sub)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from raypp.entrypoints.openai.server import add_serve_parser

    add_serve_parser(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from raypp.bench.cli import add_bench_parser

    add_bench_parser(sub)


def _add_fetch(sub: argparse._SubParsersAction) -> None:
    from raypp.entrypoints.fetch import add_fetch_parser

    add_fetch_parser(sub)


# name -> (what registers the subcommand, importing its module; the subcommand's one-line
# help, shown while the subcommand is not loaded: tests/test_cli.py checks it against the
# module's own)
_COMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], None], str]] = {
    "generate": (_add_generate, "generate text for one or more prompts"),
    "serve": (_add_serve, "OpenAI-compatible HTTP server"),
    "bench": (_add_bench, "benchmarks: hop, throughput, latency, ..."),
    "fetch": (_add_fetch, "fetch a model into the cache and prepare it; print its path"),
}
_EXTRAS = {"serve": "serve", "bench": "bench"}  # the pip extra a command needs
_USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                PermissionError)


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default after its help, unless the help names it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default is None
                or default is False or default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``raypp`` parser. Commands in ``full`` (default: all) get their whole parser;
    the others only their name and help (so ``raypp --help`` imports no command)."""
    parser = argparse.ArgumentParser(prog="raypp", description=_DESCRIPTION,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="on an error, print the traceback; log at DEBUG")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (register, help_text) in _COMMANDS.items():
        if full is not None and name not in full:
            sub.add_parser(name, help=help_text)
            continue
        try:
            register(sub)
        except ImportError:
            if full is not None:
                raise
    _finish(parser)
    return parser


def _finish(parser: argparse.ArgumentParser) -> None:
    """Every subcommand parser (nested ones too) shows defaults and takes ``--debug``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.formatter_class = _HelpFormatter
                if "--debug" not in child._option_string_actions:
                    child.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                       help="on an error, print the traceback; log at DEBUG")
                _finish(child)


def _command(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    try:
        parser = build_parser(full=[command] if command in _COMMANDS else [])
    except ImportError as e:  # an install without the command's extra: not a usage error
        print(f"raypp: error: raypp {command} needs the '{_EXTRAS.get(command, command)}' "
              f"extra ({e.name or e} is not installed): pip install "
              f"'raypp[{_EXTRAS.get(command, command)}]'", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    debug = args.debug or (envs.RAYPP_LOG_LEVEL or "").upper() == "DEBUG"
    logging.basicConfig(level="DEBUG" if debug else (envs.RAYPP_LOG_LEVEL or "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if debug:
        logging.getLogger("raypp").setLevel(logging.DEBUG)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        error = _user_error(e)
        if error is None:
            raise
        if debug:
            traceback.print_exc()
        print(f"raypp: error: {first_line(error)}", file=sys.stderr)
        return 2


def _user_error(e: BaseException) -> BaseException | None:
    """The user error ``e`` is or carries (a Ray task error carries the stage's own
    exception as ``cause``), or ``None``."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, _USER_ERRORS):
        return cause
    return e if isinstance(e, _USER_ERRORS) else None


if __name__ == "__main__":
    sys.exit(main())
