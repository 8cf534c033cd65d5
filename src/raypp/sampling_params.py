"""Sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    Invalid values raise ``ValueError`` naming the field. ``temperature=0`` is
    greedy; ``top_k`` of 0 or -1 and ``top_p=1`` disable those filters. ``seed``
    makes sampling reproducible whatever the batch-mates and pipeline layout.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "a number >= 0")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               "top_k", self.top_k, "-1, 0 (disabled) or a positive integer")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, value, "in [-2, 2]")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", self.repetition_penalty, "a number > 0")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an integer >= 1 or None")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
               "min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"<= max_tokens ({self.max_tokens})")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
               "seed", self.seed, "an integer or None")
        _check(all(isinstance(s, str) and s for s in self.stop_strings),
               "stop", self.stop, "a non-empty string or a list of them")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        _check(self.logprobs is None
               or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= _MAX_LOGPROBS),
               "logprobs", self.logprobs, f"None or an integer in [0, {_MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
