"""The ``/v1/chat/completions`` handler: render the conversation (tools, tool calls and
tool results through the model's chat template), generate, and answer with text or
tool calls (:mod:`raypp.entrypoints.openai.tools`), whole or streamed.

What callers may rely on: everything :mod:`raypp.entrypoints.openai.serving` promises
for admission and running; a request's messages that the template cannot render are
a 400 naming ``messages``; streamed deltas (``content`` pieces, then
``tool_calls`` pieces) concatenate to the message a non-streaming request gets.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from raypp.entrypoints.openai import protocol as p
from raypp.entrypoints.openai import requests as rq
from raypp.entrypoints.openai.errors import APIError
from raypp.entrypoints.openai.logprobs import chat_logprobs
from raypp.entrypoints.openai.serving import Job, OpenAIServing, field_of, json_response
from raypp.entrypoints.openai.streaming import Deltas, sse, sse_response
from raypp.entrypoints.openai.tool_parsers import ToolParser
from raypp.entrypoints.openai.tools import ToolPlan, ToolStream, finish_reason, tool_calls_out
from raypp.sampling_params import SamplingParams


class ChatServing:
    """Chat completions over an :class:`OpenAIServing`, parsing tool calls with ``parser``."""

    def __init__(self, serving: OpenAIServing, parser: ToolParser):
        self.serving = serving
        self.parser = parser

    async def chat(self, req: rq.ChatCompletionRequest, request: Request) -> Response:
        serving = self.serving
        serving.note_unknown_fields(req, "/v1/chat/completions")
        req = serving.with_defaults(req)
        try:
            plan = ToolPlan.of(req, self.parser)
            req.check_supported()
            prompt = self._render(req, plan)
        except p.BadRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        tool_spec = plan.grammar()

        def make_params() -> SamplingParams:
            params = req.sampling_params(tool_spec)
            if plan.mode == "auto" and plan.parser.keeps_special_tokens:
                params.skip_special_tokens = False  # the format's markers are special tokens
            return params

        grammar_param = "tools" if tool_spec is not None else field_of(req.structured)
        job = await serving.admit("chatcmpl", req.model, [prompt], make_params, "messages",
                                  grammar_param)
        top = req.top_logprobs or 0
        if req.stream:
            return sse_response(job.request_id, self._events(job, req, plan, top))
        if not await serving.run_unary(request, job):
            return Response(status_code=499)
        choices = []
        for (_, k), c in sorted(job.final.items()):
            content, calls = plan.calls(self._clean(c.text, job.params))
            choices.append(p.ChatChoice(
                index=k, message=p.ChatResponseMessage(content=content,
                                                       tool_calls=tool_calls_out(calls)),
                logprobs=chat_logprobs(c, 0, len(c.token_ids), top) if req.logprobs else None,
                finish_reason=finish_reason(c.finish_reason, bool(calls))))
        return json_response(p.ChatCompletionResponse(id=job.request_id, model=job.model,
                                              choices=choices, usage=job.usage()))

    def _render(self, req: rq.ChatCompletionRequest, plan: ToolPlan) -> dict:
        from raypp.engine.tokenizer import render_chat

        tokenizer = self.serving.engine.tokenizer
        messages = [m.as_dict(i) for i, m in enumerate(req.messages)]
        kwargs: dict[str, Any] = {}
        if req.reasoning_effort is not None:
            kwargs["reasoning_effort"] = req.reasoning_effort
        try:
            text = render_chat(tokenizer, messages, tools=plan.template_tools, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise p.BadRequest(f"cannot render messages: {e}", "messages") from None
        # A real template writes its own special tokens (BOS); don't add them twice.
        templated = bool(getattr(tokenizer, "chat_template", None))
        ids = tokenizer.encode(text, add_special_tokens=not templated)
        return {"prompt": text, "prompt_token_ids": ids}

    def _clean(self, text: str, params: SamplingParams) -> str:
        """``text`` without special tokens other than the tool format's markers (kept
        only when the parser needs them)."""
        if params.skip_special_tokens:
            return text
        tokenizer = self.serving.engine.tokenizer
        for special in getattr(tokenizer, "all_special_tokens", []):
            if special and special not in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"):
                text = text.replace(special, "")
        return text

    async def _events(self, job: Job, req: rq.ChatCompletionRequest, plan: ToolPlan,
                      top: int) -> AsyncIterator[str]:
        def chunk(choices: list[p.ChatChunkChoice], usage: p.UsageInfo | None = None) -> str:
            if usage is None and req.continuous_usage and choices:
                usage = job.usage()
            return sse(p.ChatCompletionChunk(id=job.request_id, model=job.model, choices=choices,
                                             usage=usage, created=created))

        created = int(time.time())
        deltas = Deltas(job.params)
        streams = [ToolStream(plan) for _ in range(job.params.n)]
        for k in range(job.params.n):
            yield chunk([p.ChatChunkChoice(index=k, delta=p.DeltaMessage(role="assistant",
                                                                         content=""))])
        async with contextlib.aclosing(self.serving.outputs(job)) as outputs:
            async for _, out in outputs:
                for c in out.outputs:
                    step = deltas.get(0, c.index).advance(c)
                    if step is None:
                        continue
                    text, start, end = step
                    stream = streams[c.index]
                    pieces = stream.push(self._clean(text, job.params), c.finished)
                    logprobs = chat_logprobs(c, start, end, top) if req.logprobs else None
                    finish = (finish_reason(c.finish_reason, stream.has_calls)
                              if c.finished else None)
                    if not pieces and (finish is not None or logprobs is not None):
                        pieces = [p.DeltaMessage()]
                    for j, delta in enumerate(pieces):
                        last = j == len(pieces) - 1
                        yield chunk([p.ChatChunkChoice(index=c.index, delta=delta,
                                                       logprobs=logprobs if last else None,
                                                       finish_reason=finish if last else None)])
        if req.include_usage_in_stream:
            yield chunk([], job.usage())
