"""Incremental detokenization that never splits a multi-byte character.

Each sequence keeps two offsets into its tokens: text up to ``read_offset`` has
been emitted, and decoding restarts at ``prefix_offset`` so a token's text is
seen in context (byte-level BPE merges across token boundaries). Text is held
back while the newest tokens decode to an incomplete UTF-8 sequence (U+FFFD).
A step's sequences are decoded together in two batched calls into the Rust
tokenizer when the tokenizer allows it.
"""

from __future__ import annotations

from typing import Any

from raypp.engine.sequence import Sequence

_PREFIX_WINDOW = 5  # prompt tokens decoded as context for the first output token


def init_offsets(seq: Sequence) -> None:
    seq.read_offset = len(seq.prompt_token_ids)
    seq.prefix_offset = max(0, seq.read_offset - _PREFIX_WINDOW)


def append_text(tokenizer: Any, seqs: list[Sequence]) -> None:
    """Extend each sequence's ``text`` with the text of its tokens not yet shown."""
    for skip in (True, False):
        group = [s for s in seqs if s.params.skip_special_tokens is skip]
        if not group:
            continue
        prefixes = _decode_batch(tokenizer, [_tokens(s, s.prefix_offset, s.read_offset)
                                             for s in group], skip)
        fulls = _decode_batch(tokenizer, [_tokens(s, s.prefix_offset) for s in group], skip)
        for seq, prefix, full in zip(group, prefixes, fulls):
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                continue
            seq.text += full[len(prefix):]
            seq.prefix_offset, seq.read_offset = seq.read_offset, seq.num_tokens


def flush(tokenizer: Any, seq: Sequence) -> None:
    """Release held-back text once a sequence ends (incomplete bytes decode to U+FFFD)."""
    if seq.read_offset >= seq.num_tokens:
        return
    skip = seq.params.skip_special_tokens
    prefix, full = _decode_batch(tokenizer, [_tokens(seq, seq.prefix_offset, seq.read_offset),
                                             _tokens(seq, seq.prefix_offset)], skip)
    seq.text += full[len(prefix):]
    seq.prefix_offset = seq.read_offset = seq.num_tokens


def _tokens(seq: Sequence, start: int, end: int | None = None) -> list[int]:
    """``seq.all_token_ids[start:end]`` without copying the whole prompt."""
    prompt_len = len(seq.prompt_token_ids)
    end = seq.num_tokens if end is None else end
    if start >= prompt_len:
        return seq.output_token_ids[start - prompt_len:end - prompt_len]
    return seq.prompt_token_ids[start:end] + seq.output_token_ids[:max(0, end - prompt_len)]


def _decode_batch(tokenizer: Any, batches: list[list[int]], skip: bool) -> list[str]:
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # the Rust tokenizer directly: same text as tokenizer.decode, far less overhead
        return backend.decode_batch(batches, skip_special_tokens=skip)
    return [tokenizer.decode(ids, skip_special_tokens=skip) for ids in batches]
