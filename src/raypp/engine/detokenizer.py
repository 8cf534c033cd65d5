"""Incremental detokenization that never splits a multi-byte character."""

from __future__ import annotations

from typing import Any

from raypp.engine.sequence import Sequence

_PREFIX_WINDOW = 5  # prompt tokens decoded as context for the first output token


def init_offsets(seq: Sequence) -> None:
    seq.read_offset = len(seq.prompt_token_ids)
    seq.prefix_offset = max(0, seq.read_offset - _PREFIX_WINDOW)


def append_text(tokenizer: Any, seq: Sequence) -> str:
    """Extend ``seq.text`` with the text of tokens not yet shown; returns the delta.

    Text is held back while the newest tokens decode to an incomplete UTF-8
    sequence (U+FFFD), and released once the character is complete.
    """
    ids = seq.all_token_ids
    skip = seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix) :]
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    seq.text += delta
    return delta


def flush(tokenizer: Any, seq: Sequence) -> None:
    """Release held-back text once a sequence ends (incomplete bytes decode to U+FFFD)."""
    ids = seq.all_token_ids
    if seq.read_offset >= len(ids):
        return
    skip = seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    seq.text += full[len(prefix) :]
    seq.prefix_offset = seq.read_offset = len(ids)
