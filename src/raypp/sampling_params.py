"""Sampling parameters, validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_MAX_LOGPROBS = 20
_MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """A grammar every generated token must follow: exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value
      that validates against it (compact: one space after ``:`` and ``,``),
    - ``json_object=True``: any JSON object,
    - ``regex``: the output matches this regular expression,
    - ``choice``: the output is one of these strings,
    - ``grammar``: an EBNF grammar (GBNF-style, rule ``root`` first).

    The grammar is compiled on the driver (cached per spec) by the engine's grammar
    library (xgrammar); a spec the library rejects fails the request with a
    ``ValueError`` carrying the library's message. Once the grammar is complete the
    sequence stops (``finish_reason="stop"``), whatever ``ignore_eos`` or ``min_tokens``
    say. ``max_tokens`` may still cut the output short (``finish_reason="length"``).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of "
                             f"{', '.join(_KINDS)}; got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
        _check(self.json is None or isinstance(self.json, (dict, bool)), "structured_outputs.json",
               self.json, "a JSON schema (an object)")
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex != ""),
               "structured_outputs.regex", self.regex, "a non-empty string")
        _check(self.choice is None or (isinstance(self.choice, list) and bool(self.choice)
                                       and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
               "structured_outputs.grammar", self.grammar, "a non-empty EBNF grammar")

    @property
    def kind(self) -> str:
        """Which of the fields is set (``json``, ``json_object``, ``regex``, …)."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """A hashable, canonical form: equal specs compile once."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind in ("json", "choice"):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return kind, str(value)


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
    # token id -> added to its logit before sampling, in [-100, 100] (the engine checks
    # the ids against the vocabulary)
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
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
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def shapes_logits(self) -> bool:
        """True if a grammar or a logit bias changes this request's logits before each
        token is sampled (such rows never loop on the device: the driver decides each
        token's mask)."""
        return self.structured_outputs is not None or bool(self.logit_bias)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _logit_bias(bias: Any) -> dict[int, float]:
    """``{token id: bias}`` from a dict whose keys are ints or their decimal strings
    (OpenAI's JSON form); ``ValueError`` naming the bad entry."""
    if not isinstance(bias, dict):
        raise ValueError(f"SamplingParams.logit_bias must be a dict of token id -> bias, got {bias!r}")
    out = {}
    for key, value in bias.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            token = int(key)
        _check(token is not None and token >= 0, "logit_bias", key, "keyed by token ids >= 0")
        _check(_is_number(value) and -_MAX_LOGIT_BIAS <= value <= _MAX_LOGIT_BIAS,
               "logit_bias", value, f"biases in [-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}] "
               f"(token {key})")
        out[token] = float(value)
    return out


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
