"""The direct control plane's loop inside one stage worker: no compiled graph.

Per step it takes the next step descriptor from the worker's queue (ZeroMQ PULL; a
blocking wait), after the first stage receives the previous stage's hand-off over
the PP group (``recv_tensor_dict``), runs ``StageWorker.execute_step`` — the same
per-step compute the compiled graph runs — and sends its hand-off on
(``send_tensor_dict``), or (last stage) pushes the :class:`~raypp.step.StepOutput`
to the driver's result queue. The driver side is :mod:`raypp.executor.direct`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from raypp.distributed import message_queue as mq
from raypp.distributed import parallel_state
from raypp.errors import StageError
from raypp.step import StageHandoff

logger = logging.getLogger(__name__)

SLICE_S = 1.0  # longest blocking wait before a loop thread re-checks whether to stop
SEND_TIMEOUT_S = 2.0  # a queue with a live, connected peer takes a message at once
_QUEUE_DEPTH = 4  # steps buffered between a stage's threads
_FAILED = "__raypp_step_failed__"  # key of a failure marker sent down the pipeline


class StepRunner(Protocol):
    """What the loop needs of its worker: the per-step compute of the stage."""

    def execute_step(self, payload: Any) -> Any: ...


@dataclass(frozen=True)
class LoopSpec:
    """Where one worker's loop connects; made by the driver."""

    index: int  # the worker's global rank: pp_rank * tp_size + tp_rank
    steps_address: str  # the worker's step queue (it connects a PULL)
    results_address: str  # the driver's result queue (it connects a PUSH)
    replies: bool  # the last stage's TP rank 0 returns step outputs; its TP peers agree


_STOP = object()  # ends a thread of the stage loop, in FIFO order behind the steps


class StageLoop:
    """The direct plane inside one worker: three threads joined by FIFO queues.

    Every worker of every stage runs one; with TP, the workers of a stage run the
    same steps in the same order (their all-reduces pair up) and each sends to its
    own lane's next stage over its lane's PP group.

    ``intake`` takes descriptors from the step queue and, after the first stage,
    receives the step's tensors (``recv_tensor_dict``); ``compute`` runs
    ``execute_step``; ``send`` passes tensors on (``send_tensor_dict``) — the last
    stage's ``compute`` replies to the driver instead. So a stage receives step
    k+1 and sends step k-1 while it computes step k: transfers overlap compute.
    Every wait blocks with a timeout (zmq poll, queue get/put); nothing spins.
    A step whose compute raises ``StageError`` is passed down as a failure marker;
    any other error ends the loop and is reported to the driver as fatal.
    """

    def __init__(self, worker: StepRunner, spec: LoopSpec):
        self.worker, self.spec = worker, spec
        self.rank = spec.index
        self.pp = parallel_state.get_pp_group()
        self.stop = threading.Event()
        self.ctx = mq.new_context()
        self._results = mq.Sender(self.ctx, connect=spec.results_address)
        self._results_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._work: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._outgoing: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
        parts = [self._intake, self._compute] + ([] if self.pp.is_last_rank else [self._send])
        self.threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True,
                                         name=f"raypp-direct-w{self.rank}-{fn.__name__[1:]}")
                        for fn in parts]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def alive(self) -> bool:
        return not self.stop.is_set() and all(t.is_alive() for t in self.threads)

    # -- the three threads --------------------------------------------------------------
    def _intake(self) -> None:
        steps = mq.Receiver(self.ctx, connect=self.spec.steps_address)
        try:
            self._report(("ready", self.rank, os.getpid()))
            while not self.stop.is_set():
                msg = steps.recv(SLICE_S)  # blocks in zmq_poll: an idle stage sleeps
                if msg is None:
                    continue
                if isinstance(msg, tuple):  # ("stop",)
                    self._put(self._work, _STOP)
                    return
                pp = self.pp
                received = None
                if not pp.is_first_rank:  # the previous stage may compute long: wait for it
                    self._wait_for_previous_stage()
                    received = pp.recv_tensor_dict(pp.prev_rank)
                self._put(self._work, (msg, received))
        finally:
            steps.close()

    def _wait_for_previous_stage(self) -> None:
        """Until the previous stage sends, however long its step (the driver's progress
        watch bounds a stuck one); :class:`_Stopped` once the loop stops."""
        try:
            self.pp.wait_for_message(self.pp.prev_rank, lambda: not self.stop.is_set())
        except RuntimeError:
            if self.stop.is_set():
                raise _Stopped from None
            raise

    def _compute(self) -> None:
        while (item := self._get(self._work)) is not _STOP:
            step, received = item
            failure = received.get(_FAILED) if received is not None else None
            if failure is None:
                payload = step if received is None else StageHandoff.from_tensors(step, received)
                try:
                    out = self.worker.execute_step(payload)
                except StageError as e:
                    failure = str(e)
            if self.pp.is_last_rank:
                if self.spec.replies:
                    self._report(("err", step.step_id, failure) if failure
                                 else ("out", step.step_id, out))
            else:
                self._put(self._outgoing, {_FAILED: failure} if failure else out.tensors())
        if self.pp.is_last_rank:
            self._finish()
        else:
            self._put(self._outgoing, _STOP)

    def _send(self) -> None:
        while (tensors := self._get(self._outgoing)) is not _STOP:
            self.pp.send_tensor_dict(tensors, self.pp.next_rank)
        self._finish()

    # -- plumbing -----------------------------------------------------------------------
    def _guard(self, fn: Any) -> None:
        try:
            fn()
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - reported, then the loop ends
            logger.exception("worker %d direct-plane %s thread failed", self.rank, fn.__name__)
            self.stop.set()
            with contextlib.suppress(Exception):
                self._report(("fatal", self.rank, f"{type(e).__name__}: {e}"))

    def _get(self, q: queue.Queue) -> Any:
        while True:
            try:
                return q.get(timeout=SLICE_S)
            except queue.Empty:
                if self.stop.is_set():
                    raise _Stopped from None

    def _put(self, q: queue.Queue, item: Any) -> None:
        while True:
            try:
                return q.put(item, timeout=SLICE_S)
            except queue.Full:
                if self.stop.is_set():
                    raise _Stopped from None

    def _report(self, msg: tuple) -> None:
        with self._results_lock:
            self._results.send(msg, SEND_TIMEOUT_S)

    def _finish(self) -> None:
        """The last thread to stop says so, then closes the loop's sockets."""
        self._report(("stopped", self.rank))
        self.stop.set()
        with self._results_lock:
            self._results.close()
        self.ctx.term()


class _Stopped(Exception):
    """Raised in a loop thread waiting on a queue once another thread has failed."""
