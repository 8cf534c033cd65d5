"""What the engine needs from an executor, what every control plane shares, and the
one registry of control planes.

An executor = one :class:`~raypp.executor.stage_pool.StagePool` (placement, actors,
KV sizing, liveness, names, teardown) + a thin control plane that moves steps to the
stages and results back:

- ``cgraph`` (:class:`~raypp.executor.cgraph.CompiledGraphExecutor`, the default): a
  Ray compiled graph; PP tensors ride ``RayPPCommunicator`` over the PP group.
- ``direct`` (:class:`~raypp.executor.direct.DirectExecutor`): a loop in each stage
  takes step descriptors from a ZeroMQ queue and moves PP tensors with the PP
  group's ``send_tensor_dict`` / ``recv_tensor_dict``; Ray only places and
  supervises the actors.

A plane implements :meth:`Executor.submit`, :meth:`Executor.result`,
:meth:`Executor._start_plane`, :meth:`Executor._stop_plane` and
:meth:`Executor._release_plane`; everything else (health, stats, failure
classification, exit hooks) is here.
"""

from __future__ import annotations

import abc
import atexit
import importlib
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

import ray

from raypp.config import EngineConfig
from raypp.errors import StageDiedError, StepTimeoutError
from raypp.executor.liveness import ProgressWatch
from raypp.executor.stage_pool import StagePool
from raypp.step import StepInput, StepOutput

if TYPE_CHECKING:
    from raypp.worker.occupancy import OccupancyTotals

logger = logging.getLogger(__name__)

# control plane → "module:class"; a new plane is one module and one line here
CONTROL_PLANES: dict[str, str] = {
    "cgraph": "raypp.executor.cgraph:CompiledGraphExecutor",
    "direct": "raypp.executor.direct:DirectExecutor",
}


class Executor(abc.ABC):
    """Runs micro-batches through the stages of one engine.

    ``submit`` returns at once with a handle; up to ``config.executor_depth`` steps
    may be in flight, and their results are read in submission order.
    ``result(handle, timeout)`` returns that step's :class:`StepOutput`, raises
    :class:`~raypp.errors.StageError` (naming the stage) if the step failed there,
    :class:`~raypp.errors.StageDiedError` promptly when a stage died, or
    :class:`~raypp.errors.StepTimeoutError` once no stage has made progress for
    ``timeout`` (default ``config.runtime.step_timeout_s``) seconds
    (:mod:`raypp.executor.liveness`: a step that takes long but advances is waited
    for). After either of the last two the executor is *broken*: it runs no more steps
    and the engine replaces it.
    """

    control_plane: ClassVar[str]

    def __init__(self, config: EngineConfig):
        self.config = config
        self.pp_size = config.parallel.pipeline_parallel_size
        self.tp_size = config.parallel.tensor_parallel_size
        self.pool = StagePool(config)
        self._broken: str | None = None  # why no more steps can run
        self._lock = threading.RLock()  # the plane's driver-side state
        _LIVE.add(self)
        try:
            self.pool.start()
            self._start_plane()
        except BaseException:
            self.shutdown()
            raise

    # -- what a plane implements ---------------------------------------------------------
    @abc.abstractmethod
    def submit(self, step: StepInput) -> Any:
        """Start ``step``; returns a handle for :meth:`result`."""

    @abc.abstractmethod
    def result(self, handle: Any, timeout: float | None = None) -> StepOutput:
        """The step's output (see the class docstring for failures)."""

    @abc.abstractmethod
    def _start_plane(self) -> None:
        """Connect the plane to the started workers (called once, after the pool started)."""

    @abc.abstractmethod
    def _stop_plane(self) -> None:
        """Stop the plane while every worker lives (skipped once a stage died or hung)."""

    @abc.abstractmethod
    def _release_plane(self) -> None:
        """Free what is left of the plane after the workers were killed (idempotent)."""

    def _plane_alive(self, timeout: float) -> bool:
        """True while the plane's own machinery in the stages runs (default: nothing to ask)."""
        return True

    # -- shared by every plane -------------------------------------------------------------
    @property
    def workers(self) -> list[list[Any]]:
        """The stage actors, ``[pp_rank][tp_rank]`` (empty once shut down)."""
        return self.pool.workers

    @property
    def all_workers(self) -> list[Any]:
        return self.pool.all_workers

    @property
    def namespace(self) -> str:
        return self.pool.namespace

    @property
    def num_kv_blocks(self) -> int:
        return self.pool.num_kv_blocks

    @property
    def load_info(self) -> list[dict[str, Any]]:
        return self.pool.load_info

    @property
    def step_timeout_s(self) -> float:
        return self.config.runtime.step_timeout_s

    def check_health(self, timeout: float = 5.0) -> bool:
        """True while no step found a stage dead or stuck, every stage answers within
        ``timeout`` seconds, and the plane runs."""
        if self._broken is not None or not self.workers:
            return False
        try:
            if self.pool.dead_stages(timeout):
                return False
            return self._plane_alive(timeout)
        except Exception:  # noqa: BLE001 - any failure to answer means unhealthy
            return False

    def comm_stats(self) -> list[dict[str, Any]]:
        """PP traffic counters of every worker, in rank order (pp-major)."""
        return self.pool.call_all("comm_stats", 60)

    def occupancy(self, timeout: float = 5.0) -> list[OccupancyTotals]:
        """Every stage's busy/wait counters now (its first TP rank's), in stage order;
        raises like :meth:`traced_intervals` when a stage does not answer."""
        return ray.get([lane[0].occupancy_totals.remote() for lane in self.workers],
                       timeout=timeout)

    def traced_intervals(self, timeout: float = 60.0) -> list[tuple[int, float, float]]:
        """``(pp_rank, start, end)`` of every step each worker traced since the last call
        (``StepInput.trace``), in worker rank order; raises (``GetTimeoutError`` after
        ``timeout`` seconds, or a dead stage's error) when a worker does not answer."""
        return [i for intervals in self.pool.call_all("traced_intervals", timeout)
                for i in intervals]

    def shutdown(self) -> None:
        """Stop the plane and kill the workers (idempotent). A broken executor's workers
        are killed first: a stuck stage would hold up a graceful stop."""
        _LIVE.discard(self)
        with self._lock:
            if self._broken is None and self.workers:
                try:
                    self._stop_plane()
                except Exception as e:  # noqa: BLE001 - shutdown must finish
                    logger.warning("stopping the %s plane: %s", self.control_plane, e)
            self.pool.kill()
            self._release_plane()

    # -- failure classification -------------------------------------------------------------
    def _broken_by(self, error: StageDiedError | StepTimeoutError
                   ) -> StageDiedError | StepTimeoutError:
        self._broken = self._broken or str(error)
        return error

    def _died(self, cause: str) -> StageDiedError:
        """A :class:`StageDiedError` naming the dead stages (else ``cause``)."""
        dead = self.pool.dead_stages()
        return self._broken_by(StageDiedError(
            f"{'; '.join(dead) or cause} ({self.control_plane} control plane, namespace "
            f"{self.namespace})"))

    def _no_result(self, watch: ProgressWatch) -> StageDiedError | StepTimeoutError:
        """No progress for the watch's timeout: a dead stage if Ray confirms one, else a
        stuck one (whose thread stacks are written to a file the error names)."""
        dead = self.pool.dead_stages()
        if dead:
            return self._died("; ".join(dead))
        try:
            stacks = f"; every stage's stacks: {self.pool.write_stacks()}"
        except OSError as e:
            stacks = f"; stacks not written: {e}"
        return self._broken_by(StepTimeoutError(
            f"a stage is stuck: {watch.describe()} (limit: step_timeout_s / "
            f"RAYPP_STEP_TIMEOUT_S = {watch.timeout_s:g} s; {self.control_plane} control "
            f"plane, namespace {self.namespace}){stacks}"))

    def _check_not_broken(self) -> None:
        if self._broken is not None:
            raise StageDiedError(f"executor is unusable: {self._broken}")
        if not self.workers:
            raise StageDiedError(f"executor is shut down (namespace {self.namespace})")


def make_executor(config: EngineConfig) -> Executor:
    """Start the executor of ``config.parallel.control_plane``."""
    plane = config.parallel.control_plane
    if plane not in CONTROL_PLANES:
        raise ValueError(f"control plane must be one of {', '.join(CONTROL_PLANES)}, "
                         f"got {plane!r}")
    module, name = CONTROL_PLANES[plane].split(":")
    return getattr(importlib.import_module(module), name)(config)


_LIVE: weakref.WeakSet[Executor] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for executor in list(_LIVE):
        executor.shutdown()
