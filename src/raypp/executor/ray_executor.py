"""Places stage workers with Ray and drives them through a compiled graph.

Start-up: join or start Ray → one placement-group bundle per worker → actors
named ``raypp_worker_<pp_rank>_<tp_rank>`` (in a namespace of their own, see
``namespace``) → ``torch.distributed`` rendezvous at an address rank 0 picks →
model shards → KV cache sized to the smallest stage budget → compiled DAG whose
PP edges carry tensors through :class:`RayPPCommunicator` (or Ray's own
transport when ``RAYPP_USE_RAY_WRAPPED_PP_COMM=0``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import uuid
import weakref
from typing import Any

from raypp import envs
from raypp.config import EngineConfig
from raypp.engine.step import StepInput, StepOutput

envs.apply_ray_cgraph_env()  # before ray.dag is imported anywhere in this process

import ray  # noqa: E402
from ray.exceptions import (  # noqa: E402
    GetTimeoutError,
    RayActorError,
    RayChannelTimeoutError,
    TaskPlacementGroupRemoved,
)
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from raypp.distributed.ray_communicator import RayPPCommunicator  # noqa: E402
from raypp.executor.errors import StageDiedError, StageError, StepTimeoutError, first_line  # noqa: E402
from raypp.executor.worker import StageWorker  # noqa: E402

logger = logging.getLogger(__name__)

_WORKER_CPUS = 0.01  # stage actors must not need a whole CPU each on a 2-core box
_STARTUP_TIMEOUT_S = 300
_WATCH_INTERVAL_S = 2.0  # liveness ping period: a ping costs an idle stage ~1-2 % CPU


def ensure_ray(address: str | None) -> None:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start a local one."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        ray.init(
            address="local",  # a new local cluster, never one that happens to run here
            num_cpus=max(2, os.cpu_count() or 2),
            object_store_memory=256 * 2**20,
            include_dashboard=False,
            log_to_driver=True,
        )


class StageActors:
    """The stage actors of one engine, ready to run steps; shared by both control planes.

    :meth:`start`: placement group (one bundle per worker) → actors named
    ``raypp_worker_<pp_rank>_<tp_rank>`` in ``namespace`` → ``torch.distributed``
    groups → model shards → KV cache sized to the smallest stage budget. It knows
    nothing about how steps reach the stages. :meth:`kill` is idempotent and
    undoes whatever part of :meth:`start` ran.
    """

    def __init__(self, config: EngineConfig, namespace: str):
        self.config = config
        self.namespace = namespace
        self.pp_size = config.parallel.pipeline_parallel_size
        self.tp_size = config.parallel.tensor_parallel_size
        self.workers: list[list[Any]] = []  # [pp_rank][tp_rank]
        self.load_info: list[dict[str, Any]] = []
        self.num_kv_blocks = 0
        self._pg: Any = None

    @property
    def all_workers(self) -> list[Any]:
        return [w for lane in self.workers for w in lane]

    def start(self) -> int:
        """Create, connect and load every worker; returns the KV blocks per stage."""
        self._create_actors()
        self.num_kv_blocks = self._init_workers()
        return self.num_kv_blocks

    def _create_actors(self) -> None:
        on_gpu = self.config.device == "cuda"
        bundle = {"GPU": 1, "CPU": _WORKER_CPUS} if on_gpu else {"CPU": _WORKER_CPUS}
        world = self.pp_size * self.tp_size
        if on_gpu:
            gpus = int(ray.cluster_resources().get("GPU", 0))
            if gpus < world:
                raise ValueError(
                    f"tensor_parallel_size × pipeline_parallel_size = {world} workers need "
                    f"{world} GPUs, but the Ray cluster has {gpus}"
                )
        self._reserve_bundles([dict(bundle) for _ in range(world)])
        env = {k: v for k, v in os.environ.items() if k.startswith(("RAYPP_", "RAY_CGRAPH_"))}
        actor_cls = ray.remote(StageWorker)
        for pp_rank in range(self.pp_size):
            lane: list[Any] = []
            self.workers.append(lane)  # in place, so kill() sees partial start-ups
            for tp_rank in range(self.tp_size):
                rank = pp_rank * self.tp_size + tp_rank
                lane.append(
                    actor_cls.options(
                        name=f"raypp_worker_{pp_rank}_{tp_rank}",
                        namespace=self.namespace,
                        num_cpus=_WORKER_CPUS,
                        num_gpus=1 if on_gpu else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            self._pg, placement_group_bundle_index=rank
                        ),
                        runtime_env={"env_vars": env},
                    ).remote(self.config, pp_rank, tp_rank)
                )

    def _reserve_bundles(self, bundles: list[dict[str, float]]) -> None:
        """Hold one placement-group bundle per worker, waiting up to the start-up timeout.

        A node that dies while its bundles are reserved (a replaced stage's raylet
        can crash in Ray: ray-project/ray#63229) removes the group: a new one
        is asked for until the cluster can hold it again.
        """
        strategy = envs.RAYPP_PLACEMENT_STRATEGY
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while True:
            self._pg = placement_group(bundles, strategy=strategy)
            try:
                ray.get(self._pg.ready(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except TaskPlacementGroupRemoved:
                self._remove_placement_group()
                if time.monotonic() > deadline:
                    raise
                logger.warning("a node holding the stage bundles died; reserving again")
                time.sleep(1.0)
            except GetTimeoutError:
                self._remove_placement_group()
                alive = [n for n in ray.nodes() if n.get("Alive")]
                raise RuntimeError(
                    f"the Ray cluster could not hold {len(bundles)} stage workers "
                    f"({bundles[0]} each, placement {strategy}) within {_STARTUP_TIMEOUT_S} s; "
                    f"{len(alive)} node(s) alive with {ray.available_resources()} free"
                ) from None

    def _remove_placement_group(self) -> None:
        if self._pg is not None:
            with contextlib.suppress(Exception):  # the cluster may be gone at exit
                remove_placement_group(self._pg)
            self._pg = None

    def _init_workers(self) -> int:
        init_method = ray.get(self.workers[0][0].rendezvous_address.remote(),
                              timeout=_STARTUP_TIMEOUT_S)
        self.gather([w.init_distributed.remote(init_method) for w in self.all_workers])
        self.load_info = self.gather([w.load_model.remote() for w in self.all_workers])
        num_blocks = min(self.gather([w.available_kv_blocks.remote() for w in self.all_workers]))
        need = -(-self.config.model.max_model_len // self.config.cache.block_size)
        if num_blocks < need:
            raise ValueError(
                f"KV cache budget holds {num_blocks} blocks but one max_model_len "
                f"({self.config.model.max_model_len}) sequence needs {need}: raise the KV "
                "memory budget or lower max_model_len"
            )
        self.gather([w.init_kv_cache.remote(num_blocks) for w in self.all_workers])
        return num_blocks

    def log_stacks(self) -> None:
        """Log every worker's thread stacks: where a stuck step waits."""
        refs = [w.stacks.remote() for w in self.all_workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)  # 5 s for all of them
        for worker_index, ref in enumerate(refs):
            pp_rank, tp_rank = divmod(worker_index, self.tp_size)
            try:
                stacks = ray.get(ref, timeout=0) if ref in ready else "(no answer within 5 s)"
            except Exception as e:  # noqa: BLE001 - a report, not a requirement
                stacks = f"(unavailable: {first_line(e)})"
            logger.error("stuck step: stacks of stage %d (tp rank %d):\n%s", pp_rank, tp_rank,
                         stacks)

    @staticmethod
    def gather(refs: list[Any]) -> list[Any]:
        return ray.get(refs, timeout=_STARTUP_TIMEOUT_S)

    def kill(self) -> None:
        """Kill the workers and free the placement group (idempotent)."""
        for worker in self.all_workers:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(worker, no_restart=True)
        self.workers.clear()
        self._remove_placement_group()


class RayExecutor:
    """Owns the stage actors and the compiled graph of one engine."""

    control_plane = "cgraph"

    def __init__(self, config: EngineConfig):
        self.config = config
        pc = config.parallel
        self.pp_size, self.tp_size = pc.pipeline_parallel_size, pc.tensor_parallel_size
        self.use_wrapped_comm = envs.RAYPP_USE_RAY_WRAPPED_PP_COMM
        self.namespace = f"raypp-{uuid.uuid4().hex[:8]}"
        self.dag: Any = None
        self._actors = StageActors(config, self.namespace)
        self.workers = self._actors.workers  # [pp_rank][tp_rank]
        self._lock = threading.RLock()  # guards dag against the idle-suspend watchdog
        self._inflight = 0
        self._last_active = time.monotonic()
        self._stop = threading.Event()
        self._healthy = True
        self._broken = False  # a stage died or hung: no graceful teardown
        wait = envs.RAYPP_DRIVER_WAIT
        if wait == "auto":
            wait = "spin" if config.device == "cuda" else "poll"
        self._poll_results = wait == "poll" and self.tp_size == 1
        ensure_ray(pc.ray_address)
        try:
            self.num_kv_blocks = self._actors.start()
            self.load_info = self._actors.load_info
            self._compile()
        except BaseException:
            self.shutdown()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="raypp-executor-watchdog",
                                          daemon=True)
        self._watchdog.start()
        _LIVE.add(self)

    # -- start-up ----------------------------------------------------------------------
    @property
    def all_workers(self) -> list[Any]:
        return self._actors.all_workers

    def _gather(self, refs: list[Any]) -> list[Any]:
        return self._actors.gather(refs)

    def _compile(self) -> None:
        """One lane per TP index: TP worker t of stage s feeds TP worker t of stage s+1,
        and each lane's PP edges ride that lane's PP group."""
        from ray.dag import InputNode, MultiOutputNode

        transports = [self._pp_transport(t) for t in range(self.tp_size)]
        with InputNode() as step:
            nodes = [step] * self.tp_size
            for pp_rank, stage in enumerate(self.workers):
                nodes = [worker.execute_step.bind(node) for worker, node in zip(stage, nodes)]
                if pp_rank < self.pp_size - 1 and transports[0] is not None:
                    nodes = [node.with_tensor_transport(transport=transports[t])
                             for t, node in enumerate(nodes)]
            # every TP rank of the last stage samples identically; the graph returns all
            out = nodes[0] if self.tp_size == 1 else MultiOutputNode(nodes)
        self.dag = out.experimental_compile(
            _max_inflight_executions=self.config.executor_depth,
            _buffer_size_bytes=self._channel_buffer_bytes(),
            _submit_timeout=envs.RAYPP_STEP_TIMEOUT_S,
        )

    def lane(self, tp_rank: int) -> list[Any]:
        """The stage actors of one TP index, in PP-rank order."""
        return [stage[tp_rank] for stage in self.workers]

    def _pp_transport(self, tp_rank: int) -> Any:
        if self.pp_size == 1:
            return None
        if self.use_wrapped_comm:
            if tp_rank == 0:
                logger.info("PP edges: RayPPCommunicator over the engine's PP group (%s)",
                            "NCCL" if self.config.device == "cuda" else "gloo")
            return RayPPCommunicator(self.lane(tp_rank))
        native = "accelerator" if self.config.device == "cuda" else "shm"
        if tp_rank == 0:
            logger.info("PP edges: Ray's own transport (%s); RAYPP_USE_RAY_WRAPPED_PP_COMM=0",
                        native)
        return native

    def _channel_buffer_bytes(self) -> int:
        """Above the largest message: a descriptor, or both PP tensors on Ray's shm path."""
        mc, sc = self.config.model, self.config.scheduler
        tokens = sc.max_num_batched_tokens
        tensors = 2 * tokens * mc.hidden_size * mc.torch_dtype.itemsize
        blocks = -(-mc.max_model_len // self.config.cache.block_size)
        descriptor = 64 * tokens + 8 * sc.max_num_seqs * (blocks + 64)
        return int(max(envs.RAYPP_CGRAPH_BUFFER_BYTES, tensors + descriptor + 2**20))

    # -- stepping -------------------------------------------------------------------
    def submit(self, step: StepInput) -> Any:
        """Start a step; returns a handle for :meth:`result`.

        A graph suspended while idle is recompiled first (same actors, groups,
        weights and KV cache).
        """
        with self._lock:
            if self.dag is None and not self.workers:
                raise StageDiedError("executor is shut down")
            self._inflight += 1
            self._last_active = time.monotonic()
            try:
                if self.dag is None:
                    self._compile()  # fails if a stage died while the graph was suspended
                return self.dag.execute(step)
            except Exception as e:
                self._inflight -= 1
                raise self._classify(e) from e

    def result(self, handle: Any, timeout: float | None = None) -> StepOutput:
        """The step's output, or :class:`StageError` / :class:`StageDiedError` /
        :class:`StepTimeoutError` (after ``timeout``, default ``RAYPP_STEP_TIMEOUT_S``)."""
        timeout = envs.RAYPP_STEP_TIMEOUT_S if timeout is None else timeout
        try:
            if self._poll_results:
                self._wait_without_spinning(handle, timeout)
            out = ray.get(handle, timeout=timeout)
            return out[0] if isinstance(out, list) else out  # TP ranks agree; take rank 0
        except Exception as e:
            raise self._classify(e) from e
        finally:
            with self._lock:
                self._inflight -= 1
                self._last_active = time.monotonic()

    def _wait_without_spinning(self, handle: Any, timeout: float) -> None:
        """Sleep-poll until the step's result is in the driver's buffer, or raise
        ``RayChannelTimeoutError`` after ``timeout`` seconds.

        ``ray.get`` on a compiled-graph result spins on its channel: on a 2-core
        CPU box the driver then takes most of a core from the stages computing
        the very result it waits for (measured: 0.8–1.0 cores). Polling with
        ``timeout=0`` and sleeps of 50 µs to 1 ms costs at most that much latency.
        Only for single-output graphs (tp == 1): a zero-timeout read of one
        shared-memory channel either takes the whole value or nothing.
        """
        deadline = time.monotonic() + timeout
        pause = 5e-5
        while True:
            try:
                self.dag._execute_until(handle._execution_index, handle._channel_index, 0)
                return
            except RayChannelTimeoutError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)

    def _classify(self, e: Exception) -> Exception:
        err = self._classify_inner(e)
        if not isinstance(err, StageError):
            self._broken = True
        return err

    def _classify_inner(self, e: Exception) -> Exception:
        if isinstance(e, StageError):  # RayTaskError re-raised as the stage's own error
            cause = getattr(e, "cause", None)
            return StageError(str(cause) if cause is not None else first_line(e))
        if isinstance(e, (RayChannelTimeoutError, GetTimeoutError, TimeoutError)):
            dead = self._dead_stages()
            if dead:
                return StageDiedError(f"{dead}: {e}")
            self._actors.log_stacks()
            return StepTimeoutError(
                f"no step result within {envs.RAYPP_STEP_TIMEOUT_S:g} s although every stage "
                "answers (RAYPP_STEP_TIMEOUT_S): a stage is stuck"
            )
        dead = self._dead_stages()
        return StageDiedError(f"{dead or 'the compiled graph broke'}: {type(e).__name__}: "
                              f"{first_line(e)}")

    def _dead_stages(self) -> str:
        """``"stage k (raypp_worker_k_0) died"`` for each dead stage, or ``""``."""
        refs = [w.ping.remote() for w in self.all_workers]
        dead = []
        for worker_index, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=2.0)
            except RayActorError:
                pp_rank, tp_rank = divmod(worker_index, self.tp_size)
                dead.append(f"stage {pp_rank} (actor raypp_worker_{pp_rank}_{tp_rank}) died")
            except Exception:  # noqa: BLE001 - slow is not dead
                continue
        if dead:
            self._healthy = False
        return "; ".join(dead)

    # -- idle suspend and liveness ---------------------------------------------------------
    def _watch(self) -> None:
        """Every 2 s: mark dead workers unhealthy; tear the graph down when idle.

        An idle compiled graph's stage loops poll their channels and burn most of
        a core each (probe addendum); suspending after ``RAYPP_IDLE_SUSPEND_S``
        brings an idle engine to ~0 % CPU at the price of one recompile (~0.3 s)
        on the next request.
        """
        idle_after = envs.RAYPP_IDLE_SUSPEND_S
        while not self._stop.wait(_WATCH_INTERVAL_S):
            if not ray.is_initialized():  # the cluster went away (interpreter exit)
                return
            try:
                alive = ray.wait([w.ping.remote() for w in self.all_workers],
                                 num_returns=len(self.all_workers), timeout=5.0)[0]
                for ref in alive:
                    ray.get(ref)
            except RayActorError:
                self._healthy = False
            except Exception:  # noqa: BLE001 - cluster going away at shutdown
                pass
            if idle_after > 0:
                self._suspend_if_idle(idle_after)

    def _suspend_if_idle(self, idle_after: float) -> None:
        with self._lock:
            idle = time.monotonic() - self._last_active
            if self.dag is None or self._inflight or idle < idle_after:
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

    # -- introspection ---------------------------------------------------------------------
    def comm_stats(self) -> list[dict[str, Any]]:
        """PP traffic counters of every worker, in rank order (pp-major)."""
        return self._gather([w.comm_stats.remote() for w in self.all_workers])

    def graph_communicators(self) -> dict[str, Any]:
        """Which communicators the compiled graph uses: ours, and any Ray created."""
        if self.dag is None:
            return {"custom": [], "ray_created": []}
        return {
            "custom": [type(c).__name__ for c in self.dag._communicator_to_type_hints],
            "ray_created": list(self.dag._actors_to_created_communicator_id.values()),
        }

    def traced_intervals(self) -> list[tuple[int, float, float]]:
        out = []
        for intervals in self._gather([w.traced_intervals.remote() for w in self.all_workers]):
            out.extend(intervals)
        return out

    def check_health(self, timeout: float = 5.0) -> bool:
        """False once any worker is known dead (checked every second by the watchdog)."""
        return self._healthy and bool(self.workers)

    # -- teardown -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tear down the graph, kill the workers, free the placement group (idempotent).

        After a failure the workers are killed first: a graph whose stages are
        dead tears down at once, while a stuck stage would hold teardown until its
        timeout.
        """
        _LIVE.discard(self)
        self._stop.set()
        broken = self._broken or not self._healthy
        self._healthy = False
        with self._lock:
            if not broken:
                self._teardown_graph()
            self._actors.kill()
            self._teardown_graph()
            self.workers = []


_LIVE: weakref.WeakSet[RayExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for executor in list(_LIVE):
        executor.shutdown()
