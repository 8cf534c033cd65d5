"""Finding tool calls in a model's own output format.

What callers may rely on: :meth:`ToolParser.parse` splits a completion into its text
content and the calls it makes, each :class:`ParsedCall` with its arguments as JSON
text; text that does not parse as calls stays content (a model that writes half a
call gets its text back, never an error). :meth:`ToolParser.call_start` tells a
stream where a call may begin, so text from there on is held back until the end.

Formats (``--tool-call-parser``; by default from the model family, :func:`parser_for`):

- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``,
  once per call.
- ``llama3_json`` (Llama 3.x): the whole reply is ``{"name": …, "parameters": {…}}``,
  several separated by ``;``, optionally after ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, or (newer
  tokenizers) ``name[ARGS]{…}`` per call, optionally with ``[CALL_ID]id``. Its marker is
  a special token, so requests parsed with it keep special tokens in their text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str = " \t\r\n") -> list[Any] | None:
    """Every JSON value in ``text``, back to back with only ``separators`` between; None
    if anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in separators:
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class ToolParser:
    """One model family's tool-call format (module docstring)."""

    name = ""
    keeps_special_tokens = False  # its markers are special tokens: detokenize them

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """``(content or None, calls)``; no calls: the whole text is content."""
        raise NotImplementedError

    def call_start(self, text: str) -> int:
        """The index in ``text`` from which a call may be under way (a marker, or a
        prefix of one at the end), else ``len(text)``."""
        raise NotImplementedError


def _marker_start(text: str, marker: str) -> int:
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


class HermesParser(ToolParser):
    name = "hermes"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            values = _json_values(body)
            call = _call(values[0]) if values and len(values) == 1 else None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls

    def call_start(self, text: str) -> int:
        return _marker_start(text, "<tool_call>")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self._TAG):
            body = body[len(self._TAG):]
        if not body.lstrip().startswith("{"):
            return text, []
        values = _json_values(body, separators=" \t\r\n;")
        calls = [_call(v, ("parameters", "arguments")) for v in values or []]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls  # type: ignore[return-value]

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        offset = len(text) - len(stripped)
        if stripped == "" or stripped.startswith("{") or self._TAG.startswith(stripped[:len(self._TAG)]):
            return offset
        return len(text)


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True
    _MARK = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*\S+?\s*)?\[ARGS\]")

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(self._MARK)
        if start < 0:
            return text, []
        content = text[:start].strip() or None
        calls: list[ParsedCall | None] = []
        for part in text[start:].split(self._MARK)[1:]:
            values = _json_values(part.strip())
            if values and len(values) == 1 and isinstance(values[0], list):
                calls.extend(_call(v) for v in values[0])
                continue
            calls.extend(self._named_calls(part))
        if not calls or any(c is None for c in calls):
            return text, []
        return content, calls  # type: ignore[return-value]

    def _named_calls(self, part: str) -> list[ParsedCall | None]:
        """``name[ARGS]{…}`` calls, back to back."""
        out: list[ParsedCall | None] = []
        i, decoder = 0, json.JSONDecoder()
        while part[i:].strip():
            m = self._NAMED.match(part, i)
            if m is None:
                return [None]
            try:
                args, i = decoder.raw_decode(part, m.end())
            except ValueError:
                return [None]
            out.append(_call({"name": m.group(1), "arguments": args}))
        return out

    def call_start(self, text: str) -> int:
        return _marker_start(text, self._MARK)


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
# the model family (config.json's model_type) -> its parser
FAMILY_PARSERS = {"qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                  "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral"}


def parser_for(name: str | None, model_type: str | None) -> ToolParser:
    """The parser called ``name``, else the model family's, else ``hermes``;
    ``ValueError`` for an unknown name."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; choose from "
                             f"{', '.join(sorted(PARSERS))}")
        return PARSERS[name]()
    return PARSERS[FAMILY_PARSERS.get(model_type or "", "hermes")]()
