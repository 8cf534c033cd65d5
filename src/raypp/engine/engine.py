"""LLMEngine: add and abort requests, step the pipeline, recover from stage failures.

A step reads top-down: submit every micro-batch the scheduler forms
(:class:`~raypp.engine.scheduler.Scheduler`: it decides how many are in flight, and
which are decode rounds of how many steps; descriptors built by
:class:`~raypp.engine.step_builder.StepBuilder`), submit the oldest one's next round
if the scheduler continues it (asynchronous scheduling), wait for the oldest
micro-batch's sampled tokens, append them and apply the stop rules
(:class:`~raypp.engine.output_processor.OutputProcessor`), refill the freed slot at
once, and detokenize and build outputs while that next micro-batch runs. The engine
submits and collects; it sizes nothing.
"""

from __future__ import annotations

import gc
import itertools
import logging
import random
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from raypp.config import EngineConfig
from raypp.engine import detokenizer
from raypp.engine.block_manager import BlockManager
from raypp.engine.occupancy import OccupancyMonitor
from raypp.engine.output_processor import OutputProcessor, request_output
from raypp.engine.recovery import Recovery
from raypp.engine.request_checks import check_max_tokens, check_prompt
from raypp.engine.scheduler import MicroBatch, Scheduler
from raypp.engine.sequence import Request, Sequence
from raypp.engine.stats import EngineStats
from raypp.engine.step_builder import StepBuilder
from raypp.engine.structured import StructuredOutputs
from raypp.engine.tokenizer import load_tokenizer
from raypp.errors import (
    EngineDeadError,
    ErrorKind,
    StageDiedError,
    StageError,
    StepTimeoutError,
)
from raypp.executor.base import make_executor
from raypp.outputs import RequestOutput
from raypp.sampling_params import SamplingParams
from raypp.step import StepInput, StepOutput

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1


@dataclass
class _InFlight:
    batch: MicroBatch
    step: StepInput
    handle: Any


class LLMEngine:
    """The synchronous engine. Not thread-safe: one caller drives ``step``."""

    def __init__(self, config: EngineConfig):
        self.config = config
        # the driver loads the tokenizer while Ray and the stages start
        with ThreadPoolExecutor(1, thread_name_prefix="raypp-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, config.model.tokenizer)
            self.executor = make_executor(config)
            try:
                self.tokenizer = tokenizer.result()
            except BaseException:
                self.executor.shutdown()
                raise
        self.block_manager = self._new_block_manager()
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.model.max_model_len,
                                   config.speculative_config, config.model.hidden_size)
        self.requests: dict[str, Request] = {}
        self.occupancy = OccupancyMonitor(lambda: self.executor.occupancy(),
                                          config.runtime.stats_interval_s)
        # structured outputs: grammars compile off this thread; a request waits here
        # (not yet scheduled) until its grammar is ready
        self.structured = StructuredOutputs(self.tokenizer, config.model.vocab_size,
                                            config.model.eos_token_ids())
        self._compiling: list[tuple[Request, Future]] = []
        self.step_builder = StepBuilder(self.scheduler)
        self.output_processor = OutputProcessor(self.tokenizer, set(config.model.eos_token_ids()),
                                                self.scheduler, self.requests)
        self._inflight: deque[_InFlight] = deque()
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(config.model.seed)
        self.stats = EngineStats()
        self.recovery = Recovery(self)  # failed pipelines: requeue, restart, poison
        # Start-up objects (tokenizer, Ray, torch) live for the whole run: keep them out
        # of the cyclic GC's full passes, which otherwise cost milliseconds per step.
        gc.collect()
        gc.freeze()

    # -- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams | None = None) -> None:
        """``ValueError`` with an actionable message if the prompt cannot run, or (given
        ``params``) if its ``max_tokens`` exceeds what the context leaves
        (:mod:`raypp.engine.request_checks`)."""
        max_model_len = self.config.model.max_model_len
        check_prompt(token_ids, max_model_len, self.config.model.vocab_size)
        if params is not None:
            check_max_tokens(len(token_ids), params.max_tokens, max_model_len)

    def validate_params(self, params: SamplingParams) -> None:
        """``ValueError`` if ``params`` cannot run on this model (logit bias ids outside
        the vocabulary). Grammars are checked by compiling them (:attr:`structured`)."""
        vocab = self.config.model.vocab_size
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab}), got {bad[:5]}")

    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None) -> None:
        """Queue a request; ``ValueError`` (and nothing queued) if it is invalid.

        A request with ``structured_outputs`` is scheduled once its grammar compiled
        (off this thread; at once when cached); a grammar the library rejects raises
        here if that is already known, else finishes the request with an error
        (``ErrorKind.INVALID_REQUEST``)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.prepare_prompt(prompt)
        self.validate_prompt(token_ids, params)
        self.validate_params(params)
        future = None
        if params.structured_outputs is not None:
            future = self.structured.submit(params.structured_outputs)
            if future.done() and future.exception() is not None:
                raise future.exception()
        seqs = [self._new_sequence(request_id, i, token_ids, params) for i in range(params.n)]
        request = self.requests[request_id] = Request(request_id, text, token_ids, params, seqs)
        if future is None:
            for seq in seqs:
                self.scheduler.add(seq)
        else:
            self._compiling.append((request, future))
            self._admit_compiled()

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammars compiled; fail those the library
        rejected (their outputs)."""
        waiting, self._compiling, failed = self._compiling, [], []
        for request, future in waiting:
            if self.requests.get(request.request_id) is not request:
                continue  # aborted while compiling
            if not future.done():
                self._compiling.append((request, future))
            elif future.exception() is not None:
                failed.append(self._fail_request(request, f"{future.exception()}",
                                                 ErrorKind.INVALID_REQUEST))
            else:
                for seq in request.seqs:
                    seq.grammar = self.structured.grammar(future.result())
                    self.scheduler.add(seq)
        return failed

    def prepare_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a string, token-id list or prompt dict."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, token ids or a dict, got {type(prompt).__name__}")

    def _new_sequence(self, request_id: str, index: int, token_ids: list[int],
                      params: SamplingParams) -> Sequence:
        if params.seed is not None:
            seed = (params.seed + index * 0x9E3779B1) & _SEED_MASK
        else:
            seed = self._seed_rng.getrandbits(63)
        seq = Sequence(next(self._seq_ids), request_id, index, list(token_ids), params, seed)
        if params.logprobs is not None:
            seq.logprobs = []
        detokenizer.init_offsets(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (no-op for unknown ids)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                seq.finish("abort")
            self.scheduler.finish(seq)

    @property
    def emit_unfinished(self) -> bool:
        """``step()`` returns updates of running requests too (streaming); the offline
        API turns this off and gets finished requests only, which is cheaper."""
        return self.output_processor.emit_unfinished

    @emit_unfinished.setter
    def emit_unfinished(self, value: bool) -> None:
        self.output_processor.emit_unfinished = value

    @property
    def trace_steps(self) -> bool:
        """Stages record the compute interval of every step submitted while set."""
        return self.step_builder.trace

    @trace_steps.setter
    def trace_steps(self, value: bool) -> None:
        self.step_builder.trace = value

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._inflight)

    @property
    def has_inflight_steps(self) -> bool:
        """True while micro-batches are in the pipeline (results still to collect)."""
        return bool(self._inflight)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance the pipeline by one micro-batch; outputs of requests it touched.

        A failed step does not raise: its requests come back finished with
        ``error`` set. An exception inside a stage fails only that micro-batch. A
        dead or stuck stage loses no request: every running one is re-queued and
        continues where it was on new workers (:mod:`raypp.engine.recovery`; one that
        was in flight at ``max_failures_per_request`` failures in a row fails as their
        likely cause). Raises :class:`EngineDeadError` once restarts are exhausted.
        """
        recovery = self.recovery
        if recovery.dead:
            raise EngineDeadError(recovery.dead)
        started = time.perf_counter()
        if recovery.needs_restart and not recovery.restart():
            return []
        recovery.release()
        if self._compiling and (rejected := self._admit_compiled()):
            return rejected
        try:
            self._fill_pipeline()
        except (StageDiedError, StepTimeoutError) as e:
            return self.recovery.on_failure(e)
        if not self._inflight:
            return []
        item = self._inflight.popleft()
        try:
            self._continue_round(item)
        except (StageDiedError, StepTimeoutError) as e:
            self._inflight.appendleft(item)
            return self.recovery.on_failure(e)
        waited = time.perf_counter()
        try:
            result: StepOutput = self.executor.result(item.handle)
        except StageError as e:
            self.step_builder.forget(item.step)  # stages after the failing one missed it
            return self._fail_batch(item.batch, f"{e}", ErrorKind.STAGE_ERROR)
        except (StageDiedError, StepTimeoutError) as e:
            self._inflight.appendleft(item)
            return self.recovery.on_failure(e)
        got = time.perf_counter()
        seqs, text_pending = self.output_processor.append_results(item.batch, result)
        failure = None
        try:  # the next micro-batch runs while this one's text is decoded
            self._fill_pipeline()
        except (StageDiedError, StepTimeoutError) as e:
            failure = e
        outputs = self.output_processor.finish_text(seqs, text_pending)
        if failure is not None:
            outputs += self.recovery.on_failure(failure)
        stats = self.stats
        stats.steps += 1
        stats.tokens_processed += item.step.num_tokens * item.step.num_steps
        stats.tokens_generated = self.output_processor.tokens_generated
        speculator = self.scheduler.rounds.speculator
        if speculator is not None:
            stats.spec_verifications = speculator.verifications
            stats.spec_drafted_tokens = speculator.drafted
            stats.spec_accepted_tokens = speculator.accepted
        stats.step_time_s += got - waited
        stats.max_step_wait_s = max(stats.max_step_wait_s, got - waited)
        stats.overhead_time_s += (waited - started) + (time.perf_counter() - got)
        self.occupancy.tick(bool(self.requests), lambda: stats.snapshot(
            self.scheduler, len(self.requests)).summary())
        return outputs

    def _fill_pipeline(self) -> None:
        while (batch := self.scheduler.schedule()) is not None:
            self._launch(batch)

    def _continue_round(self, item: _InFlight) -> None:
        """Asynchronous scheduling: submit the next decode round of ``item`` (just taken
        from the pipeline, its result not yet read) if the scheduler continues it, so the
        stage starts it as soon as ``item`` ends."""
        batch = self.scheduler.continue_batch(item.batch)
        if batch is not None:
            # if submitting fails, the caller's failure path requeues every running sequence
            self._launch(batch)
            self.stats.rounds_ahead += 1

    def _launch(self, batch: MicroBatch) -> None:
        """Build and submit ``batch``; if submitting fails, it is completed as failed."""
        step = self.step_builder.build(batch)
        step.submitted_at = time.time()
        try:
            handle = self.executor.submit(step)
        except BaseException:
            self.step_builder.forget(step)  # it may have reached no stage
            self.scheduler.complete(batch, ok=False)
            raise
        self._inflight.append(_InFlight(batch, step, handle))

    # -- failures --------------------------------------------------------------------------
    def _fail_batch(self, batch: MicroBatch, message: str, kind: ErrorKind
                    ) -> list[RequestOutput]:
        """Finish every request with a sequence in ``batch`` with an error."""
        self.scheduler.complete(batch, ok=False)
        failed = {item.seq.request_id: self.requests.get(item.seq.request_id)
                  for item in batch.seqs}
        return [self._fail_request(request, f"{kind.value}: {message}", kind)
                for request in failed.values() if request is not None]

    def _fail_request(self, request: Request, error: str, kind: ErrorKind) -> RequestOutput:
        """Finish ``request`` with ``error`` and forget it; its final output."""
        for seq in request.seqs:
            if not seq.finished:
                seq.finish("error")
            self.scheduler.finish(seq)
        request.error, request.error_kind = error, kind
        self.requests.pop(request.request_id, None)
        self.recovery.quarantine.forget(request.request_id)
        return request_output(request)

    def _new_block_manager(self) -> BlockManager:
        cache = self.config.cache
        return BlockManager(self.executor.num_kv_blocks, cache.block_size,
                            enable_caching=cache.enable_prefix_caching)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (later prompts compute from scratch); False, and
        nothing forgotten, while a request holds cache blocks."""
        return self.block_manager.reset_cache()

    def _fail_all(self, message: str) -> None:
        for request in list(self.requests.values()):
            self._fail_request(request, message, ErrorKind.ENGINE_DEAD)

    @property
    def restarts(self) -> int:
        return len(self.recovery.restarts)

    # -- lifecycle -------------------------------------------------------------------------
    def repair(self) -> bool:
        """With no request in the engine, replace stage workers the watchdog found dead,
        so an idle engine heals before traffic returns (a load balancer that reads
        ``/health`` would otherwise never send the request that heals it). Counts
        against ``max_restarts``. True if the engine is healthy afterwards."""
        recovery = self.recovery
        if recovery.dead or self.requests:
            return False
        if not recovery.needs_restart:
            if self.executor.check_health():
                return True
            recovery.on_failure(StageDiedError("a stage died while the engine was idle"))
        try:
            return recovery.restart()
        except EngineDeadError:
            return False

    def is_healthy(self) -> bool:
        """False while stages are dead or being replaced, and once the engine stopped."""
        recovery = self.recovery
        return not recovery.dead and not recovery.needs_restart and self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers (idempotent); later steps raise :class:`EngineDeadError`."""
        self.recovery.dead = self.recovery.dead or "engine was shut down"
        self.structured.close()
        self.executor.shutdown()
