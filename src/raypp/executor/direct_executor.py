"""The ``direct`` control plane: stage loops fed by a message queue, no compiled graph.

Ray places and supervises the stage actors exactly as for the compiled graph
(:class:`~raypp.executor.ray_executor.StageActors`). Then each stage runs a loop
on a thread of its actor:

1. take the next step descriptor from its queue (ZeroMQ PULL; a blocking wait),
2. stages after the first: ``recv_tensor_dict`` from the previous stage over the
   PP group,
3. ``StageWorker.execute_step`` — the same per-step compute the compiled graph runs,
4. ``send_tensor_dict`` to the next stage, or (last stage) push the
   :class:`StepOutput` to the driver's result queue.

The driver sends every step to every stage at ``submit``, so up to
``max_inflight`` micro-batches are in the pipeline at once; stages process steps
in submission order. A step that fails in a stage is passed down as a failure
marker instead of tensors, so only that step fails and the pipeline stays usable.
A stage whose actor dies, or whose loop breaks (e.g. the PP group lost a peer),
makes :meth:`DirectExecutor.result` raise :class:`StageDiedError` within seconds:
the driver waits on its result queue in short slices and pings the stage actors
whenever a slice passes without a result.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
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
from raypp.executor.ray_executor import StageActors, ensure_ray
from raypp.executor.worker import StageError, StageWorker

logger = logging.getLogger(__name__)

_SLICE_S = 1.0  # longest blocking wait before a loop or the driver re-checks its peers
_PING_TIMEOUT_S = 3.0  # a live actor answers a ping well within this
_SEND_TIMEOUT_S = 5.0  # a queue with a live, connected peer takes a message at once
_READY_TIMEOUT_S = 60.0  # stage loops connecting at start-up
_STOP_WAIT_S = 2.0  # clean loop exit at shutdown before the actors are killed
_FAILED = "__raypp_step_failed__"  # key of a failure marker sent down the pipeline


class StageDiedError(RuntimeError):
    """A stage actor died or its loop broke; this executor can run no more steps."""


@dataclass(frozen=True)
class _LoopSpec:
    steps_address: str  # the stage's step queue (it connects a PULL)
    results_address: str  # the driver's result queue (it connects a PUSH)


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
    def stages(self) -> list[Any]:
        """One actor per stage (tp == 1), in PP order."""
        return [lane[0] for lane in self.workers]

    @property
    def all_workers(self) -> list[Any]:
        return self._actors.all_workers

    def _open_queues(self, transport: str) -> list[_LoopSpec]:
        here = ray.get_runtime_context().get_node_id()
        nodes = self._actors.gather([w.__ray_call__.remote(_node_id) for w in self.stages])
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
        for pp_rank, ipc in enumerate(use_ipc):
            address = self._ipc_dir.address(f"steps{pp_rank}") if ipc else mq.tcp_address(tcp_ip)
            sender = mq.Sender(self._ctx, bind=address)
            self._steps.append(sender)
            specs.append(_LoopSpec(sender.address, ipc_results if ipc else tcp_results))
        logger.info("direct control plane: step queues %s", [s.address for s in self._steps])
        return specs

    def _start_loops(self, specs: list[_LoopSpec]) -> None:
        refs = [w.__ray_call__.remote(_start_stage_loop, spec)
                for w, spec in zip(self.stages, specs, strict=True)]
        self.stage_pids = self._actors.gather(refs)
        ready: set[int] = set()
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while len(ready) < self.pp_size:
            msg = self._results.recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                raise TimeoutError(f"stage loops {sorted(set(range(self.pp_size)) - ready)} did "
                                   f"not connect within {_READY_TIMEOUT_S:g} s")
            if msg[0] == "fatal":
                raise StageDiedError(f"stage {msg[1]} loop failed to start: {msg[2]}")
            if msg[0] == "ready":
                ready.add(msg[1])

    # -- stepping -------------------------------------------------------------------
    def submit(self, step: StepInput) -> int:
        """Send the step to every stage; returns its handle (the step id)."""
        self._raise_if_broken()
        if step.step_id in self._pending:
            raise ValueError(f"step id {step.step_id} is already in flight")
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for pp_rank, queue in enumerate(self._steps):
            try:
                queue.send_bytes(data, _SEND_TIMEOUT_S)
            except TimeoutError as e:
                self._check_stages()
                raise TimeoutError(f"stage {pp_rank} took no step for {_SEND_TIMEOUT_S:g} s "
                                   "though its actor is alive") from e
        self._pending.add(step.step_id)
        return step.step_id

    def result(self, handle: int, timeout: float | None = None) -> StepOutput:
        """The step's output; ``StageError`` if it failed in a stage, ``StageDiedError``
        if a stage died, ``TimeoutError`` after ``timeout`` (default
        ``RAYPP_STEP_TIMEOUT_S``) seconds without a result."""
        if handle not in self._pending:
            raise ValueError(f"step {handle} was not submitted or its result was taken")
        timeout = envs.RAYPP_STEP_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while handle not in self._done:
            self._raise_if_broken()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"step {handle} gave no result within {timeout:g} s; the "
                                   "stages are alive (raise RAYPP_STEP_TIMEOUT_S if steps are "
                                   "this slow)")
            msg = self._results.recv(min(remaining, _SLICE_S))
            if msg is None:
                self._check_stages()
            else:
                self._on_message(msg)
        self._pending.discard(handle)
        kind, value = self._done.pop(handle)
        if kind == "err":
            raise StageError(value)
        return value

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("out", "err"):
            self._done[msg[1]] = (kind, msg[2])
        elif kind == "fatal":
            self._check_stages()  # name a dead stage first: it is usually the cause
            self._broken = f"stage {msg[1]}'s loop stopped: {msg[2]}"
            self._raise_if_broken()

    def _check_stages(self) -> None:
        """Raise ``StageDiedError`` naming every stage whose actor is dead."""
        refs = [w.ping.remote() for w in self.stages]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=_PING_TIMEOUT_S)
        dead = []
        for pp_rank, ref in enumerate(refs):
            if ref not in done:
                continue  # busy or slow, not known dead: the step timeout bounds the wait
            try:
                ray.get(ref, timeout=0)
            except RayActorError as e:
                dead.append(f"stage {pp_rank} (actor raypp_worker_{pp_rank}_0 in namespace "
                            f"{self.namespace}) died: {type(e).__name__}: {_first_line(e)}")
        if dead:
            self._broken = "; ".join(dead)
            self._raise_if_broken()

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise StageDiedError(f"direct control plane is down: {self._broken}. Restart "
                                 "the engine to continue.")

    # -- introspection ---------------------------------------------------------------------
    def comm_stats(self) -> list[dict[str, Any]]:
        return self._actors.gather([w.comm_stats.remote() for w in self.stages])

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
            alive = ray.get([w.__ray_call__.remote(_loop_alive) for w in self.stages],
                            timeout=timeout)
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False
        return all(alive)

    # -- teardown -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the loops, close the queues, kill the actors (idempotent)."""
        _LIVE.discard(self)
        if self._results is not None and self._broken is None and self.stage_pids:
            self._stop_loops()
        for queue in self._steps:
            queue.close()
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
            for queue in self._steps:
                queue.send(("stop",), timeout_s=0.5)
            deadline = time.monotonic() + _STOP_WAIT_S
            while len(stopped) < len(self._steps) and time.monotonic() < deadline:
                msg = self._results.recv(max(0.0, deadline - time.monotonic()))
                if msg is not None and msg[0] == "stopped":
                    stopped.add(msg[1])
        if len(stopped) < len(self._steps):
            logger.warning("stage loops %s did not stop within %g s; killing them",
                           sorted(set(range(len(self._steps))) - stopped), _STOP_WAIT_S)


_LIVE: weakref.WeakSet[DirectExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for executor in list(_LIVE):
        executor.shutdown()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


# -- inside the stage actors (run through ``actor.__ray_call__``) -----------------------


def _node_id(worker: StageWorker) -> str:
    return ray.get_runtime_context().get_node_id()


def _loop_alive(worker: StageWorker) -> bool:
    thread = getattr(worker, "_direct_loop", None)
    return thread is not None and thread.is_alive()


def _start_stage_loop(worker: StageWorker, spec: _LoopSpec) -> int:
    """Start this stage's loop on a thread of the actor; returns the actor's pid."""
    if _loop_alive(worker):
        raise RuntimeError(f"stage {worker.pp_rank} already runs a direct-plane loop")
    thread = threading.Thread(target=_stage_loop, args=(worker, spec),
                              name=f"raypp-direct-stage{worker.pp_rank}", daemon=True)
    worker._direct_loop = thread
    thread.start()
    return os.getpid()


def _stage_loop(worker: StageWorker, spec: _LoopSpec) -> None:
    """Run steps until told to stop; report a broken loop to the driver before exiting."""
    ctx = mq.new_context()
    steps = mq.Receiver(ctx, connect=spec.steps_address)
    results = mq.Sender(ctx, connect=spec.results_address)
    pp_rank = worker.pp_rank
    try:
        pp = parallel_state.get_pp_group()
        results.send(("ready", pp_rank, os.getpid()), _SEND_TIMEOUT_S)
        while True:
            msg = steps.recv(_SLICE_S)  # blocks in zmq_poll: an idle stage sleeps
            if msg is None:
                continue
            if isinstance(msg, tuple):  # ("stop",)
                results.send(("stopped", pp_rank), _SEND_TIMEOUT_S)
                return
            reply = _run_step(worker, pp, msg)
            if reply is not None:
                results.send(reply, _SEND_TIMEOUT_S)
    except BaseException as e:  # noqa: BLE001 - reported, then the loop ends
        logger.exception("stage %d direct-plane loop failed", pp_rank)
        with contextlib.suppress(Exception):
            results.send(("fatal", pp_rank, f"{type(e).__name__}: {e}"), 1.0)
    finally:
        steps.close()
        results.close()
        ctx.term()


def _run_step(worker: StageWorker, pp: Any, step: StepInput) -> tuple | None:
    """One step on this stage; the driver's reply on the last stage, else ``None``.

    Errors of the step's compute (``StageError``) fail only this step: the stage
    sends a failure marker down instead of tensors. Errors moving tensors propagate
    and end the loop (the PP group is unusable then).
    """
    failure = None
    inputs = None if pp.is_first_rank else pp.recv_tensor_dict(pp.prev_rank)
    if inputs is not None and _FAILED in inputs:
        failure = inputs[_FAILED]
    else:
        try:
            out = worker.execute_step(step if inputs is None else (step, inputs))
        except StageError as e:
            failure = str(e)
    if pp.is_last_rank:
        return ("err", step.step_id, failure) if failure else ("out", step.step_id, out)
    pp.send_tensor_dict({_FAILED: failure} if failure else out[1], pp.next_rank)
    return None
