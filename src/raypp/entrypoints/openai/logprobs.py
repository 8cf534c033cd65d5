"""The engine's per-token logprobs in OpenAI's two formats.

What callers may rely on: both functions cover tokens ``[start, end)`` of a
completion, list alternatives by rank, and clamp ``-inf`` to ``-9999.0`` (JSON
has no infinity).
"""

from __future__ import annotations

from raypp.entrypoints.openai import protocol as p
from raypp.outputs import CompletionOutput, Logprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _by_rank(candidates: dict[int, Logprob]) -> list[Logprob]:
    return sorted(candidates.values(), key=lambda lp: lp.rank)


def completion_logprobs(c: CompletionOutput, start: int, end: int,
                        offset: int) -> tuple[p.CompletionLogprobs, int]:
    """OpenAI's legacy completions format; also the text offset after the last token."""
    out = p.CompletionLogprobs()
    for token, candidates in zip(c.token_ids[start:end], (c.logprobs or [])[start:end],
                                 strict=False):
        chosen = candidates[token]
        text = chosen.decoded_token or ""
        out.tokens.append(text)
        out.token_logprobs.append(_lp(chosen.logprob))
        top: dict[str, float] = {}
        for lp in _by_rank(candidates):
            top.setdefault(lp.decoded_token or "", _lp(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out, offset


def chat_logprobs(c: CompletionOutput, start: int, end: int, top: int) -> p.ChatLogprobs:
    """The chat format, with the ``top`` best alternatives of each token."""
    content = []
    for token, candidates in zip(c.token_ids[start:end], (c.logprobs or [])[start:end],
                                 strict=False):
        chosen = candidates[token]
        alternatives = [
            p.TopLogprob(token=lp.decoded_token or "", logprob=_lp(lp.logprob),
                         bytes=list((lp.decoded_token or "").encode()))
            for lp in _by_rank(candidates) if lp.rank <= top
        ]
        text = chosen.decoded_token or ""
        content.append(p.ChatTokenLogprob(token=text, logprob=_lp(chosen.logprob),
                                          bytes=list(text.encode()), top_logprobs=alternatives))
    return p.ChatLogprobs(content=content)
