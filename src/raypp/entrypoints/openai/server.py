"""``raypp serve MODEL -pp N``: the OpenAI-compatible server as a command.

What callers may rely on: :func:`run_server` starts the engine, serves until
interrupted (uvicorn), then shuts the engine down; it raises
:class:`~raypp.entrypoints.args.UsageError` without a model (``MODEL``, ``--model`` or
``--demo``). The API key is ``--api-key``, else ``RAYPP_API_KEY``, else none:
this command is the one place the server's own configuration reads the
environment.
"""

from __future__ import annotations

import argparse

from raypp import envs
from raypp.engine.async_engine import AsyncLLMEngine
from raypp.engine.engine import LLMEngine
from raypp.entrypoints.args import add_engine_args, add_model_args, engine_config, model_name
from raypp.entrypoints.openai.app import DEFAULT_MAX_REQUEST_BYTES, ServerConfig, build_app
from raypp.entrypoints.openai.tool_parsers import PARSERS


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """``raypp serve MODEL …`` (called by the CLI)."""
    parser = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* "
                             "(default: RAYPP_API_KEY, else no key)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the model as named)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="larger request bodies get 413")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                        help="the tool-call format to parse (default: the model family's: "
                             "hermes for Qwen, llama3_json for Llama, mistral for Mistral)")
    parser.add_argument("--log-level", default="info", help="uvicorn log level")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_args(parser)
    parser.set_defaults(func=run_server)


def run_server(args: argparse.Namespace) -> int:
    """Start the engine, serve until interrupted, then shut the engine down."""
    import uvicorn

    model = model_name(args)
    names = args.served_model_name or [model]
    engine_cfg = engine_config(model, args)  # the model and every option, before anything starts
    engine = AsyncLLMEngine(LLMEngine(engine_cfg), collect_stage_times=True)
    try:
        config = ServerConfig(names, engine_cfg.model.model, args.api_key or envs.RAYPP_API_KEY,
                              args.max_request_bytes, args.tool_call_parser)
        uvicorn.run(build_app(engine, config), host=args.host, port=args.port,
                    log_level=args.log_level, access_log=args.access_log)
    finally:
        engine.shutdown()
    return 0
