"""Server-sent events and the stream plumbing shared by both endpoints.

What callers may rely on:

- :func:`sse_response` frames events as ``text/event-stream``, ends every stream
  with ``data: [DONE]``, reports an exception raised after the headers went out
  as an in-band ``{"error": ...}`` event, and closes the event iterator when the
  client disconnects, so the engine requests behind it are aborted right away.
- :class:`Deltas` hands out each choice's new text once, holding back text that
  could still become the start of a stop string.
- :func:`merge` interleaves several engine streams; closing it closes them all.
- :func:`unless_disconnected` cancels work whose client went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from raypp.entrypoints.openai.errors import stream_error_event
from raypp.outputs import CompletionOutput, RequestOutput
from raypp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def sse(event: BaseModel | dict) -> str:
    """One ``data:`` event."""
    data = json.dumps(event) if isinstance(event, dict) else event.model_dump_json()
    return f"data: {data}\n\n"


def sse_response(request_id: str, events: AsyncIterator[str]) -> StreamingResponse:
    """Stream ``events`` (already framed by :func:`sse`), then ``[DONE]``."""

    async def body() -> AsyncIterator[str]:
        async with contextlib.aclosing(events) as it:
            try:
                async for event in it:
                    yield event
            except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
                logger.warning("stream %s failed: %s", request_id, e)
                yield sse(stream_error_event(e))
        yield "data: [DONE]\n\n"

    return _SSEResponse(body(), media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator, so a client that
    disconnects aborts the engine request now, not when garbage is collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class Delta:
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


class Deltas:
    """The :class:`Delta` of every choice of one request, by (prompt, completion) index."""

    def __init__(self, params: SamplingParams):
        self.hold = max((len(s) for s in params.stop_strings), default=1) - 1
        self._by_choice: dict[tuple[int, int], Delta] = {}

    def get(self, prompt_index: int, completion_index: int) -> Delta:
        key = (prompt_index, completion_index)
        if key not in self._by_choice:
            self._by_choice[key] = Delta(self.hold)
        return self._by_choice[key]


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as ``(index, output)``; the first error is
    re-raised; closing it closes them all."""
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


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> bool:
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
