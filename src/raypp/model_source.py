"""What a model name means: the one place a name becomes a local checkpoint path.

Every way of naming a model goes through :func:`resolve_model` — ``LLM(model)``, the
``MODEL`` argument and ``--model`` of every command, ``raypp fetch`` — so a name means
the same everywhere. A name is, in this order:

1. an existing local path: a Hugging Face–format directory, a ``.gguf`` file, or a
   directory holding one ``.gguf`` (which of these :class:`raypp.model_config.ModelConfig`
   decides);
2. :data:`DEMO` (``"demo"``): the demo model, SmolLM2-135M-Instruct's GGUF file,
   fetched into the cache on first use (:mod:`raypp.demo`).

Anything else raises :class:`ModelNotFoundError` saying what a model name may be.
(Hugging Face Hub ids are to slot in here as a third kind, downloaded into the cache.)
"""

from __future__ import annotations

from pathlib import Path

DEMO = "demo"
KINDS = (f"a Hugging Face–format directory (config.json + *.safetensors + tokenizer), "
         f"a .gguf file, or {DEMO!r} (the demo model)")


class ModelNotFoundError(FileNotFoundError):
    """A model name that is no local path and no name raypp knows."""


def resolve_model(name: str, cache_dir: str | Path, fetch: bool = True) -> Path:
    """The local path ``name`` stands for (not yet checked to be a model: see
    :class:`~raypp.model_config.ModelConfig`). ``cache_dir`` is where fetched models live;
    ``fetch=False`` raises ``FileNotFoundError`` instead of fetching one that is missing.
    ``ModelNotFoundError`` for a name that is neither."""
    if not isinstance(name, str) or not name:
        raise ModelNotFoundError(f"a model name must be a non-empty string, got {name!r}; "
                                 f"give {KINDS}")
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name == DEMO:
        from raypp.demo import demo_model_path

        return demo_model_path(cache_dir, fetch=fetch)
    raise ModelNotFoundError(f"model {name!r} not found: no such file or directory; "
                             f"a model is {KINDS}")
