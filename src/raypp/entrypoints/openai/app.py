"""The OpenAI-compatible ASGI app: routes, authorization, middleware, error handlers.

Endpoints: ``GET /v1/models`` (the served names and ``max_model_len``), ``POST
/v1/completions``, ``POST /v1/chat/completions`` (both stream as SSE ending in
``data: [DONE]``), ``POST /tokenize``, ``POST /detokenize``, ``GET /version``, ``GET
/health`` (200 only while every stage answers and the last step worked, else
503), ``GET /metrics`` (Prometheus text), and ``GET /openapi.json`` and ``/docs``
(the request bodies' schemas included).

What clients may rely on: every refused request gets a 4xx with an OpenAI-style
body ``{"error": {"message", "type", "param", "code"}}`` and the server keeps
serving; a client that disconnects (streaming or not) has its engine requests
aborted, which frees their KV blocks; with an API key, ``/v1/*`` needs
``Authorization: Bearer KEY`` (401 otherwise; ``/health`` and ``/metrics`` stay
open); request bodies over ``max_request_bytes`` get 413 before they are parsed;
every response is counted in ``raypp_http_requests_total`` by endpoint and status.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import raypp
from raypp.engine.async_engine import AsyncLLMEngine
from raypp.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from raypp.entrypoints.openai import protocol as p
from raypp.entrypoints.openai import requests as rq
from raypp.entrypoints.openai.chat import ChatServing
from raypp.entrypoints.openai.errors import APIError, error_response
from raypp.entrypoints.openai.serving import OpenAIServing
from raypp.entrypoints.openai.tool_parsers import parser_for

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


@dataclass
class ServerConfig:
    """What the server answers to: model names (the first is the default), the model
    directory ``/v1/models`` reports, an optional API key, the body-size limit, and the
    tool-call format (a name of :data:`~raypp.entrypoints.openai.tool_parsers.PARSERS`;
    ``None``: the model family's)."""

    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    tool_call_parser: str | None = None


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The ASGI app; the caller owns ``engine`` (and shuts it down)."""
    app = FastAPI(title="raypp", version=raypp.__version__, redoc_url=None)
    metrics = ServerMetrics()
    serving = OpenAIServing(engine, metrics, config.served_model_names, config.model_path)
    model_type = engine.engine.config.model.hf_config.get("model_type")
    chat = ChatServing(serving, parser_for(config.tool_call_parser, model_type))
    app.state.raypp = serving
    documented = {"/v1/completions": rq.CompletionRequest,
                  "/v1/chat/completions": rq.ChatCompletionRequest,
                  "/tokenize": rq.TokenizeRequest, "/detokenize": rq.DetokenizeRequest}
    app.openapi = lambda: openapi_with_bodies(app, documented)  # type: ignore[method-assign]
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
        _authorize(request, config.api_key)
        return serving.models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _authorize(request, config.api_key)
        req = _parse(rq.CompletionRequest, await request.body())
        return await serving.completions(req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _authorize(request, config.api_key)
        req = _parse(rq.ChatCompletionRequest, await request.body())
        return await chat.chat(req, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        _authorize(request, config.api_key)
        return serving.tokenize(_parse(rq.TokenizeRequest, await request.body()))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        _authorize(request, config.api_key)
        return serving.detokenize(_parse(rq.DetokenizeRequest, await request.body()))

    @app.get("/version")
    async def version() -> Response:
        return Response(p.VersionResponse(version=raypp.__version__).model_dump_json(),
                        media_type="application/json")

    return app


def _authorize(request: Request, key: str | None) -> None:
    if key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    if not secrets.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                       code="invalid_api_key")


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


def openapi_with_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """FastAPI's schema, with each POST route's JSON body (parsed by hand, so FastAPI
    cannot see it) described by its model."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        body = model.model_json_schema(by_alias=True,
                                       ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = schema
    return schema


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


_ENDPOINTS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics",
              "/tokenize", "/detokenize", "/version"}


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
