"""LLMEngine: add requests, step the pipeline, collect outputs.

A step reads top-down: fill free pipeline slots with micro-batches from the
scheduler (``_fill_pipeline``), wait for the oldest micro-batch's sampled tokens,
append them and apply the stop conditions (``_append_results``), refill the
freed slot at once, and detokenize and build outputs while that next
micro-batch runs (``_finish_text``).
"""

from __future__ import annotations

import gc
import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from raypp import envs
from raypp.config import EngineConfig
from raypp.engine import detokenizer
from raypp.engine.block_manager import BlockManager
from raypp.engine.scheduler import MicroBatch, Scheduler
from raypp.engine.sequence import Request, Sequence, SequenceStatus
from raypp.engine.step import RowLogprobs, SamplingBatch, StepInput, StepOutput
from raypp.engine.tokenizer import load_tokenizer
from raypp.executor.base import make_executor
from raypp.executor.errors import (
    EngineDeadError,
    StageDiedError,
    StageError,
    StepTimeoutError,
    first_line,
)
from raypp.outputs import CompletionOutput, Logprob, RequestOutput
from raypp.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1


@dataclass
class EngineStats:
    """Cumulative counters since start-up."""

    steps: int = 0
    tokens_processed: int = 0  # tokens fed through the pipeline (prefill + decode)
    tokens_generated: int = 0
    step_time_s: float = 0.0  # wall time waiting on step results
    max_step_wait_s: float = 0.0  # longest single wait for a step result
    overhead_time_s: float = 0.0  # scheduling, descriptor building, postprocessing
    rounds_ahead: int = 0  # decode rounds submitted before the round they continue was read


@dataclass
class _InFlight:
    batch: MicroBatch
    step: StepInput
    handle: Any


class LLMEngine:
    """The synchronous engine. Not thread-safe: one caller drives ``step``."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.model.model)
        self.eos_token_ids = set(config.model.eos_token_ids())
        self.executor = make_executor(config, config.parallel.control_plane)
        self._restarts: deque[float] = deque()  # times of recent executor replacements
        self._needs_restart = False
        self._restart_error = ""
        self._dead: str | None = None
        self.block_manager = BlockManager(self.executor.num_kv_blocks, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.model.max_model_len)
        self.requests: dict[str, Request] = {}
        self._inflight: deque[_InFlight] = deque()
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        self._seed_rng = random.Random(config.model.seed)
        self.trace_steps = False
        # step() returns updates of running requests too (streaming); the offline
        # API turns this off and gets finished requests only, which is cheaper.
        self.emit_unfinished = True
        self.stats = EngineStats()
        # Start-up objects (tokenizer, Ray, torch) live for the whole run: keep them out
        # of the cyclic GC's full passes, which otherwise cost milliseconds per step.
        gc.collect()
        gc.freeze()

    # -- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate_prompt(self, token_ids: list[int]) -> None:
        """``ValueError`` with an actionable message if the prompt cannot run."""
        limit = self.config.model.max_model_len
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(token_ids) >= limit:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, but max_model_len is {limit} and at "
                "least one token must be generated: shorten the prompt"
            )
        vocab = self.config.model.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")

    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None) -> None:
        """Queue a request; ``ValueError`` (and nothing queued) if it is invalid."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.prepare_prompt(prompt)
        self.validate_prompt(token_ids)
        seqs = [self._new_sequence(request_id, i, token_ids, params) for i in range(params.n)]
        self.requests[request_id] = Request(request_id, text, token_ids, params, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

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
        dead or stuck stage fails every in-flight micro-batch, re-queues the other
        running sequences (they recompute), and the executor is replaced before the
        next step. Raises :class:`EngineDeadError` once restarts are exhausted.
        """
        if self._dead:
            raise EngineDeadError(self._dead)
        started = time.perf_counter()
        if self._needs_restart and not self._restart():
            return []
        try:
            self._fill_pipeline()
        except (StageDiedError, StepTimeoutError) as e:
            return self._on_executor_failure(e)
        if not self._inflight:
            return []
        item = self._inflight.popleft()
        try:
            self._submit_next_round(item)
        except (StageDiedError, StepTimeoutError) as e:
            self._inflight.appendleft(item)
            return self._on_executor_failure(e)
        waited = time.perf_counter()
        try:
            result: StepOutput = self.executor.result(item.handle)
        except StageError as e:
            return self._fail_batch(item.batch, f"{e}", "stage_error")
        except (StageDiedError, StepTimeoutError) as e:
            self._inflight.appendleft(item)
            return self._on_executor_failure(e)
        got = time.perf_counter()
        seqs, text_pending = self._append_results(item.batch, result)
        failure = None
        try:  # the next micro-batch runs while this one's text is decoded
            self._fill_pipeline()
        except (StageDiedError, StepTimeoutError) as e:
            failure = e
        outputs = self._finish_text(seqs, text_pending)
        if failure is not None:
            outputs += self._on_executor_failure(failure)
        stats = self.stats
        stats.steps += 1
        stats.tokens_processed += item.step.num_tokens * item.step.num_steps
        stats.step_time_s += got - waited
        stats.max_step_wait_s = max(stats.max_step_wait_s, got - waited)
        stats.overhead_time_s += (waited - started) + (time.perf_counter() - got)
        return outputs

    def _fill_pipeline(self) -> None:
        while len(self._inflight) < (self.config.scheduler.max_inflight or 1):
            batch = self.scheduler.schedule()
            if batch is None:
                return
            step = self._build_step(batch)
            self._inflight.append(_InFlight(batch, step, self.executor.submit(step)))

    def _submit_next_round(self, item: _InFlight) -> None:
        """Asynchronous scheduling: submit the next decode round of ``item`` (just taken
        from the pipeline, its result not yet read) so the stage starts it as soon as
        ``item`` ends. Only when ``item`` loops on the device, nothing else is in
        flight, and no waiting request could join a freshly scheduled batch instead."""
        step = item.step
        if (not self.config.rounds_ahead or self._inflight
                or (step.num_steps == 1 and step.continues is None)
                or self.scheduler.can_admit()):
            return
        batch = self.scheduler.continue_batch(item.batch)
        if batch is None:
            return
        rows = {id(s.seq): r for r, s in enumerate(item.batch.seqs)}
        nxt = self._build_step(batch)
        nxt.continues = step.step_id
        nxt.continue_rows = [rows[id(s.seq)] for s in batch.seqs]
        # if submitting fails, the caller's failure path requeues every running sequence
        self._inflight.append(_InFlight(batch, nxt, self.executor.submit(nxt)))
        self.stats.rounds_ahead += 1

    # -- failures --------------------------------------------------------------------------
    def _fail_batch(self, batch: MicroBatch, message: str, kind: str) -> list[RequestOutput]:
        """Finish every request with a sequence in ``batch`` with an error."""
        self.scheduler.complete(batch)
        failed: dict[str, Request] = {}
        for item in batch.seqs:
            request = self.requests.get(item.seq.request_id)
            if request is not None:
                failed[request.request_id] = request
        outputs = []
        for request in failed.values():
            self._fail_request(request, f"{kind}: {message}")
            outputs.append(self._request_output(request))
            del self.requests[request.request_id]
        return outputs

    def _fail_request(self, request: Request, error: str) -> None:
        for seq in request.seqs:
            if not seq.finished:
                seq.finish("error")
            self.scheduler.finish(seq)
        request.error = error

    def _on_executor_failure(self, error: Exception) -> list[RequestOutput]:
        kind = "stage_died" if isinstance(error, StageDiedError) else "step_timeout"
        logger.error("pipeline failed (%s): %s; replacing the stage workers", kind, error)
        outputs: list[RequestOutput] = []
        while self._inflight:
            outputs.extend(self._fail_batch(self._inflight.popleft().batch, str(error), kind))
        for seq in list(self.scheduler.running):  # their KV cache dies with the workers
            self.scheduler.requeue(seq)
        self.executor.shutdown()
        self._needs_restart = True
        return outputs

    def _restart(self) -> bool:
        """Replace the stage workers; False if that failed (the next step tries again).

        Every attempt, failed or not, counts against ``max_restarts``.
        """
        now = time.monotonic()
        window = envs.RAYPP_RESTART_WINDOW_S
        while self._restarts and now - self._restarts[0] > window:
            self._restarts.popleft()
        if len(self._restarts) >= self.config.max_restarts:
            self._dead = (f"engine stopped: {len(self._restarts)} restarts within {window:g} s "
                          f"(max_restarts={self.config.max_restarts})"
                          + (f"; last: {self._restart_error}" if self._restart_error else ""))
            self._fail_all(self._dead)
            raise EngineDeadError(self._dead)
        self._restarts.append(now)
        try:
            self.executor = make_executor(self.config, self.config.parallel.control_plane)
        except Exception as e:  # noqa: BLE001 - reported, and retried within max_restarts
            self._restart_error = f"replacing the stage workers failed: {first_line(e)}"
            logger.error("%s", self._restart_error)
            return False
        self._restart_error = ""
        if self.executor.num_kv_blocks != self.block_manager.num_blocks:
            self.block_manager = BlockManager(self.executor.num_kv_blocks,
                                              self.config.cache.block_size)
            self.scheduler.blocks = self.block_manager
        self._needs_restart = False
        logger.info("stage workers replaced (%d restart(s) in window)", len(self._restarts))
        return True

    def _fail_all(self, message: str) -> None:
        for request in list(self.requests.values()):
            self._fail_request(request, message)
        self.requests.clear()

    @property
    def restarts(self) -> int:
        return len(self._restarts)

    def _build_step(self, batch: MicroBatch) -> StepInput:
        ids, positions, slots, query_start, seq_lens, tables, rows = [], [], [], [0], [], [], []
        sampled: list[Sequence] = []
        for item in batch.seqs:
            seq, start = item.seq, item.seq.num_computed_tokens + batch.ahead
            end = start + item.num_tokens
            if batch.ahead:  # the stage feeds the previous round's last tokens
                ids.append(0)
            else:
                ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self.block_manager.slot(seq, p) for p in range(start, end))
            query_start.append(len(ids))
            seq_lens.append(end)
            tables.append(list(seq.block_table))
            if item.sample:
                rows.append(len(ids) - 1)
                sampled.append(seq)
        return StepInput(
            step_id=next(self._step_ids),
            input_ids=ids,
            positions=positions,
            query_start=query_start,
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slots,
            sample_rows=rows,
            sampling=_sampling_batch(sampled, batch.ahead) if sampled else None,
            num_steps=batch.num_steps,
            trace=self.trace_steps,
        )

    def _append_results(self, batch: MicroBatch, result: StepOutput
                        ) -> tuple[list[Sequence], list[Sequence]]:
        """Append each sequence's sampled tokens in order, up to its first stop.

        Everything the next micro-batch depends on happens here: tokens appended,
        stops by id, length or stop string applied, finished sequences' blocks
        released. Tokens a multi-step decode sampled past a stop are dropped.
        Sequences with stop strings are detokenized after every token; the others'
        text is left to :meth:`_finish_text` (returned second), which runs while
        the next micro-batch is on the device. Returns ``(sequences, text pending)``.
        """
        self.scheduler.complete(batch)
        sampled = [item.seq for item in batch.seqs if item.sample]
        assert len(sampled) == len(result.token_ids), (len(sampled), len(result.token_ids))
        logprobs = result.logprobs or [None] * len(sampled)
        rows = [(seq, tokens, row_logprobs)
                for seq, tokens, row_logprobs in zip(sampled, result.token_ids, logprobs)
                if seq.status is SequenceStatus.RUNNING]  # others were aborted in flight
        by_tokens = [row for row in rows if not row[0].params.stop_strings]
        for seq, tokens, row_logprobs in by_tokens:
            self._append_tokens(seq, tokens, row_logprobs)
        by_text = [row for row in rows if row[0].params.stop_strings]
        for j in range(batch.num_steps if by_text else 0):
            live = [row for row in by_text if row[0].status is SequenceStatus.RUNNING]
            for seq, tokens, row_logprobs in live:
                self._append_tokens(seq, tokens[j:j + 1],
                                    row_logprobs[j:j + 1] if row_logprobs else None,
                                    length_stops=False)  # a stop string outranks the length
            self._detokenize([row[0] for row in live])
        seqs = [row[0] for row in rows]
        for seq in seqs:
            if seq.finished:
                self.scheduler.finish(seq)
        return seqs, [row[0] for row in by_tokens]

    def _finish_text(self, seqs: list[Sequence], text_pending: list[Sequence]
                     ) -> list[RequestOutput]:
        self._detokenize(text_pending)
        return self._outputs_of(seqs)

    def _append_tokens(self, seq: Sequence, tokens: list[int],
                       row_logprobs: list[RowLogprobs] | None, length_stops: bool = True) -> None:
        """Append sampled tokens up to the first that stops ``seq`` by id or by length.

        Stop and EOS ids count once ``min_tokens`` are out; the token that reaches
        ``max_tokens`` or ``max_model_len`` ends the sequence unless
        ``length_stops`` is off (the caller then checks stop strings first).
        """
        params, out = seq.params, seq.output_token_ids
        before = len(out)
        take = len(tokens)
        if length_stops:
            take = min(take, self.scheduler.room(seq))
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        stopped_by = None
        if stop_ids:
            for j in range(max(0, params.min_tokens - before - 1), take):
                if tokens[j] in stop_ids:
                    take, stopped_by = j + 1, tokens[j]
                    break
        out.extend(tokens[:take])
        self.stats.tokens_generated += take
        if seq.logprobs is not None and row_logprobs is not None:
            seq.logprobs.extend(self._logprob_dict(t, lp)
                                for t, lp in zip(tokens[:take], row_logprobs))
        if stopped_by is not None:
            seq.finish("stop", stopped_by if stopped_by in params.stop_token_ids else None)
        elif length_stops and self.scheduler.room(seq) == 0:
            seq.finish("length")

    def _detokenize(self, seqs: list[Sequence]) -> None:
        """Extend the sequences' text; apply stop strings (then the length limit to those
        sequences); release the held-back text of finished sequences."""
        if not seqs:
            return
        detokenizer.append_text(self.tokenizer, seqs)
        for seq in seqs:
            if not seq.finished and seq.params.stop_strings:
                self._stop_by_text(seq)
            if seq.finished and not isinstance(seq.stop_reason, str):  # not cut at a stop string
                detokenizer.flush(self.tokenizer, seq)

    def _stop_by_text(self, seq: Sequence) -> None:
        """Stop strings (once ``min_tokens`` are out), then the length limit."""
        if len(seq.output_token_ids) >= seq.params.min_tokens and self._truncate_at_stop_string(seq):
            return
        if self.scheduler.room(seq) <= 0:
            seq.finish("length")

    def _outputs_of(self, seqs: list[Sequence]) -> list[RequestOutput]:
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for seq in seqs:
            request = self.requests.get(seq.request_id)
            if request is not None:
                if request.first_token_time is None:
                    request.first_token_time = now
                touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            finished = request.finished
            if finished or self.emit_unfinished:
                outputs.append(self._request_output(request))
            if finished:
                del self.requests[request.request_id]
        return outputs

    @staticmethod
    def _truncate_at_stop_string(seq: Sequence) -> bool:
        for stop in seq.params.stop_strings:
            at = seq.text.find(stop)
            if at >= 0:
                end = at + len(stop) if seq.params.include_stop_str_in_output else at
                seq.text = seq.text[:end]
                seq.finish("stop", stop)
                return True
        return False

    def _logprob_dict(self, token: int, row: RowLogprobs) -> dict[int, Logprob]:
        out = {
            tid: Logprob(lp, rank + 1, self.tokenizer.decode([tid]))
            for rank, (tid, lp) in enumerate(zip(row.top_ids, row.top_logprobs))
        }
        if token not in out:
            out[token] = Logprob(row.sampled_logprob, row.sampled_rank, self.tokenizer.decode([token]))
        return out

    def _request_output(self, request: Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            )
            for seq in request.seqs
        ]
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["first_token_time"] = request.first_token_time
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             completions, request.finished, metrics, request.error)

    # -- lifecycle -------------------------------------------------------------------------
    def repair(self) -> bool:
        """With no request in the engine, replace stage workers the watchdog found dead,
        so an idle engine heals before traffic returns (a load balancer that reads
        ``/health`` would otherwise never send the request that heals it). Counts
        against ``max_restarts``. True if the engine is healthy afterwards."""
        if self._dead or self.requests:
            return False
        if not self._needs_restart:
            if self.executor.check_health():
                return True
            self._on_executor_failure(StageDiedError("a stage died while the engine was idle"))
        try:
            return self._restart()
        except EngineDeadError:
            return False

    def is_healthy(self) -> bool:
        """False while stages are dead or being replaced, and once the engine stopped."""
        return not self._dead and not self._needs_restart and self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers (idempotent); later steps raise :class:`EngineDeadError`."""
        self._dead = self._dead or "engine was shut down"
        self.executor.shutdown()


def _sampling_batch(seqs: list[Sequence], ahead: int = 0) -> SamplingBatch:
    """The rows' sampling settings; ``ahead``: tokens each samples in flight before these."""
    params = [s.params for s in seqs]
    penalized = [p.uses_penalties for p in params]
    return SamplingBatch(
        temperature=[p.temperature for p in params],
        top_p=[p.top_p for p in params],
        top_k=[p.top_k for p in params],
        min_p=[p.min_p for p in params],
        seeds=[s.seed for s in seqs],
        output_index=[len(s.output_token_ids) + ahead for s in seqs],
        num_logprobs=[-1 if p.logprobs is None else p.logprobs for p in params],
        presence_penalty=[p.presence_penalty for p in params],
        frequency_penalty=[p.frequency_penalty for p in params],
        repetition_penalty=[p.repetition_penalty for p in params],
        prompt_tokens=[s.prompt_token_ids if pen else [] for s, pen in zip(seqs, penalized)],
        output_tokens=[s.output_token_ids if pen else [] for s, pen in zip(seqs, penalized)],
    )
