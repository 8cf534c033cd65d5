"""One streaming request to an OpenAI-compatible server, timed on the client.

:func:`stream_request` posts a streaming completion (or chat completion) over real
HTTP and returns a :class:`RequestResult`: TTFT (send → first non-empty text chunk),
inter-token latencies (gaps between later text chunks), end-to-end latency and the
completion tokens the server's ``usage`` reports. Requests ask for ``ignore_eos`` so
each one generates ``max_tokens`` tokens. A failure (HTTP status, an ``error`` event in
the stream, a transport error) comes back as ``ok=False`` with ``error`` set; nothing
raises.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPTS = ["The list type", "A function definition", "The import statement",
           "Assert statements are a convenient way to", "Classes provide a means of"]


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds. ``sent_s`` is when it was
    sent, from the start of its run (set by the caller)."""

    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    completion_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    sent_s: float = 0.0

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: ``(latency - TTFT) / (tokens - 1)``;
        ``None`` for a failed request or one of fewer than 2 tokens."""
        if not self.ok or self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


def request_body(model: str, i: int, max_tokens: int, temperature: float,
                 chat: bool) -> dict[str, Any]:
    """The ``i``-th request: one of :data:`PROMPTS` in turn, streamed, ``ignore_eos``."""
    prompt = PROMPTS[i % len(PROMPTS)]
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def stream_request(client: httpx.AsyncClient, body: dict[str, Any],
                         chat: bool) -> RequestResult:
    """POST ``body`` to ``/v1/(chat/)completions`` and read its event stream to the end."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    start = time.perf_counter()
    result, last = RequestResult(ok=False), None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                if not _chunk_text(chunk):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency_s = time.perf_counter() - start
    result.ok = last is not None
    if not result.ok:
        result.error = "the stream held no text"
    return result
