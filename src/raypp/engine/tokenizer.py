"""Tokenizer loading from the checkpoint directory (local files only)."""

from __future__ import annotations

from typing import Any


def load_tokenizer(model_dir: str) -> Any:
    """The checkpoint's Hugging Face fast tokenizer; ``ValueError`` if it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {model_dir!r}: {e}") from e
