"""The ``direct`` control plane: stage loops fed by a message queue, no compiled graph.

Ray places and supervises the stage actors exactly as for the compiled graph
(:class:`~raypp.executor.ray_executor.StageActors`). Then each stage runs a loop
(:class:`_StageLoop`, on threads of its actor) that, per step:

1. takes the next step descriptor from its queue (ZeroMQ PULL; a blocking wait),
2. after the first stage: ``recv_tensor_dict`` from the previous stage over the
   PP group,
3. runs ``StageWorker.execute_step`` — the same per-step compute the compiled
   graph runs,
4. ``send_tensor_dict`` to the next stage, or (last stage) pushes the
   :class:`StepOutput` to the driver's result queue.

The driver sends every step to every stage at ``submit``, so up to
``max_inflight`` micro-batches are in the pipeline at once; stages process steps
in submission order. A step that fails in a stage is passed down as a failure
marker instead of tensors, so only that step fails and the pipeline stays usable.
A stage whose actor dies, or whose loop breaks (e.g. the PP group lost a peer),
makes :meth:`DirectExecutor.result` raise
:class:`~raypp.executor.errors.StageDiedError` within seconds: the driver waits
on its result queue in short slices and pings the stage actors whenever a slice
passes without a result. Errors are those of :mod:`raypp.executor.errors`, as
for the compiled graph, so the engine handles both planes alike.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import queue
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from raypp import envs
from raypp.config import EngineConfig
from raypp.distributed import parallel_state
from raypp.engine.step import StepInput, StepOutput
from raypp.executor import message_queue as mq
from raypp.executor.errors import (
    StageDiedError,
    StageError,
    StepTimeoutError,
    first_line,
)
from raypp.executor.ray_executor import StageActors, ensure_ray
from raypp.executor.worker import StageWorker

logger = logging.getLogger(__name__)

_SLICE_S = 1.0  # longest blocking wait before a loop or the driver re-checks its peers
_PING_TIMEOUT_S = 3.0  # a live actor answers a ping well within this
_SEND_TIMEOUT_S = 2.0  # a queue with a live, connected peer takes a message at once
_READY_TIMEOUT_S = 60.0  # stage loops connecting at start-up
_STOP_WAIT_S = 2.0  # clean loop exit at shutdown before the actors are killed
_QUEUE_DEPTH = 4  # steps buffered between a stage's threads
_FAILED = "__raypp_step_failed__"  # key of a failure marker sent down the pipeline


@dataclass(frozen=True)
class _LoopSpec:
    index: int  # the worker's global rank: pp_rank * tp_size + tp_rank
    steps_address: str  # the worker's step queue (it connects a PULL)
    results_address: str  # the driver's result queue (it connects a PUSH)
    replies: bool  # the last stage's TP rank 0 returns step outputs; its TP peers agree


class DirectExecutor:
    """Drives the stage actors of one engine through queues and the PP group.

    Same API as :class:`~raypp.executor.ray_executor.RayExecutor`. ``transport``
    picks the queue transport: ``"auto"`` (``ipc://`` for stages on the driver's
    node, ``tcp://`` for others), ``"ipc"`` or ``"tcp"`` (loopback for local stages).
    """

    control_plane = "direct"

    def __init__(self, config: EngineConfig, transport: str = "auto"):
        if transport not in ("auto", "ipc", "tcp"):
            raise ValueError(f"transport must be 'auto', 'ipc' or 'tcp', got {transport!r}")
        self.config = config
        pc = config.parallel
        self.pp_size, self.tp_size = pc.pipeline_parallel_size, pc.tensor_parallel_size
        self.namespace = f"raypp-{uuid.uuid4().hex[:8]}"
        self._actors = StageActors(config, self.namespace)
        self.workers = self._actors.workers  # [pp_rank][tp_rank]
        self.stage_pids: list[int] = []
        self._ctx = mq.new_context()
        self._ipc_dir: mq.IpcDir | None = None
        self._steps: list[mq.Sender] = []  # one queue per stage, in PP order
        self._results: mq.Receiver | None = None
        self._pending: set[int] = set()
        self._done: dict[int, tuple[str, Any]] = {}
        self._broken: str | None = None
        self._lock = threading.RLock()  # the driver's sockets: shutdown may come from any thread
        ensure_ray(pc.ray_address)
        try:
            self.num_kv_blocks = self._actors.start()
            self.load_info = self._actors.load_info
            specs = self._open_queues(transport)
            self._start_loops(specs)
        except BaseException:
            self.shutdown()
            raise
        _LIVE.add(self)

    # -- start-up ----------------------------------------------------------------------
    @property
    def all_workers(self) -> list[Any]:
        """Every worker, by global rank (``pp_rank * tp_size + tp_rank``)."""
        return self._actors.all_workers

    def _name(self, index: int) -> str:
        pp_rank, tp_rank = divmod(index, self.tp_size)
        return f"stage {pp_rank} (actor raypp_worker_{pp_rank}_{tp_rank})"

    def _open_queues(self, transport: str) -> list[_LoopSpec]:
        here = ray.get_runtime_context().get_node_id()
        workers = self.all_workers
        nodes = self._actors.gather([w.__ray_call__.remote(_node_id) for w in workers])
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
            specs.append(_LoopSpec(index, sender.address, ipc_results if ipc else tcp_results,
                                   replies=index == last_stage_rank0))
        logger.info("direct control plane: step queues %s", [s.address for s in self._steps])
        return specs

    def _start_loops(self, specs: list[_LoopSpec]) -> None:
        refs = [w.__ray_call__.remote(_start_stage_loop, spec)
                for w, spec in zip(self.all_workers, specs, strict=True)]
        self.stage_pids = self._actors.gather(refs)
        ready: set[int] = set()
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while len(ready) < len(specs):
            msg = self._results.recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                missing = [self._name(i) for i in range(len(specs)) if i not in ready]
                raise TimeoutError(f"loops of {missing} did not connect within "
                                   f"{_READY_TIMEOUT_S:g} s")
            if msg[0] == "fatal":
                raise StageDiedError(f"{self._name(msg[1])}: loop failed to start: {msg[2]}")
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
            self._raise_if_broken()
            for index, sender in enumerate(self._steps):
                try:
                    sender.send_bytes(data, _SEND_TIMEOUT_S)
                except TimeoutError as e:
                    self._check_stages()
                    raise StepTimeoutError(
                        f"{self._name(index)} took no step for {_SEND_TIMEOUT_S:g} s though "
                        "its actor is alive") from e
        self._pending.add(step.step_id)
        return step.step_id

    def result(self, handle: int, timeout: float | None = None) -> StepOutput:
        """The step's output; :class:`StageError` if it failed in a stage,
        :class:`StageDiedError` if a stage died (within seconds), and
        :class:`StepTimeoutError` after ``timeout`` (default ``RAYPP_STEP_TIMEOUT_S``)
        seconds without a result while every stage is alive."""
        if handle not in self._pending:
            raise ValueError(f"step {handle} was not submitted or its result was taken")
        timeout = envs.RAYPP_STEP_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while handle not in self._done:
            self._raise_if_broken()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._actors.log_stacks()
                raise StepTimeoutError(
                    f"no step result within {timeout:g} s although every stage answers "
                    "(RAYPP_STEP_TIMEOUT_S): a stage is stuck")
            with self._lock:
                msg = self._recv(min(remaining, _SLICE_S))
            if msg is None:
                self._check_stages()
            else:
                self._on_message(msg)
        self._pending.discard(handle)
        kind, value = self._done.pop(handle)
        if kind == "err":
            raise StageError(value)
        return value

    def _recv(self, timeout_s: float) -> Any:
        if self._results is None:
            raise StageDiedError(f"executor is shut down (namespace {self.namespace})")
        return self._results.recv(timeout_s)

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("out", "err"):
            self._done[msg[1]] = (kind, msg[2])
        elif kind == "fatal":
            # A loop breaks when its PP peer dies (gloo sees the reset first): name the
            # dead stage if Ray confirms one within a moment, else the broken loop.
            deadline = time.monotonic() + _PING_TIMEOUT_S
            while not (dead := self._dead_stages()) and time.monotonic() < deadline:
                time.sleep(0.2)
            self._broken = "; ".join(dead) or f"{self._name(msg[1])}: loop stopped: {msg[2]}"
            self._raise_if_broken()

    def _check_stages(self) -> None:
        """Raise ``StageDiedError`` naming every stage whose actor is dead."""
        dead = self._dead_stages()
        if dead:
            self._broken = "; ".join(dead)
            self._raise_if_broken()

    def _dead_stages(self) -> list[str]:
        refs = [w.ping.remote() for w in self.all_workers]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=_PING_TIMEOUT_S)
        dead = []
        for index, ref in enumerate(refs):
            if ref not in done:
                continue  # busy or slow, not known dead: the step timeout bounds the wait
            try:
                ray.get(ref, timeout=0)
            except RayActorError as e:
                dead.append(f"{self._name(index)} died: {type(e).__name__}: {first_line(e)}")
        return dead

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise StageDiedError(f"{self._broken} (direct control plane, namespace "
                                 f"{self.namespace})")

    # -- introspection ---------------------------------------------------------------------
    def comm_stats(self) -> list[dict[str, Any]]:
        return self._actors.gather([stage[0].comm_stats.remote() for stage in self.workers])

    def traced_intervals(self) -> list[tuple[int, float, float]]:
        out = []
        for intervals in self._actors.gather([w.traced_intervals.remote()
                                              for w in self.all_workers]):
            out.extend(intervals)
        return out

    def check_health(self, timeout: float = 5.0) -> bool:
        """True while no stage has died and every stage's loop is running."""
        if self._broken is not None or not self.workers:
            return False
        try:
            alive = ray.get([w.__ray_call__.remote(_loop_alive) for w in self.all_workers],
                            timeout=timeout)
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False
        return all(alive)

    # -- teardown -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the loops, close the queues, kill the actors (idempotent)."""
        _LIVE.discard(self)
        with self._lock:
            if self._results is not None and self._broken is None and self.stage_pids:
                self._stop_loops()
            for sender in self._steps:
                sender.close()
            self._steps = []
            if self._results is not None:
                self._results.close()
                self._results = None
            if not self._ctx.closed:
                self._ctx.destroy(linger=0)
        self._actors.kill()
        self.workers = []
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
                           [self._name(i) for i in range(len(self._steps)) if i not in stopped],
                           _STOP_WAIT_S)


_LIVE: weakref.WeakSet[DirectExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for executor in list(_LIVE):
        executor.shutdown()


# -- inside the stage actors (run through ``actor.__ray_call__``) -----------------------


def _node_id(worker: StageWorker) -> str:
    return ray.get_runtime_context().get_node_id()


def _loop_alive(worker: StageWorker) -> bool:
    loop = getattr(worker, "_direct_loop", None)
    return loop is not None and loop.alive()


def _start_stage_loop(worker: StageWorker, spec: _LoopSpec) -> int:
    """Start this stage's loop on threads of the actor; returns the actor's pid."""
    if _loop_alive(worker):
        raise RuntimeError(f"worker {spec.index} already runs a direct-plane loop")
    worker._direct_loop = _StageLoop(worker, spec)
    worker._direct_loop.start()
    return os.getpid()


_STOP = object()  # ends a thread of the stage loop, in FIFO order behind the steps


class _StageLoop:
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

    def __init__(self, worker: StageWorker, spec: _LoopSpec):
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
                msg = steps.recv(_SLICE_S)  # blocks in zmq_poll: an idle stage sleeps
                if msg is None:
                    continue
                if isinstance(msg, tuple):  # ("stop",)
                    self._put(self._work, _STOP)
                    return
                pp = self.pp
                inputs = None if pp.is_first_rank else pp.recv_tensor_dict(pp.prev_rank)
                self._put(self._work, (msg, inputs))
        finally:
            steps.close()

    def _compute(self) -> None:
        while (item := self._get(self._work)) is not _STOP:
            step, inputs = item
            failure = inputs.get(_FAILED) if inputs is not None else None
            if failure is None:
                try:
                    out = self.worker.execute_step(step if inputs is None else (step, inputs))
                except StageError as e:
                    failure = str(e)
            if self.pp.is_last_rank:
                if self.spec.replies:
                    self._report(("err", step.step_id, failure) if failure
                                 else ("out", step.step_id, out))
            else:
                self._put(self._outgoing, {_FAILED: failure} if failure else out[1])
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
                return q.get(timeout=_SLICE_S)
            except queue.Empty:
                if self.stop.is_set():
                    raise _Stopped from None

    def _put(self, q: queue.Queue, item: Any) -> None:
        while True:
            try:
                return q.put(item, timeout=_SLICE_S)
            except queue.Full:
                if self.stop.is_set():
                    raise _Stopped from None

    def _report(self, msg: tuple) -> None:
        with self._results_lock:
            self._results.send(msg, _SEND_TIMEOUT_S)

    def _finish(self) -> None:
        """The last thread to stop says so, then closes the loop's sockets."""
        self._report(("stopped", self.rank))
        self.stop.set()
        with self._results_lock:
            self._results.close()
        self.ctx.term()


class _Stopped(Exception):
    """Raised in a loop thread waiting on a queue once another thread has failed."""
