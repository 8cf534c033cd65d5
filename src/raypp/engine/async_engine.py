"""AsyncLLMEngine: the synchronous engine driven by one background thread.

``LLMEngine`` is not thread-safe, so exactly one thread — the loop thread —
touches it. Callers on any thread or event loop hand it commands (add, abort)
through a queue and receive outputs through a per-request ``asyncio.Queue`` fed
with ``loop.call_soon_threadsafe``. The loop steps while requests exist and
sleeps on an event while idle (no busy loop).

What callers may rely on:

- :meth:`AsyncLLMEngine.generate` raises ``ValueError`` for an invalid prompt or
  a duplicate request id before yielding anything, and nothing stays queued.
- Every update of a request is yielded in order; the last one has
  ``finished=True``.
- If the consumer stops iterating (``break``, ``aclose()``, task cancelled)
  before the last update, the request is aborted and its KV blocks freed.
- A request the engine finishes with an error (a stage raised, died or hung)
  raises :class:`GenerationError` from its iterator.
- If ``engine.step()`` raises, every in-flight request's iterator raises that
  exception; the loop keeps serving later requests (see :meth:`_fail_all`).
- After :meth:`shutdown`, iterators and new calls raise ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from raypp.config import EngineConfig
from raypp.engine.engine import LLMEngine
from raypp.engine.stats import EngineStats
from raypp.errors import EngineDeadError
from raypp.outputs import RequestOutput
from raypp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_STAGE_TIMES_INTERVAL_S = 1.0  # how often the loop drains the stages' step timelines
_STAGE_TIMES_TIMEOUT_S = 2.0  # a stage that does not answer is left to the health check
_IDLE_REPAIR_S = 2.0  # how often an idle loop checks whether a stage died
_STUCK_WAIT_S = 0.005  # requests exist but nothing could be scheduled: nap, don't spin


class GenerationError(RuntimeError):
    """The engine finished a request with an error; ``output`` is its last state."""

    def __init__(self, output: RequestOutput):
        super().__init__(output.error)
        self.output = output


class _Stream:
    """The thread-safe mailbox of one request: outputs or an exception."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """False if the consumer's event loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # loop closed
            return False


class AsyncLLMEngine:
    """Wraps an :class:`LLMEngine` for concurrent async callers (e.g. the HTTP server).

    ``collect_stage_times=True`` turns on the stages' step tracing and drains
    their timelines about once a second; :meth:`pop_stage_times` hands the
    durations to the metrics exporter.
    """

    def __init__(self, engine: LLMEngine, collect_stage_times: bool = False):
        self.engine = engine
        engine.emit_unfinished = True  # every request streams its updates
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._stopping = False
        self._dead: BaseException | None = None
        self._last_step_failed = False
        self._stats = engine.stats.snapshot(engine.scheduler, len(engine.requests),
                                          engine.occupancy.latest)
        self._collect_stage_times = collect_stage_times
        self._stage_times: deque[tuple[int, float]] = deque(maxlen=10_000)
        self._last_stage_drain = time.monotonic()
        self._steps_since_drain = 0
        if collect_stage_times:
            engine.trace_steps = True
        self._thread = threading.Thread(target=self._run, name="raypp-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str, collect_stage_times: bool = False,
                   **kwargs: Any) -> AsyncLLMEngine:
        """Start an engine on :meth:`EngineConfig.from_kwargs(model, **kwargs)
        <raypp.config.EngineConfig.from_kwargs>` (the options ``LLM`` takes) and wrap it."""
        return cls(LLMEngine(EngineConfig.from_kwargs(model, **kwargs)), collect_stage_times)

    # -- caller side (any thread) --------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model.max_model_len

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's sampling defaults (``ModelConfig.sampling_defaults``)."""
        return self.engine.config.model.sampling_defaults

    def prepare_prompt(self, prompt: str | list[int] | dict,
                       params: SamplingParams | None = None) -> dict:
        """Tokenize and validate; ``ValueError`` if the prompt cannot run, or (given
        ``params``) if its ``max_tokens`` exceeds what the context leaves
        (:class:`~raypp.errors.ContextLengthError`).

        Safe off the loop thread: it only reads the tokenizer and the config.
        """
        text, token_ids = self.engine.prepare_prompt(prompt)
        self.engine.validate_prompt(token_ids, params)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def validate_params(self, params: SamplingParams) -> None:
        """``ValueError`` if ``params`` cannot run on this model (safe off the loop thread:
        it only reads the config)."""
        self.engine.validate_params(params)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile ``params``' grammar, if any, on the engine's compile thread (cached per
        spec); the awaiting task waits, nothing else does. ``ValueError`` with the grammar
        library's message if it rejects the spec."""
        if params.structured_outputs is not None:
            await asyncio.wrap_future(self.engine.structured.submit(params.structured_outputs))

    async def generate(self, prompt: str | list[int] | dict, params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream ``request_id``'s updates (cumulative text); see the module docstring."""
        prepared = self.prepare_prompt(prompt, params)
        self._check_alive()
        stream = _Stream(asyncio.get_running_loop())
        self._submit(("add", request_id, prepared, params or SamplingParams(), stream))
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True  # the loop already forgot this request
                    raise item
                done = item.finished
                if getattr(item, "error", None):
                    raise GenerationError(item)
                yield item
                if done:
                    return
        finally:
            if not done:
                self._submit(("abort", request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread (no-op for unknown ids)."""
        self._submit(("abort", request_id))

    def stats(self) -> EngineStats:
        """The engine's counters and load as of the loop's last iteration."""
        return self._stats

    def pop_stage_times(self) -> list[tuple[int, float]]:
        """``(pp_rank, seconds)`` of stage steps measured since the last call."""
        out = []
        while self._stage_times:
            out.append(self._stage_times.popleft())
        return out

    def is_healthy(self) -> bool:
        """True only while the loop runs, the last step worked and every stage answers a ping.

        Blocks for up to the ping timeout: call it off the event loop.
        """
        if self._dead is not None or self._stopping or not self._thread.is_alive():
            return False
        if self._last_step_failed:
            return False
        return self.engine.is_healthy()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop (in-flight requests fail with EngineDeadError), then the engine."""
        if not self._stopping:
            self._stopping = True
            self._wakeup.set()
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine loop did not stop within %.0f s", timeout)
        self.engine.shutdown()

    def __enter__(self) -> AsyncLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_alive(self) -> None:
        if self._stopping:
            raise EngineDeadError("the engine is shut down")
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}") from self._dead

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._publish(idle=True)
                    if not self._wakeup.wait(_IDLE_REPAIR_S):
                        self.engine.repair()  # idle: heal dead stages before traffic returns
                    self._wakeup.clear()
        except BaseException as e:  # noqa: BLE001 - a bug here must not strand callers
            logger.exception("engine loop died")
            self._dead = e
            self._fail_all(e)
            return
        self._fail_all(EngineDeadError("the engine is shut down"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self._abort(command[1])

    def _add(self, request_id: str, prompt: dict, params: SamplingParams, stream: _Stream) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except ValueError as e:
            stream.put(e)
            return
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - reported to every in-flight request
            self._last_step_failed = True
            self._fail_all(e)
            return
        self._last_step_failed = False
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if not stream.put(out) and not out.finished:
                self._abort(out.request_id)
        self._publish(idle=False)
        # Requests exist but none could be scheduled: wait for a command instead of spinning.
        if not outputs and not self.engine.has_inflight_steps and self._wakeup.wait(_STUCK_WAIT_S):
            self._wakeup.clear()

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every in-flight request with ``exc`` and forget it (its blocks are freed).

        The one place that decides what a failed step means for callers; recovery
        (rebuilding the pipeline) can hook in here.
        """
        if self._streams:
            logger.error("engine step failed; failing %d request(s): %s", len(self._streams), exc)
        streams, self._streams = self._streams, {}
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        for stream in streams.values():
            stream.put(exc)

    def _publish(self, idle: bool) -> None:
        engine = self.engine
        self._stats = engine.stats.snapshot(engine.scheduler, len(engine.requests),
                                          engine.occupancy.latest)
        if not idle:
            self._steps_since_drain += 1
        if self._collect_stage_times and self._steps_since_drain:
            now = time.monotonic()
            if idle or now - self._last_stage_drain >= _STAGE_TIMES_INTERVAL_S:
                self._last_stage_drain, self._steps_since_drain = now, 0
                self._drain_stage_times()

    def _drain_stage_times(self) -> None:
        try:
            intervals = self.engine.executor.traced_intervals(_STAGE_TIMES_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a dead stage is the health check's to report
            logger.debug("could not collect stage step times: %s", e)
            return
        for stage, start, end in intervals:
            self._stage_times.append((stage, end - start))
