"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``.

What callers may rely on:

- Every documented field of OpenAI's two requests is accepted, with its JSON type
  checked strictly (a wrong type is a 400 naming the field). Fields that change the
  output and that a text-only engine cannot honour (``audio``, non-text
  ``modalities``, ``web_search_options``, a completions ``suffix``, non-text message
  parts) are a 400 naming the field; the rest are honoured, or change nothing here
  (``store``, ``metadata``, ``service_tier``, ``user``, ``prediction``, ``prompt_cache_key``,
  ``safety_identifier``, …).
- Unknown fields are kept (:attr:`pydantic.BaseModel.model_extra`), not refused: the
  server logs each name once (:func:`unknown_fields`).
- Besides OpenAI's fields, requests take raypp's sampling knobs (``top_k``, ``min_p``,
  ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
  ``include_stop_str_in_output``, ``skip_special_tokens``) and vLLM's structured-output
  fields (``structured_outputs``, ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``), which the ``openai`` client sends through ``extra_body``.
- :meth:`sampling_params` raises :class:`~raypp.entrypoints.openai.protocol.BadRequest`
  (or ``ValueError`` from :class:`~raypp.sampling_params.SamplingParams`) naming the
  field for anything invalid.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from raypp.entrypoints.openai.protocol import BadRequest
from raypp.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 128  # completions per prompt, as OpenAI caps it


class _Body(BaseModel):
    """Strict JSON types; unknown fields kept in ``model_extra``."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk
    include_obfuscation: bool | None = None  # no effect here


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` extra field."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # raypp extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's structured outputs (extra_body)
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options
                    and self.stream_options.continuous_usage_stats)

    def structured(self) -> tuple[str, StructuredOutputsParams] | None:
        """``(field, spec)`` of the one structured-output field given, or ``None``;
        :class:`BadRequest` if several are."""
        given: list[tuple[str, StructuredOutputsParams]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise BadRequest("response_format of type json_schema needs json_schema.schema",
                                 "response_format")
            given.append(("response_format",
                          StructuredOutputsParams(json=fmt.json_schema.json_schema)))
        so = self.structured_outputs
        if so is not None:
            given.append(("structured_outputs", _spec(
                "structured_outputs", json=so.json_, json_object=bool(so.json_object),
                regex=so.regex, choice=so.choice, grammar=so.grammar)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, _spec(name, **{kind: getattr(self, name)})))
        if len(given) > 1:
            raise BadRequest(f"give one structured-output field, not {given[0][0]} and "
                             f"{given[1][0]}", given[1][0])
        return given[0] if given else None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         structured: StructuredOutputsParams | None, n: int | None = None
                         ) -> SamplingParams:
        """``BadRequest`` / ``ValueError`` naming the field for an invalid value."""
        n = self.n if n is None else n
        if n > MAX_N:
            raise BadRequest(f"n must be at most {MAX_N}, got {n}", "n")
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
        }
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias or None,
            structured_outputs=structured,
            **{k: v for k, v in given.items() if v is not None},
        )


def _spec(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise BadRequest(f"{field}: {e}", field) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list; ``BadRequest`` if there are none."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequest("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters: ``best_of`` completions generated (``n`` returned)."""
        if self.echo and self.logprobs is not None:
            raise BadRequest("echo with logprobs is not supported (prompt logprobs are not "
                             "computed): drop one of them", "echo")
        if self.suffix:
            raise BadRequest("suffix (insertion) is not supported: send the prompt alone",
                             "suffix")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise BadRequest(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
            if self.stream and self.best_of > self.n:
                raise BadRequest("best_of > n cannot stream", "best_of")
        structured = self.structured()
        best_of = max(self.best_of or self.n, self.n)
        logprobs = self.logprobs if best_of == self.n or self.logprobs is not None else 0
        return self._sampling_params(self.max_tokens, logprobs,
                                     structured[1] if structured else None, n=best_of)


class ContentPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    function_call: FunctionCall | None = None  # deprecated form of one tool call

    def as_dict(self, index: int) -> dict[str, Any]:
        """The message as a chat template takes it: text content, and tool calls whose
        arguments are parsed into objects where they are JSON."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type not in ("text", "refusal"):
                    raise BadRequest(f"messages[{index}].content: part type {part.type!r} is not "
                                     "supported (this model takes text)", "messages")
                texts.append(part.text if part.type == "text" else part.refusal or "")
            content = "".join(t or "" for t in texts)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        calls = list(self.tool_calls or [])
        if self.function_call is not None:
            calls.append(ToolCall(function=self.function_call))
        if calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _parsed(c.function.arguments)}}
                for c in calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.role == "function":  # the deprecated form of a tool result
            out["role"] = "tool"
        elif self.role == "developer":  # OpenAI's newer name for the system message
            out["role"] = "system"
        return out


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[FunctionDefinition] | None = None  # deprecated: tools
    function_call: Literal["none", "auto"] | NamedFunction | None = None  # deprecated
    # OpenAI fields that change nothing a text-only engine does
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None  # passed to the chat template
    verbosity: str | None = None
    # OpenAI fields a text-only engine refuses (check_supported)
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """:class:`BadRequest` for fields that would change the output but cannot here."""
        if self.audio is not None:
            raise BadRequest("audio output is not supported: this server generates text", "audio")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise BadRequest(f"modalities {self.modalities} are not supported: only ['text']",
                             "modalities")
        if self.web_search_options is not None:
            raise BadRequest("web search is not supported by this server", "web_search_options")

    def tool_list(self) -> list[Tool]:
        """``tools``, or the deprecated ``functions`` as tools."""
        if self.tools is not None:
            return self.tools
        return [Tool(type="function", function=f) for f in self.functions or []]

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``none``, ``auto``, ``required`` or a named function (OpenAI's defaults: ``auto``
        with tools, else ``none``; ``function_call`` is the deprecated spelling)."""
        choice: Any = self.tool_choice
        if choice is None and self.function_call is not None:
            fc = self.function_call
            choice = fc if isinstance(fc, str) else NamedToolChoice(type="function", function=fc)
        if choice is None:
            return "auto" if self.tool_list() else "none"
        return choice

    def max_new_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise BadRequest("give max_tokens or max_completion_tokens, not both",
                             "max_completion_tokens")
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self, tool_spec: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's parameters; ``tool_spec``: the grammar that enforces a ``required``
        or named ``tool_choice`` (:mod:`raypp.entrypoints.openai.tools`)."""
        self.check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        structured = self.structured()
        if tool_spec is not None and structured is not None:
            raise BadRequest(f"tool_choice forces a tool call; {structured[0]} cannot apply too",
                             structured[0])
        spec = tool_spec or (structured[1] if structured else None)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.max_new_tokens(), logprobs, spec)


class TokenizeRequest(_Body):
    """``/tokenize``: a ``prompt``, or chat ``messages`` rendered as the chat endpoint does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[Tool] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def unknown_fields(body: BaseModel) -> list[str]:
    """Names of the fields of ``body`` (and its nested objects) that no model declares,
    dotted (``stream_options.foo``)."""
    out = [name for name in body.model_extra or {}]
    for name in type(body).model_fields:
        value = getattr(body, name)
        values = value if isinstance(value, list) else [value]
        for item in values:
            if isinstance(item, BaseModel):
                out.extend(f"{name}.{sub}" for sub in unknown_fields(item))
    return sorted(set(out))
