"""Tokenizer loading from the checkpoint (local files only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model: str) -> Any:
    """The checkpoint's Hugging Face fast tokenizer; ``ValueError`` if it has none.

    ``model`` is a Hugging Face directory, or a ``.gguf`` file whose tokenizer
    transformers builds from the file's metadata.
    """
    from transformers import AutoTokenizer

    path = Path(model)
    kwargs: dict[str, Any] = {}
    if path.suffix == ".gguf" and path.is_file():
        model, kwargs["gguf_file"] = str(path.parent), path.name
    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True, **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {e}") from e
