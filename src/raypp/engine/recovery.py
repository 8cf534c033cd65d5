"""Recovery from a failed pipeline: no request lost, a poison request named, restarts bounded.

When a stage dies or is stuck (the executor raises ``StageDiedError`` or
``StepTimeoutError``), :meth:`Recovery.on_failure`:

1. shuts the executor down and completes every micro-batch in flight as failed (nothing
   it fed counts as computed);
2. counts a strike against each request that had a sequence in flight
   (:class:`~raypp.engine.quarantine.Quarantine`): one at ``max_failures_per_request``
   strikes in a row (no token produced between them) is failed with
   ``ErrorKind.POISON_REQUEST`` and an error naming it; the others in flight become
   suspects, held out of the scheduler;
3. re-queues every other running sequence.

Before the next step :meth:`Recovery.restart` replaces the executor (at most
``max_restarts`` within ``restart_window_s``; past that the engine stops and every request
fails with ``ErrorKind.ENGINE_DEAD``) and the driver-side state that mirrors the workers
(the block manager with its prefix cache, the step builder's record of held tables). Then
suspects go back to the scheduler one at a time (:meth:`Recovery.release`).

What a re-queued sequence keeps: its output tokens, text, logprobs and grammar state. It
recomputes the KV of its prompt and output as a prefill and samples its next token as
the uninterrupted run would: sampling is counter-based (each token's randomness is a
function of the sequence's seed and the token's index; an unseeded request's seed is
drawn once, when it arrives), so greedy and sampled requests alike continue with the
same draw. The one difference from a run without the fault is numerical: logits from a
prefill over the same tokens may differ from those of decode steps in the last bits,
so a near-tie can resolve differently (the same as after preemption by recompute).
A stream sees a pause, never a token twice: what was already returned is not returned
again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Protocol

from raypp.config import EngineConfig
from raypp.engine.block_manager import BlockManager
from raypp.engine.occupancy import OccupancyMonitor
from raypp.engine.quarantine import Quarantine
from raypp.engine.scheduler import Scheduler
from raypp.engine.sequence import Request
from raypp.engine.step_builder import StepBuilder
from raypp.errors import EngineDeadError, ErrorKind, StageDiedError, first_line
from raypp.executor.base import Executor, make_executor
from raypp.outputs import RequestOutput

logger = logging.getLogger(__name__)


class Pipeline(Protocol):
    """What recovery reads and replaces of the engine (:class:`~raypp.engine.engine.LLMEngine`)."""

    config: EngineConfig
    executor: Executor
    scheduler: Scheduler
    block_manager: BlockManager
    step_builder: StepBuilder
    occupancy: OccupancyMonitor
    requests: dict[str, Request]
    _inflight: deque[Any]  # the engine's micro-batches in flight, oldest first

    def _fail_request(self, request: Request, error: str, kind: ErrorKind) -> RequestOutput: ...

    def _fail_all(self, message: str) -> None: ...

    def _new_block_manager(self) -> BlockManager: ...


class Recovery:
    """The engine's failure handling (module docstring). Not thread-safe: the engine's
    one stepping thread calls it."""

    def __init__(self, engine: Pipeline):
        self.engine = engine
        runtime = engine.config.runtime
        self.max_restarts, self.window_s = runtime.max_restarts, runtime.restart_window_s
        self.quarantine = Quarantine(runtime.max_failures_per_request)
        self.restarts: deque[float] = deque()  # times of recent executor replacements
        self.needs_restart = False
        self.dead: str | None = None  # why the engine stopped
        self.last_restart_error = ""
        self.requeued = 0  # sequences re-queued by failures (stats)

    # -- a failure -------------------------------------------------------------------------
    def on_failure(self, error: Exception) -> list[RequestOutput]:
        """Handle a dead or stuck pipeline; the outputs of the requests it fails."""
        engine = self.engine
        kind = (ErrorKind.STAGE_DIED if isinstance(error, StageDiedError)
                else ErrorKind.STEP_TIMEOUT)
        failed = list(engine._inflight)
        engine._inflight.clear()
        logger.error("pipeline failed (%s, %d micro-batch(es) in flight): %s; replacing the "
                     "stage workers", kind.value, len(failed), error)
        # the in-flight handles outlive the shutdown: a compiled graph's result reference
        # dropped while its graph is still up tries to release a closed channel
        engine.executor.shutdown()
        in_flight: dict[str, Request] = {}
        for item in failed:
            engine.scheduler.complete(item.batch, ok=False)
            for scheduled in item.batch.seqs:
                request = engine.requests.get(scheduled.seq.request_id)
                if request is not None and not request.finished:
                    in_flight.setdefault(request.request_id, request)
        outputs = []
        for request in self.quarantine.on_failure(list(in_flight.values())):
            outputs.append(engine._fail_request(request, self._poison_error(request, error), (
                ErrorKind.POISON_REQUEST if self.quarantine.limit > 1 else kind)))
        self._requeue_all()
        self.needs_restart = True
        return outputs

    def _poison_error(self, request: Request, error: Exception) -> str:
        limit = self.quarantine.limit
        if limit == 1:  # every request in flight fails, as it did before recovery re-queued
            kind = ErrorKind.STAGE_DIED if isinstance(error, StageDiedError) else ErrorKind.STEP_TIMEOUT
            return f"{kind.value}: {error}"
        return (f"{ErrorKind.POISON_REQUEST.value}: request {request.request_id!r} was in "
                f"flight at {limit} pipeline failures in a row, producing no token between "
                f"them (max_failures_per_request={limit}): it is their likely cause and is "
                f"not re-queued again; the last failure: {first_line(error)}")

    def _requeue_all(self) -> None:
        """Every running sequence back to the queue (their KV cache dies with the workers);
        a suspect's sequences are held out of the scheduler instead."""
        scheduler = self.engine.scheduler
        for seq in list(scheduler.running):
            if self.quarantine.is_suspect(seq.request_id):
                scheduler.finish(seq)  # held by the quarantine, not finished
            else:
                scheduler.requeue(seq)
            self.requeued += 1
        for seq in list(scheduler.waiting):
            if self.quarantine.is_suspect(seq.request_id):
                scheduler.finish(seq)

    # -- after it ----------------------------------------------------------------------------
    def release(self) -> None:
        """Put the next suspect back in the scheduler once the one on trial produced a
        token (cheap when there is none)."""
        request = self.quarantine.release(self.engine.requests)
        if request is not None:
            for seq in reversed(request.seqs):
                if not seq.finished:
                    self.engine.scheduler.readmit(seq)

    def restart(self) -> bool:
        """Replace the stage workers; False if that failed (the next step tries again).
        Every attempt, failed or not, counts against ``max_restarts``; once they are spent
        the engine stops (:class:`EngineDeadError`, every request failed)."""
        engine, now = self.engine, time.monotonic()
        while self.restarts and now - self.restarts[0] > self.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            self.dead = (f"engine stopped: {len(self.restarts)} restarts within "
                         f"{self.window_s:g} s (max_restarts={self.max_restarts})"
                         + (f"; last: {self.last_restart_error}" if self.last_restart_error
                            else ""))
            engine._fail_all(self.dead)
            raise EngineDeadError(self.dead)
        self.restarts.append(now)
        try:
            engine.executor = make_executor(engine.config)
        except Exception as e:  # noqa: BLE001 - reported, and retried within max_restarts
            self.last_restart_error = f"replacing the stage workers failed: {first_line(e)}"
            logger.error("%s", self.last_restart_error)
            return False
        self.last_restart_error = ""
        # the new workers' caches are empty: forget every cached prefix (no block is in
        # use: failed requests were finished and the others requeued or held)
        engine.block_manager = engine.scheduler.blocks = engine._new_block_manager()
        engine.step_builder.reset()  # nor do they hold any block table
        engine.occupancy.reset()  # nor their occupancy counters
        self.needs_restart = False
        logger.info("stage workers replaced (%d restart(s) in window); %d request(s) wait to "
                    "recompute one at a time as suspects", len(self.restarts),
                    self.quarantine.num_held)
        return True
