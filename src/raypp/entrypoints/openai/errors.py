"""How the server's refusals and failures become OpenAI-style error bodies.

What callers may rely on: raising :class:`APIError` anywhere under a route gives
that status with ``{"error": {"message", "type", "param", "code"}}``;
:func:`generation_failure` maps an engine failure to its status by exception
type and ``RequestOutput.error_kind``, never by the text of the message.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from raypp.engine.async_engine import GenerationError
from raypp.entrypoints.openai import protocol as p
from raypp.errors import EngineDeadError, ErrorKind


class APIError(Exception):
    """Answered as an OpenAI-style error body with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    """The JSON response for an error (also used outside routes, by middleware)."""
    body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def generation_failure(e: Exception) -> APIError:
    """The error for a request the engine did not complete.

    503 while the engine cannot serve: its workers are being replaced (a retryable
    :class:`~raypp.errors.ErrorKind`, whose message says to retry) or it stopped (no
    retry will succeed: the message says so by not suggesting one); 400 for a request
    the engine itself rejected (``ValueError``, or ``ErrorKind.INVALID_REQUEST``); 500
    for anything else (a poison request among them).
    """
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "service_unavailable")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, GenerationError):
        kind = e.output.error_kind
        if kind is ErrorKind.INVALID_REQUEST:
            return APIError(400, str(e))
        if kind is ErrorKind.ENGINE_DEAD:
            return APIError(503, str(e), "service_unavailable")
        if kind is not None and kind.retryable:
            return APIError(503, f"pipeline unavailable, retry: {e}", "service_unavailable")
    return APIError(500, f"generation failed: {e}", "internal_server_error")


def stream_error_event(e: Exception) -> dict:
    """The in-band error of a stream whose headers are already sent."""
    return {"error": {"message": f"generation failed: {e}", "type": "internal_server_error",
                      "param": None, "code": None}}
