"""The compiled-graph control plane: a Ray compiled graph drives the stage actors.

The graph has one lane per TP index: TP worker *t* of stage *s* feeds TP worker *t*
of stage *s+1*, and each lane's PP edges carry their tensors through
:class:`~raypp.distributed.ray_communicator.RayPPCommunicator` over that lane's PP
group (or Ray's own transport with ``use_ray_wrapped_pp_comm=False``). The driver
submits a :class:`~raypp.step.StepInput`; each stage returns a
:class:`~raypp.step.StageHandoff` to the next, the last a
:class:`~raypp.step.StepOutput`.

An idle compiled graph's stage loops poll their channels and burn CPU, so a
watchdog tears the graph down after ``idle_suspend_s`` without steps; the next
``submit`` recompiles it on the same actors, groups, weights and KV caches (~0.3 s).
Ray's log lines about it are DEBUG (:mod:`raypp.executor.ray_logs`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayChannelTimeoutError

from raypp.config import EngineConfig
from raypp.distributed.ray_communicator import RayPPCommunicator
from raypp.errors import StageDiedError, StageError, StepTimeoutError, first_line
from raypp.executor.base import Executor
from raypp.executor.liveness import ProgressWatch
from raypp.executor.ray_logs import quiet_ray_logs
from raypp.step import StepInput, StepOutput

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 2.0  # liveness ping period: a ping costs an idle stage ~1-2 % CPU
_TEARDOWN_TIMEOUT_S = 10  # Ray's default (30 s) would hold up replacing dead stages
_SPIN_SLICE_S = 0.1  # driver_wait="spin": how long one slice of a result wait spins


class CompiledGraphExecutor(Executor):
    """Drives the stage pool through a Ray compiled graph."""

    control_plane = "cgraph"

    def __init__(self, config: EngineConfig):
        self.dag: Any = None
        self._compiled_once = False
        self._inflight = 0  # steps submitted whose result was not read yet
        self._last_active = time.monotonic()
        self._stop = threading.Event()
        # the graph has one output channel, and a zero-timeout read of one shared-memory
        # channel takes the whole value or nothing
        self._poll_results = config.runtime.driver_wait == "poll"
        quiet_ray_logs()  # the idle teardowns' INFO lines, errors about workers raypp killed
        super().__init__(config)

    def _start_plane(self) -> None:
        self._compile()
        self._watchdog = threading.Thread(target=self._watch, name="raypp-executor-watchdog",
                                          daemon=True)
        self._watchdog.start()

    # -- the graph ---------------------------------------------------------------------
    def _compile(self) -> None:
        from ray.dag import DAGContext, InputNode

        ctx = DAGContext.get_current()  # driver-side waits: results, teardown
        ctx.get_timeout = max(1, round(self.step_timeout_s))
        ctx.teardown_timeout = _TEARDOWN_TIMEOUT_S
        transports = [self._pp_transport(t) for t in range(self.tp_size)]
        with InputNode() as step:
            nodes = [step] * self.tp_size
            for pp_rank, stage in enumerate(self.workers):
                nodes = [worker.execute_step.bind(node) for worker, node in zip(stage, nodes)]
                if pp_rank < self.pp_size - 1 and transports[0] is not None:
                    nodes = [node.with_tensor_transport(transport=transports[t])
                             for t, node in enumerate(nodes)]
            # every TP rank of the last stage samples identically; rank 0 returns its
            # output once all have theirs, so the graph has one output channel (a wait in
            # slices reads it whole or not at all: :meth:`_wait`)
            out = nodes[0] if self.tp_size == 1 else self.workers[-1][0].first_output.bind(*nodes)
        self._compiled_once = True
        self.dag = out.experimental_compile(
            _max_inflight_executions=self.config.executor_depth,
            _buffer_size_bytes=self._channel_buffer_bytes(),
            _submit_timeout=self.step_timeout_s,
        )

    def _pp_transport(self, tp_rank: int) -> Any:
        if self.pp_size == 1:
            return None
        # said once at INFO; each recompile after an idle teardown says it at DEBUG
        level = logging.INFO if self.dag is None and not self._compiled_once else logging.DEBUG
        if self.config.parallel.use_ray_wrapped_pp_comm:
            if tp_rank == 0:
                logger.log(level, "PP edges: RayPPCommunicator over the engine's PP group (%s)",
                           "NCCL" if self.config.device == "cuda" else "gloo")
            return RayPPCommunicator(self.pool.lane(tp_rank))
        native = "accelerator" if self.config.device == "cuda" else "shm"
        if tp_rank == 0:
            logger.log(level, "PP edges: Ray's own transport (%s); use_ray_wrapped_pp_comm=False",
                       native)
        return native

    def _channel_buffer_bytes(self) -> int:
        """Above the largest message: a descriptor, or both PP tensors on Ray's shm path."""
        mc, sc = self.config.model, self.config.scheduler
        tokens = sc.max_num_batched_tokens
        tensors = 2 * tokens * mc.hidden_size * mc.torch_dtype.itemsize
        blocks = -(-mc.max_model_len // self.config.cache.block_size)
        # + each sampled row's grammar bitmask (one bit per vocabulary entry)
        descriptor = 64 * tokens + 8 * sc.max_num_seqs * (blocks + 64 + mc.vocab_size // 64)
        return int(max(self.config.runtime.cgraph_buffer_bytes, tensors + descriptor + 2**20))

    def graph_communicators(self) -> dict[str, Any]:
        """Which communicators the compiled graph uses: ours, and any Ray created."""
        if self.dag is None:
            return {"custom": [], "ray_created": []}
        return {
            "custom": [type(c).__name__ for c in self.dag._communicator_to_type_hints],
            "ray_created": list(self.dag._actors_to_created_communicator_id.values()),
        }

    # -- stepping -------------------------------------------------------------------
    def submit(self, step: StepInput) -> Any:
        """Start a step; returns a handle for :meth:`result`.

        A graph suspended while idle is recompiled first (same actors, groups,
        weights and KV cache).
        """
        with self._lock:
            self._check_not_broken()
            self._inflight += 1
            self._last_active = time.monotonic()
            try:
                if self.dag is None:
                    self._compile()  # fails if a stage died while the graph was suspended
                return self.dag.execute(step)
            except Exception as e:
                self._inflight -= 1
                raise self._classify(e, self.pool.watch(self.step_timeout_s)) from e

    def result(self, handle: Any, timeout: float | None = None) -> StepOutput:
        watch = self.pool.watch(self.step_timeout_s if timeout is None else timeout)
        try:
            self._wait(handle, watch)
            return ray.get(handle, timeout=watch.timeout_s)  # in the driver's buffer by now
        except Exception as e:
            raise self._classify(e, watch) from e
        finally:
            with self._lock:
                self._inflight -= 1
                self._last_active = time.monotonic()

    def _wait(self, ref: Any, watch: ProgressWatch) -> None:
        """Return once ``ref``'s result is in the driver's buffer; raise
        ``RayChannelTimeoutError`` once ``watch`` finds the stages stalled.

        The wait runs in slices; between them the watch may read the stages' progress
        (:mod:`raypp.executor.liveness`), so a long step that advances is waited for.
        With ``driver_wait="poll"`` a slice is a zero-timeout read followed by a sleep of
        50 µs to 1 ms: ``ray.get`` on a compiled-graph result spins on its channel, and on a
        2-core CPU box the driver then takes most of a core from the stages computing the
        very result it waits for (measured: 0.8–1.0 cores); the sleeps cost at most that
        much latency. Otherwise a slice spins for up to ``_SPIN_SLICE_S``.
        """
        pause = 5e-5
        while True:
            try:
                self.dag._execute_until(ref._execution_index, ref._channel_index,
                                        0 if self._poll_results else _SPIN_SLICE_S)
                return
            except RayChannelTimeoutError:
                if watch.stalled():
                    raise
                if self._poll_results:
                    time.sleep(pause)
                    pause = min(2 * pause, 1e-3)

    def _classify(self, e: Exception, watch: ProgressWatch) -> Exception:
        if isinstance(e, StageError):  # RayTaskError re-raised as the stage's own error
            cause = getattr(e, "cause", None)
            return StageError(str(cause) if cause is not None else first_line(e))
        if isinstance(e, (StageDiedError, StepTimeoutError)):
            return e
        if isinstance(e, (RayChannelTimeoutError, GetTimeoutError, TimeoutError)):
            return self._no_result(watch)
        return self._died(f"the compiled graph broke: {type(e).__name__}: {first_line(e)}")

    # -- idle suspend and liveness ---------------------------------------------------------
    def _watch(self) -> None:
        """Every 2 s: mark the executor broken once a worker is dead; suspend the graph
        after ``idle_suspend_s`` without steps (its stage loops poll and burn CPU)."""
        idle_after = self.config.runtime.idle_suspend_s
        while not self._stop.wait(_WATCH_INTERVAL_S):
            if not ray.is_initialized():  # the cluster went away (interpreter exit)
                return
            try:
                dead = self.pool.dead_stages()
            except Exception:  # noqa: BLE001 - cluster going away at shutdown
                dead = []
            if dead:
                self._broken_by(StageDiedError("; ".join(dead)))
            if idle_after > 0:
                self._suspend_if_idle(idle_after)

    def _suspend_if_idle(self, idle_after: float) -> None:
        with self._lock:
            idle = time.monotonic() - self._last_active
            if self.dag is None or self._inflight or idle < idle_after or self._broken:
                return
            self._teardown_graph()
            logger.debug("compiled graph suspended after %.1f s idle", idle)

    @property
    def suspended(self) -> bool:
        return self.dag is None and bool(self.workers)

    def _teardown_graph(self) -> None:
        if self.dag is None:
            return
        try:
            self.dag.teardown()
        except Exception as e:  # noqa: BLE001 - teardown must finish
            logger.warning("compiled graph teardown: %s", e)
        self.dag = None

    # -- teardown -------------------------------------------------------------------------
    def _stop_plane(self) -> None:
        self._teardown_graph()

    def _release_plane(self) -> None:
        self._stop.set()
        self._teardown_graph()  # no-op if stopped; else its stages are dead: returns at once
