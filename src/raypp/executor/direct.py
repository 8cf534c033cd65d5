"""The ``direct`` control plane: stage loops fed by a message queue, no compiled graph.

Ray places and supervises the stage actors exactly as for the compiled graph (the
same :class:`~raypp.executor.stage_pool.StagePool`). Then each worker runs a loop
(:class:`raypp.worker.stage_loop.StageLoop`, on threads of its actor) that takes step
descriptors from its queue, receives the previous stage's hand-off over the PP group,
runs the same ``StageWorker.execute_step`` and sends its hand-off on; the last stage
pushes its :class:`~raypp.step.StepOutput` to the driver's result queue.

The driver sends every step to every stage at ``submit``, so up to
``executor_depth`` micro-batches are in the pipeline at once; stages process steps
in submission order. A step that fails in a stage is passed down as a failure
marker instead of tensors, so only that step fails and the pipeline stays usable.
A stage whose actor dies, or whose loop breaks (e.g. the PP group lost a peer),
makes :meth:`DirectExecutor.result` raise
:class:`~raypp.errors.StageDiedError` within seconds: the driver waits on its
result queue in short slices and pings the stage actors whenever a slice passes
without a result; it reads their progress too, and gives up on a step only once
no stage has advanced for the step timeout (:mod:`raypp.executor.liveness`).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from typing import Any

import ray

from raypp.config import EngineConfig
from raypp.distributed import message_queue as mq
from raypp.errors import StageError, StepTimeoutError
from raypp.executor.base import Executor
from raypp.step import StepInput, StepOutput
from raypp.worker.stage_loop import SEND_TIMEOUT_S, SLICE_S, LoopSpec

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 60.0  # stage loops connecting at start-up
_STOP_WAIT_S = 2.0  # clean loop exit at shutdown before the actors are killed
_FATAL_CONFIRM_S = 3.0  # after a loop broke: how long to wait for Ray to confirm a death


class DirectExecutor(Executor):
    """Drives the stage pool through per-worker queues and the PP group.

    ``transport`` picks the queue transport: ``"auto"`` (``ipc://`` for stages on the
    driver's node, ``tcp://`` for others), ``"ipc"`` or ``"tcp"`` (loopback for local
    stages).
    """

    control_plane = "direct"

    def __init__(self, config: EngineConfig, transport: str = "auto"):
        if transport not in ("auto", "ipc", "tcp"):
            raise ValueError(f"transport must be 'auto', 'ipc' or 'tcp', got {transport!r}")
        self._transport = transport
        self.stage_pids: list[int] = []
        self._ctx = mq.new_context()
        self._ipc_dir: mq.IpcDir | None = None
        self._steps: list[mq.Sender] = []  # one queue per worker, in rank order
        self._results: mq.Receiver | None = None
        self._pending: set[int] = set()
        self._done: dict[int, tuple[str, Any]] = {}
        super().__init__(config)

    def _start_plane(self) -> None:
        self._start_loops(self._open_queues(self._transport))

    def _open_queues(self, transport: str) -> list[LoopSpec]:
        here = ray.get_runtime_context().get_node_id()
        nodes = self.pool.call_all("node_id", 60)
        local = [node == here for node in nodes]
        if transport == "ipc" and not all(local):
            raise ValueError("transport='ipc' needs every stage on the driver's node")
        use_ipc = [is_local and transport != "tcp" for is_local in local]
        tcp_ip = "127.0.0.1" if all(local) else ray.util.get_node_ip_address()
        if any(use_ipc):
            self._ipc_dir = mq.IpcDir()
        bind = []
        if any(use_ipc):
            bind.append(self._ipc_dir.address("results"))
        if not all(use_ipc):
            bind.append(mq.tcp_address(tcp_ip))
        self._results = mq.Receiver(self._ctx, bind=bind)
        ipc_results = self._results.addresses[0] if any(use_ipc) else None
        tcp_results = self._results.addresses[-1] if not all(use_ipc) else None
        specs = []
        last_stage_rank0 = (self.pp_size - 1) * self.tp_size
        for index, ipc in enumerate(use_ipc):
            address = self._ipc_dir.address(f"steps{index}") if ipc else mq.tcp_address(tcp_ip)
            sender = mq.Sender(self._ctx, bind=address)
            self._steps.append(sender)
            specs.append(LoopSpec(index, sender.address, ipc_results if ipc else tcp_results,
                                   replies=index == last_stage_rank0))
        logger.info("direct control plane: step queues %s", [s.address for s in self._steps])
        return specs

    def _start_loops(self, specs: list[LoopSpec]) -> None:
        refs = [w.start_direct_loop.remote(spec)
                for w, spec in zip(self.all_workers, specs, strict=True)]
        self.stage_pids = self.pool.gather(refs)
        ready: set[int] = set()
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while len(ready) < len(specs):
            msg = self._results.recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                missing = [self.pool.name(i) for i in range(len(specs)) if i not in ready]
                raise TimeoutError(f"loops of {missing} did not connect within "
                                   f"{_READY_TIMEOUT_S:g} s")
            if msg[0] == "fatal":
                raise self._died(f"{self.pool.name(msg[1])}: loop failed to start: {msg[2]}")
            if msg[0] == "ready":
                ready.add(msg[1])

    # -- stepping -------------------------------------------------------------------
    def submit(self, step: StepInput) -> int:
        """Send the step to every stage; returns its handle (the step id)."""
        if step.step_id in self._pending:
            raise ValueError(f"step id {step.step_id} is already in flight")
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            while (msg := self._recv(0)) is not None:  # a loop that broke while idle
                self._on_message(msg)
            self._check_not_broken()
            for index, sender in enumerate(self._steps):
                try:
                    sender.send_bytes(data, SEND_TIMEOUT_S)
                except TimeoutError as e:
                    self._raise_if_stage_died()
                    raise self._broken_by(StepTimeoutError(
                        f"{self.pool.name(index)} took no step for {SEND_TIMEOUT_S:g} s "
                        "though its actor is alive")) from e
        self._pending.add(step.step_id)
        return step.step_id

    def result(self, handle: int, timeout: float | None = None) -> StepOutput:
        if handle not in self._pending:
            raise ValueError(f"step {handle} was not submitted or its result was taken")
        watch = self.pool.watch(self.step_timeout_s if timeout is None else timeout)
        while handle not in self._done:
            self._check_not_broken()
            with self._lock:
                msg = self._recv(min(watch.interval_s, SLICE_S))
            if msg is not None:
                self._on_message(msg)
                continue
            self._raise_if_stage_died()
            if watch.stalled():
                raise self._no_result(watch)
        self._pending.discard(handle)
        kind, value = self._done.pop(handle)
        if kind == "err":
            raise StageError(value)
        return value

    def _recv(self, timeout_s: float) -> Any:
        self._check_not_broken()
        return self._results.recv(timeout_s)

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("out", "err"):
            self._done[msg[1]] = (kind, msg[2])
        elif kind == "fatal":
            # A loop breaks when its PP peer dies (gloo sees the reset first): name the
            # dead stage if Ray confirms one within a moment, else the broken loop.
            deadline = time.monotonic() + _FATAL_CONFIRM_S
            while not self.pool.dead_stages() and time.monotonic() < deadline:
                time.sleep(0.2)
            raise self._died(f"{self.pool.name(msg[1])}: loop stopped: {msg[2]}")

    def _raise_if_stage_died(self) -> None:
        if self.pool.dead_stages():
            raise self._died("a stage died")

    def _plane_alive(self, timeout: float) -> bool:
        return all(self.pool.call_all("direct_loop_alive", timeout))

    # -- teardown -------------------------------------------------------------------------
    def _stop_plane(self) -> None:
        if self._results is not None and self.stage_pids:
            self._stop_loops()

    def _release_plane(self) -> None:
        for sender in self._steps:
            sender.close()
        self._steps = []
        if self._results is not None:
            self._results.close()
            self._results = None
        if not self._ctx.closed:
            self._ctx.destroy(linger=0)
        if self._ipc_dir is not None:
            self._ipc_dir.remove()
            self._ipc_dir = None

    def _stop_loops(self) -> None:
        stopped: set[int] = set()
        with contextlib.suppress(TimeoutError):
            for sender in self._steps:
                sender.send(("stop",), timeout_s=0.5)
            deadline = time.monotonic() + _STOP_WAIT_S
            while len(stopped) < len(self._steps) and time.monotonic() < deadline:
                msg = self._results.recv(max(0.0, deadline - time.monotonic()))
                if msg is not None and msg[0] == "stopped":
                    stopped.add(msg[1])
        if len(stopped) < len(self._steps):
            logger.warning("loops of %s did not stop within %g s; killing them",
                           [self.pool.name(i) for i in range(len(self._steps)) if i not in stopped],
                           _STOP_WAIT_S)
