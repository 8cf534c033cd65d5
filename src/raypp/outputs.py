"""What ``LLM.generate`` and the async engine hand back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field

from raypp.errors import ErrorKind


@dataclass
class Logprob:
    """One candidate token's log-probability at one position."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions.

    ``logprobs`` is ``None`` unless requested; otherwise one dict per generated
    token mapping token id → :class:`Logprob`, always including the sampled token.
    ``finish_reason`` is ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or ``None``
    while running.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state: its prompt and its completions so far (or final).

    ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache instead
    of being computed (0 until the request is first scheduled, and with caching off).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    # set when the request failed (a stage raised, died or hung): what happened, and why
    # as a kind callers can branch on (``error_kind.retryable``: the engine recovers)
    error: str | None = None
    error_kind: ErrorKind | None = None
    num_cached_tokens: int = 0
