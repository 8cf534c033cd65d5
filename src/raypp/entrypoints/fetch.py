"""``raypp fetch MODEL``: make a model ready to start fast, and print its local path.

What callers may rely on: the model is resolved as every command resolves it
(:mod:`raypp.model_source`: ``demo`` is fetched into the cache if missing, a Hub id into
the Hugging Face cache) and checked
as an engine would check it (:class:`~raypp.model_config.ModelConfig`: a supported
architecture; a GGUF file's config, tokenizer and tensor table are derived and cached,
:mod:`raypp.model.gguf_cache`); then its resolved path is the one line printed. Nothing
starts: no Ray, no stage. ``make`` runs ``raypp fetch demo`` at setup.
"""

from __future__ import annotations

import argparse

from raypp.entrypoints.args import add_model_args, model_name


def add_fetch_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``raypp fetch`` on the top-level CLI."""
    p = sub.add_parser("fetch", help="fetch a model into the cache and prepare it; print its path",
                       description="Fetch a model into the cache (the demo model: once), derive "
                                   "and cache what a start needs (a GGUF file's config and "
                                   "tokenizer), and print its local path.")
    add_model_args(p)
    p.set_defaults(func=run_fetch)


def run_fetch(args: argparse.Namespace) -> int:
    from raypp.config import cache_dir
    from raypp.model_config import ModelConfig

    print(ModelConfig(model_name(args), cache_dir=str(cache_dir()), revision=args.revision).model)
    return 0
