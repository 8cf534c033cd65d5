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
import uuid
import weakref
from typing import Any

from raypp import envs
from raypp.config import EngineConfig
from raypp.engine.step import StepInput, StepOutput

envs.apply_ray_cgraph_env()  # before ray.dag is imported anywhere in this process

import ray  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from raypp.distributed.ray_communicator import RayPPCommunicator  # noqa: E402
from raypp.executor.worker import StageWorker  # noqa: E402

logger = logging.getLogger(__name__)

_WORKER_CPUS = 0.01  # stage actors must not need a whole CPU each on a 2-core box
_STARTUP_TIMEOUT_S = 300


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
        self._pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        ray.get(self._pg.ready(), timeout=_STARTUP_TIMEOUT_S)
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

    @staticmethod
    def gather(refs: list[Any]) -> list[Any]:
        return ray.get(refs, timeout=_STARTUP_TIMEOUT_S)

    def kill(self) -> None:
        """Kill the workers and free the placement group (idempotent)."""
        for worker in self.all_workers:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(worker, no_restart=True)
        self.workers.clear()
        if self._pg is not None:
            with contextlib.suppress(Exception):  # the cluster may be gone at exit
                remove_placement_group(self._pg)
            self._pg = None


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
        ensure_ray(pc.ray_address)
        try:
            self.num_kv_blocks = self._actors.start()
            self.load_info = self._actors.load_info
            self._compile()
        except BaseException:
            self.shutdown()
            raise
        _LIVE.add(self)

    # -- start-up ----------------------------------------------------------------------
    @property
    def all_workers(self) -> list[Any]:
        return self._actors.all_workers

    def _gather(self, refs: list[Any]) -> list[Any]:
        return self._actors.gather(refs)

    def _compile(self) -> None:
        from ray.dag import InputNode

        transport = self._pp_transport()
        stages = [lane[0] for lane in self.workers]  # tp == 1: one worker per stage
        with InputNode() as step:
            node = step
            for pp_rank, worker in enumerate(stages):
                node = worker.execute_step.bind(node)
                if pp_rank < self.pp_size - 1 and transport is not None:
                    node = node.with_tensor_transport(transport=transport)
        self.dag = node.experimental_compile(
            _max_inflight_executions=max(1, self.config.scheduler.max_inflight or 1),
            _buffer_size_bytes=self._channel_buffer_bytes(),
        )

    def _pp_transport(self) -> Any:
        if self.pp_size == 1:
            return None
        if self.use_wrapped_comm:
            logger.info("PP edges: RayPPCommunicator over the engine's PP group (%s)",
                        "NCCL" if self.config.device == "cuda" else "gloo")
            stages = [lane[0] for lane in self.workers]
            return RayPPCommunicator(stages)
        native = "accelerator" if self.config.device == "cuda" else "shm"
        logger.info("PP edges: Ray's own transport (%s); RAYPP_USE_RAY_WRAPPED_PP_COMM=0", native)
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
        """Start a step; returns a handle for :meth:`result`."""
        return self.dag.execute(step)

    def result(self, handle: Any, timeout: float | None = None) -> StepOutput:
        return ray.get(handle, timeout=timeout if timeout is not None else envs.RAYPP_STEP_TIMEOUT_S)

    # -- introspection ---------------------------------------------------------------------
    def comm_stats(self) -> list[dict[str, Any]]:
        return self._gather([lane[0].comm_stats.remote() for lane in self.workers])

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
        """True while every worker answers a ping."""
        try:
            ray.get([w.ping.remote() for w in self.all_workers], timeout=timeout)
            return True
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            return False

    # -- teardown -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tear down the graph, kill the workers, free the placement group (idempotent)."""
        _LIVE.discard(self)
        if self.dag is not None:
            try:
                self.dag.teardown()
            except Exception as e:  # noqa: BLE001 - teardown must finish
                logger.warning("compiled graph teardown: %s", e)
            self.dag = None
        self._actors.kill()
        self.workers = []


_LIVE: weakref.WeakSet[RayExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for executor in list(_LIVE):
        executor.shutdown()
