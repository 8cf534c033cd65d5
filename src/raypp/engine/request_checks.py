"""The checks a request passes before it is queued, in plain Python (no torch, no Ray),
so the command line runs them before anything starts and the engine, ``LLM`` and the
server run the same ones.

What callers may rely on: each raises ``ValueError`` with an actionable message; the
length checks raise :class:`~raypp.errors.ContextLengthError` (a ``ValueError``) naming
the numbers involved and the request field to change (``field``: ``"prompt"`` or
``"max_tokens"``). A request without ``max_tokens`` is bounded by the context: it stops
with ``finish_reason="length"`` at ``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Sequence

from raypp.errors import ContextLengthError


def check_prompt(token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """The prompt is non-empty, leaves room for one token, and holds vocabulary ids only."""
    if not token_ids:
        raise ValueError("prompt is empty: give at least one token")
    if len(token_ids) >= max_model_len:
        raise ContextLengthError(
            f"prompt has {len(token_ids)} tokens, but max_model_len is {max_model_len} and at "
            "least one token must be generated: shorten the prompt", "prompt")
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")


def check_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """``max_tokens`` fits what the context leaves after the prompt (``None`` always fits:
    generation then stops at the context's end)."""
    room = max_model_len - num_prompt_tokens
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthError(
            f"max_tokens={max_tokens} is more than the context leaves: the prompt has "
            f"{num_prompt_tokens} tokens and max_model_len is {max_model_len}, so at most "
            f"{room} can be generated; lower max_tokens, or leave it out to stop at the "
            "context's end", "max_tokens")
