"""The ``/v1/models`` and ``/v1/completions`` handlers, and what every generating
endpoint shares: admission, running, usage (``/v1/chat/completions`` is
:mod:`raypp.entrypoints.openai.chat`).

What callers may rely on:

- A request is validated completely (model name, sampling options, every
  prompt, its grammar compiled) before any of it reaches the engine; a problem
  raises a 4xx :class:`~raypp.entrypoints.openai.errors.APIError` naming the field; a
  prompt plus ``max_tokens`` over ``max_model_len`` is a 400 naming both numbers
  (``code="context_length_exceeded"``). Compiling waits on the engine's compile thread,
  not on the event loop or the engine's loop: other requests keep streaming meanwhile.
- Sampling fields the client did not send take the model's generation-config defaults
  (``AsyncLLMEngine.sampling_defaults``).
- Fields no model declares are accepted and logged once per name (debug).
- ``best_of`` > ``n``: ``best_of`` completions are generated per prompt and the ``n``
  with the highest sum of token logprobs returned.
- Each prompt becomes one engine request (``n`` completions each); choice
  ``index`` is ``prompt_index * n + completion_index``.
- A non-streaming request whose client disconnects is aborted (its KV blocks
  freed) and answered 499; an engine failure is answered as
  :func:`~raypp.entrypoints.openai.errors.generation_failure` says.
- Every request's tokens, timings and outcome go to the server's metrics; ``usage``
  reports the prompt tokens the prefix cache supplied as
  ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from raypp.engine.async_engine import AsyncLLMEngine
from raypp.entrypoints.metrics import RequestTracker, ServerMetrics
from raypp.entrypoints.openai import protocol as p
from raypp.entrypoints.openai import requests as rq
from raypp.entrypoints.openai.errors import APIError, generation_failure
from raypp.entrypoints.openai.logprobs import completion_logprobs
from raypp.entrypoints.openai.streaming import Deltas, merge, sse, sse_response, unless_disconnected
from raypp.errors import ContextLengthError
from raypp.outputs import CompletionOutput, RequestOutput
from raypp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


@dataclass
class Job:
    """One admitted HTTP request: its prompts (one engine request each) and accounting."""

    request_id: str
    model: str
    prompts: list[dict]
    params: SamplingParams
    tracker: RequestTracker
    final: dict[tuple[int, int], CompletionOutput] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per prompt: from the cache

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt["prompt_token_ids"]) for prompt in self.prompts)

    def usage(self) -> p.UsageInfo:
        completion = sum(len(c.token_ids) for c in self.final.values())
        return p.UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                           total_tokens=self.prompt_tokens + completion,
                           prompt_tokens_details=p.PromptTokensDetails(
                               cached_tokens=sum(self.cached_tokens.values())))

    def choice_index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.params.n + completion_index


class OpenAIServing:
    """The endpoints' logic over one engine; ``served_model_names[0]`` is the default model."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics,
                 served_model_names: list[str], model_path: str):
        self.engine = engine
        self.metrics = metrics
        self.served_model_names = served_model_names
        self.model_path = model_path
        self._unknown_logged: set[str] = set()

    def note_unknown_fields(self, body: BaseModel, endpoint: str) -> None:
        """Log each field name no model declares, once per server (debug)."""
        for name in rq.unknown_fields(body):
            if name not in self._unknown_logged:
                self._unknown_logged.add(name)
                logger.debug("%s: ignoring the unknown request field %r", endpoint, name)

    # -- /v1/models -------------------------------------------------------------------------
    def models(self) -> Response:
        return json_response(p.ModelList(data=[
            p.ModelCard(id=name, root=self.model_path, max_model_len=self.engine.max_model_len)
            for name in self.served_model_names
        ]))

    # -- /tokenize, /detokenize -----------------------------------------------------------
    def tokenize(self, req: rq.TokenizeRequest) -> Response:
        """The prompt's token ids, or those the chat endpoint would feed for ``messages``."""
        from raypp.engine.tokenizer import render_chat

        self._model_name(req.model)
        tokenizer = self.engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give prompt or messages (one of them)", param="prompt")
        if req.prompt is not None:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            assert req.messages is not None
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
            try:
                text = render_chat(tokenizer, [m.as_dict(i) for i, m in enumerate(req.messages)],
                                   tools=tools)
            except Exception as e:  # noqa: BLE001 - the request's messages
                raise APIError(400, f"cannot render messages: {e}", param="messages") from None
            templated = bool(getattr(tokenizer, "chat_template", None))
            ids = tokenizer.encode(text, add_special_tokens=not templated)
        return json_response(p.TokenizeResponse(count=len(ids), tokens=ids,
                                                max_model_len=self.engine.max_model_len))

    def detokenize(self, req: rq.DetokenizeRequest) -> Response:
        self._model_name(req.model)
        vocab = self.engine.engine.config.model.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return json_response(p.DetokenizeResponse(prompt=self.engine.tokenizer.decode(req.tokens)))

    # -- /v1/completions --------------------------------------------------------------------
    async def completions(self, req: rq.CompletionRequest, request: Request) -> Response:
        self.note_unknown_fields(req, "/v1/completions")
        req = self.with_defaults(req)
        try:
            prompts = req.prompts()
        except p.BadRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        structured = field_of(req.structured)
        job = await self.admit("cmpl", req.model, prompts, req.sampling_params, "prompt",
                               structured)
        if req.stream:
            return sse_response(job.request_id, self._completion_events(job, req))
        if not await self.run_unary(request, job):
            return Response(status_code=499)
        n = req.n
        choices = []
        for i in range(len(job.prompts)):
            best = sorted((c for (j, _), c in job.final.items() if j == i),
                          key=lambda c: (-_cumulative_logprob(c), c.index) if n < job.params.n
                          else c.index)[:n]
            for k, c in enumerate(best):
                prefix = self._prompt_text(job, i) if req.echo else ""
                logprobs = None
                if req.logprobs is not None:
                    logprobs, _ = completion_logprobs(c, 0, len(c.token_ids), len(prefix))
                choices.append(p.CompletionChoice(index=i * n + k, text=prefix + c.text,
                                                  logprobs=logprobs, finish_reason=c.finish_reason))
        return json_response(p.CompletionResponse(id=job.request_id, model=job.model,
                                          choices=choices, usage=job.usage()))

    async def _completion_events(self, job: Job, req: rq.CompletionRequest) -> AsyncIterator[str]:
        def chunk(choices: list[p.CompletionChoice], usage: p.UsageInfo | None = None) -> str:
            if usage is None and req.continuous_usage and choices:
                usage = job.usage()
            return sse(p.CompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                            usage=usage, created=created))

        created = int(time.time())
        deltas = Deltas(job.params)
        if req.echo:
            for i in range(len(job.prompts)):
                text = self._prompt_text(job, i)
                for k in range(job.params.n):
                    deltas.get(i, k).text_offset = len(text)
                    yield chunk([p.CompletionChoice(index=job.choice_index(i, k), text=text)])
        async with contextlib.aclosing(self.outputs(job)) as outputs:
            async for i, out in outputs:
                for c in out.outputs:
                    step = deltas.get(i, c.index).advance(c)
                    if step is None:
                        continue
                    text, start, end = step
                    logprobs = None
                    if req.logprobs is not None:
                        d = deltas.get(i, c.index)
                        logprobs, d.text_offset = completion_logprobs(c, start, end, d.text_offset)
                    choice = p.CompletionChoice(index=job.choice_index(i, c.index), text=text,
                                                logprobs=logprobs, finish_reason=c.finish_reason)
                    yield chunk([choice])
        if req.include_usage_in_stream:
            yield chunk([], job.usage())

    def _prompt_text(self, job: Job, i: int) -> str:
        prompt = job.prompts[i]
        if prompt.get("prompt") is not None:
            return prompt["prompt"]
        return self.engine.tokenizer.decode(prompt["prompt_token_ids"])

    # -- admission and running ----------------------------------------------------------------
    def with_defaults(self, req: Any) -> Any:
        """``req`` with the model's sampling defaults (its generation config) in the fields
        the client did not send (or sent as null)."""
        unset = {k: v for k, v in self.engine.sampling_defaults.items()
                 if k in type(req).model_fields and getattr(req, k) is None}
        return req.model_copy(update=unset) if unset else req

    def _model_name(self, requested: str | None) -> str:
        names = self.served_model_names
        if requested is None:
            return names[0]
        if requested not in names:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                           f"{', '.join(map(repr, names))}", param="model", code="model_not_found")
        return requested

    async def admit(self, prefix: str, model: str | None, prompts: list[Any],
                    make_params: Callable[[], SamplingParams], prompt_param: str,
                    grammar_param: str | None) -> Job:
        """Validate everything (400 on any problem) and compile the request's grammar
        before it reaches the engine; ``grammar_param`` names the field it came from."""
        name = self._model_name(model)
        try:
            params = make_params()
            self.engine.validate_params(params)
        except p.BadRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, str(e), param=_param_of(str(e))) from None
        try:
            prepared = [self.engine.prepare_prompt(prompt, params) for prompt in prompts]
        except ContextLengthError as e:  # names the prompt's tokens, max_tokens, max_model_len
            param = "max_tokens" if e.field == "max_tokens" else prompt_param
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e), param=prompt_param) from None
        try:
            await self.engine.compile_grammar(params)
        except ValueError as e:
            raise APIError(400, str(e), param=grammar_param) from None
        job = Job(f"{prefix}-{uuid.uuid4().hex}", name, prepared, params, self.metrics.tracker())
        job.tracker.admitted(job.prompt_tokens)
        return job

    async def outputs(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every update of every prompt of ``job``, recording metrics and final outputs."""
        gens = [self.engine.generate(prompt, job.params, f"{job.request_id}-{i}")
                for i, prompt in enumerate(job.prompts)]
        failed = False
        try:
            async with contextlib.aclosing(merge(gens)) as merged:
                async for i, out in merged:
                    job.tracker.update(out, i)
                    job.cached_tokens[i] = out.num_cached_tokens
                    for c in out.outputs:
                        job.final[(i, c.index)] = c
                    yield i, out
        except Exception:
            failed = True
            raise
        finally:
            reasons = [c.finish_reason for c in job.final.values()]
            reasons += [None] * (len(job.prompts) * job.params.n - len(reasons))
            job.tracker.finish(["error" if failed and r is None else r for r in reasons])

    async def run_unary(self, request: Request, job: Job) -> bool:
        """Run ``job`` to completion; False if the client went away first (then aborted)."""

        async def drain() -> None:
            async with contextlib.aclosing(self.outputs(job)) as outputs:
                async for _ in outputs:
                    pass

        try:
            return await unless_disconnected(request, drain())
        except Exception as e:  # noqa: BLE001 - every engine failure gets an error body
            raise generation_failure(e) from None


def _param_of(message: str) -> str | None:
    """``SamplingParams.top_p must …`` → ``top_p``; ``logit_bias: …`` → ``logit_bias``."""
    head = "SamplingParams."
    if message.startswith(head):
        return message[len(head):].split(" ", 1)[0].split(".", 1)[0]
    if message.startswith("logit_bias:"):
        return "logit_bias"
    return None


def field_of(structured: Callable[[], tuple[str, Any] | None]) -> str | None:
    """The request field a grammar comes from (for its 400s); ``None`` if it has none
    or the fields are invalid (:meth:`admit` reports that)."""
    try:
        found = structured()
    except ValueError:
        return None
    return found[0] if found else None


def _cumulative_logprob(c: CompletionOutput) -> float:
    return sum(lps[t].logprob for t, lps in zip(c.token_ids, c.logprobs or []))
