"""OpenAI API response shapes, and :class:`BadRequest` (the request bodies are in
:mod:`raypp.entrypoints.openai.requests`)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class BadRequest(ValueError):
    """A request the server must refuse with 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Open(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- responses -----------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(_Open):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(_Open):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ModelCard(_Open):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "raypp"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Open):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(_Open):
    """OpenAI's legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Open):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Open):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(_Open):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_Open):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(_Open):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(_Open):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Open):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(_Open):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Open):
    """A piece of one tool call: the first names it (``id``, ``type``, ``function.name``);
    ``function.arguments`` pieces concatenate."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Open):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Open):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Open):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ErrorInfo(_Open):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Open):
    error: ErrorInfo



# -- /tokenize, /detokenize, /version ---------------------------------------------------------
class TokenizeResponse(_Open):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Open):
    prompt: str


class VersionResponse(_Open):
    version: str
