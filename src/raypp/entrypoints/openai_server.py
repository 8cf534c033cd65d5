"""OpenAI-compatible HTTP server: ``raypp serve MODEL -pp N``.

FastAPI + uvicorn over :class:`AsyncLLMEngine`. Endpoints: ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as SSE
ending in ``data: [DONE]``), ``GET /health`` (200 only while every stage answers
and the last step worked, else 503) and ``GET /metrics`` (Prometheus text).

What clients may rely on: every refused request gets a 4xx with an OpenAI-style
body ``{"error": {"message", "type", "param", "code"}}`` and the server keeps
serving; a client that disconnects (streaming or not) aborts its engine
requests, which frees their KV blocks; request bodies over
``max_request_bytes`` get 413 before they are parsed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from raypp import envs
from raypp.engine.async_engine import AsyncLLMEngine, GenerationError
from raypp.entrypoints import protocol as p
from raypp.entrypoints.metrics import CONTENT_TYPE, RequestTracker, ServerMetrics
from raypp.errors import EngineDeadError
from raypp.outputs import CompletionOutput, Logprob, RequestOutput
from raypp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
_MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


class APIError(Exception):
    """Answered as an OpenAI-style error body with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


# -- the app -----------------------------------------------------------------------------
def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The ASGI app; the caller owns ``engine`` (and shuts it down)."""
    app = FastAPI(title="raypp", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics()
    server = _Handlers(engine, config, metrics)
    app.state.raypp = server
    app.add_middleware(_BodySizeLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(_CountStatus, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}",
                              "internal_server_error")

    @app.get("/health")
    async def health() -> Response:
        if await asyncio.to_thread(engine.is_healthy):
            return Response(status_code=200)
        return error_response(503, "unhealthy: a pipeline stage is down or the last step "
                              "failed", "service_unavailable")

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(engine), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        server.authorize(request)
        return _json(server.model_list())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        server.authorize(request)
        req = _parse(p.CompletionRequest, await request.body())
        return await server.completions(req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        server.authorize(request)
        req = _parse(p.ChatCompletionRequest, await request.body())
        return await server.chat(req, request)

    return app


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"request body is not valid JSON: {first['msg']}") from None
        loc = [str(part) for part in first["loc"]]
        where = ".".join(loc) or "body"
        raise APIError(400, f"{where}: {first['msg']}", param=loc[0] if loc else None) from None


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _sse(model: BaseModel | dict) -> str:
    data = json.dumps(model) if isinstance(model, dict) else model.model_dump_json()
    return f"data: {data}\n\n"


# -- request handling ------------------------------------------------------------------------
@dataclass
class _Job:
    """One admitted HTTP request: its prompts (one engine request each) and accounting."""

    request_id: str
    model: str
    prompts: list[dict]
    params: SamplingParams
    tracker: RequestTracker
    final: dict[tuple[int, int], CompletionOutput] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt["prompt_token_ids"]) for prompt in self.prompts)

    def usage(self) -> p.UsageInfo:
        completion = sum(len(c.token_ids) for c in self.final.values())
        return p.UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                           total_tokens=self.prompt_tokens + completion)

    def choice_index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.params.n + completion_index


class _Handlers:
    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig, metrics: ServerMetrics):
        self.engine = engine
        self.config = config
        self.metrics = metrics

    # -- common --------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    def model_list(self) -> p.ModelList:
        return p.ModelList(data=[
            p.ModelCard(id=name, root=self.config.model_path,
                        max_model_len=self.engine.max_model_len)
            for name in self.config.served_model_names
        ])

    def _model_name(self, requested: str | None) -> str:
        names = self.config.served_model_names
        if requested is None:
            return names[0]
        if requested not in names:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                           f"{', '.join(map(repr, names))}", param="model", code="model_not_found")
        return requested

    def _admit(self, prefix: str, model: str | None, prompts: list[Any],
               make_params: Callable[[], SamplingParams], prompt_param: str) -> _Job:
        """Validate everything (400 on any problem) before a request reaches the engine."""
        name = self._model_name(model)
        try:
            params = make_params()
        except p.BadRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, str(e), param=_param_of(str(e))) from None
        try:
            prepared = [self.engine.prepare_prompt(prompt) for prompt in prompts]
        except ValueError as e:
            raise APIError(400, str(e), param=prompt_param) from None
        job = _Job(f"{prefix}-{uuid.uuid4().hex}", name, prepared, params, self.metrics.tracker())
        job.tracker.admitted(job.prompt_tokens)
        return job

    async def _outputs(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every update of every prompt of ``job``, recording metrics and final outputs."""
        gens = [self.engine.generate(prompt, job.params, f"{job.request_id}-{i}")
                for i, prompt in enumerate(job.prompts)]
        failed = False
        try:
            async with contextlib.aclosing(_merge(gens)) as merged:
                async for i, out in merged:
                    job.tracker.update(out, i)
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

    async def _run_unary(self, request: Request, job: _Job) -> bool:
        """Run ``job`` to completion; False if the client went away first (then aborted)."""

        async def drain() -> None:
            async with contextlib.aclosing(self._outputs(job)) as outputs:
                async for _ in outputs:
                    pass

        try:
            return await _unless_disconnected(request, drain())
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        except ValueError as e:  # rejected by the engine itself
            raise APIError(400, str(e)) from None
        except GenerationError as e:
            kind = e.output.error_kind
            if kind is not None and kind.retryable:  # the workers are being replaced
                raise APIError(503, f"pipeline unavailable, retry: {e}",
                               "service_unavailable") from None
            raise APIError(500, f"generation failed: {e}", "internal_server_error") from None
        except Exception as e:  # noqa: BLE001 - a failed pipeline step
            raise APIError(500, f"generation failed: {e}", "internal_server_error") from None

    def _streaming(self, job: _Job, events: AsyncIterator[str]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            async with contextlib.aclosing(events) as it:
                try:
                    async for event in it:
                        yield event
                except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
                    logger.warning("stream %s failed: %s", job.request_id, e)
                    yield _sse({"error": {"message": f"generation failed: {e}",
                                          "type": "internal_server_error", "param": None,
                                          "code": None}})
            yield "data: [DONE]\n\n"

        return _SSEResponse(body(), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- /v1/completions --------------------------------------------------------------------
    async def completions(self, req: p.CompletionRequest, request: Request) -> Response:
        try:
            prompts = req.prompts()
        except p.BadRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        job = self._admit("cmpl", req.model, prompts, req.sampling_params, "prompt")
        if req.stream:
            return self._streaming(job, self._completion_events(job, req))
        if not await self._run_unary(request, job):
            return Response(status_code=499)
        choices = []
        for (i, k), c in sorted(job.final.items(), key=lambda kv: job.choice_index(*kv[0])):
            prefix = self._prompt_text(job, i) if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                logprobs, _ = _completion_logprobs(c, 0, len(c.token_ids), len(prefix))
            choices.append(p.CompletionChoice(index=job.choice_index(i, k), text=prefix + c.text,
                                              logprobs=logprobs, finish_reason=c.finish_reason))
        return _json(p.CompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                          usage=job.usage()))

    async def _completion_events(self, job: _Job, req: p.CompletionRequest) -> AsyncIterator[str]:
        def chunk(choices: list[p.CompletionChoice], usage: p.UsageInfo | None = None) -> str:
            return _sse(p.CompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                             usage=usage, created=created))

        created = int(time.time())
        deltas = _Deltas(job.params)
        if req.echo:
            for i in range(len(job.prompts)):
                text = self._prompt_text(job, i)
                for k in range(job.params.n):
                    deltas.get(i, k).text_offset = len(text)
                    yield chunk([p.CompletionChoice(index=job.choice_index(i, k), text=text)])
        async with contextlib.aclosing(self._outputs(job)) as outputs:
            async for i, out in outputs:
                for c in out.outputs:
                    step = deltas.get(i, c.index).advance(c)
                    if step is None:
                        continue
                    text, start, end = step
                    logprobs = None
                    if req.logprobs is not None:
                        d = deltas.get(i, c.index)
                        logprobs, d.text_offset = _completion_logprobs(c, start, end, d.text_offset)
                    choice = p.CompletionChoice(index=job.choice_index(i, c.index), text=text,
                                                logprobs=logprobs, finish_reason=c.finish_reason)
                    yield chunk([choice])
        if req.include_usage_in_stream:
            yield chunk([], job.usage())

    def _prompt_text(self, job: _Job, i: int) -> str:
        prompt = job.prompts[i]
        if prompt.get("prompt") is not None:
            return prompt["prompt"]
        return self.engine.tokenizer.decode(prompt["prompt_token_ids"])

    # -- /v1/chat/completions ---------------------------------------------------------------
    async def chat(self, req: p.ChatCompletionRequest, request: Request) -> Response:
        prompt = self._render_chat(req)
        job = self._admit("chatcmpl", req.model, [prompt], req.sampling_params, "messages")
        top = req.top_logprobs or 0
        if req.stream:
            return self._streaming(job, self._chat_events(job, req, top))
        if not await self._run_unary(request, job):
            return Response(status_code=499)
        choices = [
            p.ChatChoice(index=k, message=p.ChatResponseMessage(content=c.text),
                         logprobs=_chat_logprobs(c, 0, len(c.token_ids), top)
                         if req.logprobs else None,
                         finish_reason=c.finish_reason)
            for (_, k), c in sorted(job.final.items())
        ]
        return _json(p.ChatCompletionResponse(id=job.request_id, model=job.model,
                                              choices=choices, usage=job.usage()))

    def _render_chat(self, req: p.ChatCompletionRequest) -> dict:
        from raypp.entrypoints.chat import render_chat

        tokenizer = self.engine.tokenizer
        try:
            text = render_chat(tokenizer, [m.as_dict() for m in req.messages])
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise APIError(400, f"cannot render messages: {e}", param="messages") from None
        # A real template writes its own special tokens (BOS); don't add them twice.
        templated = bool(getattr(tokenizer, "chat_template", None))
        ids = tokenizer.encode(text, add_special_tokens=not templated)
        return {"prompt": text, "prompt_token_ids": ids}

    async def _chat_events(self, job: _Job, req: p.ChatCompletionRequest,
                           top: int) -> AsyncIterator[str]:
        def chunk(choices: list[p.ChatChunkChoice], usage: p.UsageInfo | None = None) -> str:
            return _sse(p.ChatCompletionChunk(id=job.request_id, model=job.model, choices=choices,
                                              usage=usage, created=created))

        created = int(time.time())
        deltas = _Deltas(job.params)
        for k in range(job.params.n):
            yield chunk([p.ChatChunkChoice(index=k, delta=p.DeltaMessage(role="assistant",
                                                                         content=""))])
        async with contextlib.aclosing(self._outputs(job)) as outputs:
            async for _, out in outputs:
                for c in out.outputs:
                    step = deltas.get(0, c.index).advance(c)
                    if step is None:
                        continue
                    text, start, end = step
                    logprobs = _chat_logprobs(c, start, end, top) if req.logprobs else None
                    choice = p.ChatChunkChoice(index=c.index, delta=p.DeltaMessage(content=text),
                                               logprobs=logprobs, finish_reason=c.finish_reason)
                    yield chunk([choice])
        if req.include_usage_in_stream:
            yield chunk([], job.usage())


def _param_of(message: str) -> str | None:
    """``SamplingParams.top_p must …`` → ``top_p``."""
    head = "SamplingParams."
    if message.startswith(head):
        return message[len(head):].split(" ", 1)[0]
    return None


# -- streaming helpers ---------------------------------------------------------------------
class _Delta:
    """What one completion has sent so far. Text that could still turn out to be
    the start of a stop string is held back until it cannot (or the end)."""

    def __init__(self, hold: int):
        self.hold = hold
        self.sent_chars = 0
        self.sent_tokens = 0
        self.text_offset = 0  # completions logprobs: offset of the next token's text
        self.done = False

    def advance(self, c: CompletionOutput) -> tuple[str, int, int] | None:
        """``(new text, first new token, end)``, or None if nothing is ready to send."""
        if self.done:
            return None
        end = len(c.text) if c.finished else max(self.sent_chars, len(c.text) - self.hold)
        if end == self.sent_chars and not c.finished:
            return None
        text = c.text[self.sent_chars:end]
        start, self.sent_chars, self.sent_tokens = self.sent_tokens, end, len(c.token_ids)
        self.done = c.finished
        return text, start, self.sent_tokens


class _Deltas:
    def __init__(self, params: SamplingParams):
        self.hold = max((len(s) for s in params.stop_strings), default=1) - 1
        self._by_choice: dict[tuple[int, int], _Delta] = {}

    def get(self, prompt_index: int, completion_index: int) -> _Delta:
        key = (prompt_index, completion_index)
        if key not in self._by_choice:
            self._by_choice[key] = _Delta(self.hold)
        return self._by_choice[key]


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator, so a client that
    disconnects aborts the engine request now, not when garbage is collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several engine streams as ``(index, output)``; closing it closes them all."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        async with contextlib.aclosing(gen) as it:
            try:
                async for out in it:
                    await queue.put((i, out, None))
            except Exception as e:  # noqa: BLE001 - re-raised by the consumer
                await queue.put((i, None, e))
        await queue.put((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if out is done:
                remaining -= 1
                continue
            yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_disconnected(request: Request, work: Any) -> bool:
    """Await ``work``; if the client disconnects first, cancel it and return False."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return True
        return False
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


# -- logprob formats ---------------------------------------------------------------------------
def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _by_rank(candidates: dict[int, Logprob]) -> list[Logprob]:
    return sorted(candidates.values(), key=lambda lp: lp.rank)


def _completion_logprobs(c: CompletionOutput, start: int, end: int,
                         offset: int) -> tuple[p.CompletionLogprobs, int]:
    """OpenAI's legacy format for tokens ``[start, end)``; also the next text offset."""
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


def _chat_logprobs(c: CompletionOutput, start: int, end: int, top: int) -> p.ChatLogprobs:
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


# -- ASGI middleware -------------------------------------------------------------------------
class _BodySizeLimit:
    """413 for bodies over ``max_bytes`` (declared or streamed), before any parsing."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope: Any, receive: Any, send: Any) -> None:
        response = error_response(413, f"request body exceeds {self.max_bytes} bytes",
                                  code="request_too_large")
        await response(scope, receive, send)


_ENDPOINTS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}


class _CountStatus:
    """Counts every HTTP response by endpoint and status code."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def counting_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            path = scope["path"] if scope["path"] in _ENDPOINTS else "other"
            self.metrics.http_requests.labels(endpoint=path, status=str(status)).inc()


# -- running it ---------------------------------------------------------------------------------
class ServerThread:
    """uvicorn serving ``app`` from a daemon thread on a socket bound up front (port 0
    picks a free one), for tests and benchmarks. ``url`` is valid after :meth:`start`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="raypp-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """``raypp serve [MODEL] [--demo] …`` (called by the CLI)."""
    from raypp.entrypoints.cli import add_engine_args

    parser = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face–format model directory")
    parser.add_argument("--demo", action="store_true", help="serve the bundled demo model")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* "
                             "(default: RAYPP_API_KEY, else no key)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the MODEL argument)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="larger request bodies get 413")
    parser.add_argument("--log-level", default="info", help="uvicorn log level")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_engine_args(parser)
    parser.set_defaults(func=run_server)


def run_server(args: argparse.Namespace) -> int:
    """Start the engine, serve until interrupted, then shut the engine down."""
    import uvicorn

    from raypp.entrypoints.cli import engine_kwargs, resolve_model

    if args.model is None and not args.demo:
        print("raypp serve: give a MODEL directory or --demo", flush=True)
        return 2
    model = resolve_model(args.model, args.demo)
    names = args.served_model_name or [args.model or "raypp-demo"]
    engine = AsyncLLMEngine.from_model(model, collect_stage_times=True, **engine_kwargs(args))
    try:
        config = ServerConfig(names, model, args.api_key or envs.RAYPP_API_KEY,
                              args.max_request_bytes)
        uvicorn.run(build_app(engine, config), host=args.host, port=args.port,
                    log_level=args.log_level, access_log=args.access_log)
    finally:
        engine.shutdown()
    return 0
