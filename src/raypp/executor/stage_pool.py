"""The stage actors of one engine: placement, start-up, liveness, names and teardown.

Both control planes drive a :class:`StagePool`; it knows nothing about how steps
reach the stages. :meth:`StagePool.start` runs: join or start Ray → one
placement-group bundle per worker → actors named ``raypp_worker_<pp_rank>_<tp_rank>``
in a namespace of their own → ``torch.distributed`` rendezvous at an address rank 0
picks → model shards → KV cache sized to the smallest stage budget (and ``max_model_len``
fitted to it when the user gave none).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, TaskPlacementGroupRemoved
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypp.config import EngineConfig
from raypp.errors import first_line
from raypp.executor.liveness import ProgressWatch
from raypp.worker.progress import StageProgress
from raypp.worker.worker import StageWorker

logger = logging.getLogger(__name__)

WORKER_CPUS = 0.01  # stage actors must not need a whole CPU each on a 2-core box
STARTUP_TIMEOUT_S = 300
RESERVE_WARN_AFTER_S = 10.0  # a free cluster holds the bundles in well under a second
PING_TIMEOUT_S = 3.0  # a live actor answers a ping well within this, whatever it is doing


def ensure_ray(address: str | None) -> None:
    """Join the cluster at ``address`` (or ``RAY_ADDRESS``), else start a new local one
    (never one that someone started on this machine with ``ray start``: a benchmark
    must not measure someone else's cluster by accident).

    Token authentication: joining a cluster follows ``RAY_AUTH_MODE`` as the caller set
    it. A new local cluster runs without Ray's token authentication unless
    ``RAY_AUTH_MODE`` is set (``token`` keeps Ray's default): left unset, Ray 2.60 would
    turn it on for the new cluster, writing a token to ``~/.ray/auth_token`` and setting
    ``RAY_AUTH_MODE=token`` in this process's environment. ``RAY_AUTH_MODE=disabled`` is
    set only while ``ray.init`` starts the cluster's processes (they inherit it), logged at
    info level, then removed again: the caller's environment is left as it was.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        return
    unset = "RAY_AUTH_MODE" not in os.environ
    if unset:
        logger.info("starting a local Ray cluster without token authentication "
                    "(RAY_AUTH_MODE=token keeps Ray's default)")
        os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        ray.init(
            address="local",  # a new local cluster, never one that happens to run here
            num_cpus=max(2, os.cpu_count() or 2),
            object_store_memory=256 * 2**20,
            include_dashboard=False,
            log_to_driver=True,
            # Ray starts workers at nice 15; a stage is the engine's compute and must not
            # lose its core to the driver or anything else on the host
            _system_config={"worker_niceness": 0},
        )
    finally:
        if unset:
            os.environ.pop("RAY_AUTH_MODE", None)


def stage_summary(load_info: list[dict[str, Any]], kv_blocks: list[int],
                  tp_size: int) -> list[dict[str, Any]]:
    """Per stage: ``layers`` ``[start, end)``, ``weight_bytes`` (its largest TP rank's
    parameters as held), ``checkpoint_bytes`` (the most any of its TP ranks read from the
    checkpoint: FP8 weights and their scales where the checkpoint is FP8), ``kv_blocks``
    (the fewest any of its TP ranks can hold), the ``weight_format`` and ``draft`` (the
    first stage's draft model's load report, else ``None``), from the workers'
    ``load_model`` reports and KV budgets in rank order."""
    out = []
    for start in range(0, len(load_info), tp_size):
        ranks = load_info[start:start + tp_size]
        out.append({"stage": start // tp_size, "layers": tuple(ranks[0]["layers"]),
                    "weight_bytes": max(r["weight_bytes"] for r in ranks),
                    "checkpoint_bytes": max(r["bytes_read"] for r in ranks),
                    "kv_blocks": min(kv_blocks[start:start + tp_size]),
                    "weight_format": ranks[0].get("weight_format", "16/32-bit"),
                    "draft": ranks[0].get("draft")})
    return out


def format_stage_table(summary: list[dict[str, Any]], smallest: int) -> str:
    """The start-up table of :func:`stage_summary`: per stage its layers, the bytes a
    worker holds and read from the checkpoint (these differ where FP8 weights are held
    dequantized, or quantized as they load), its KV blocks; then the engine's KV capacity
    (the minimum over stages; ``smallest`` names the stage that sets it) and the weights'
    format."""
    lines = ["stage  layers          weights/worker  checkpoint read  KV blocks"]
    for row in summary:
        a, b = row["layers"]
        lines.append(f"{row['stage']:>5}  {f'{a}-{b - 1} ({b - a})':<14}  "
                     f"{_bytes(row['weight_bytes']):>14}  "
                     f"{_bytes(row.get('checkpoint_bytes', 0)):>15}  {row['kv_blocks']:>9}")
    lines.append(f"engine KV capacity = min over stages = {summary[smallest]['kv_blocks']} blocks "
                 f"(stage {smallest})")
    lines.append(f"weights: {summary[0].get('weight_format', '16/32-bit')}")
    for row in summary:
        draft = row.get("draft")
        if draft:
            lines.append(f"stage {row['stage']} also runs the draft model {draft['path']} "
                         f"({draft['layers']} layers, {_bytes(draft['weight_bytes'])} of weights "
                         f"besides the stage's, {_bytes(draft['block_bytes'])} of each KV "
                         "block: the stage's KV blocks count both caches)")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class StagePool:
    """Every worker of one engine, ``workers[pp_rank][tp_rank]``.

    :meth:`kill` is idempotent and undoes whatever part of :meth:`start` ran, so a
    failed start-up leaves nothing behind.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.namespace = f"raypp-{uuid.uuid4().hex[:8]}"
        self.pp_size = config.parallel.pipeline_parallel_size
        self.tp_size = config.parallel.tensor_parallel_size
        self.workers: list[list[Any]] = []
        self.load_info: list[dict[str, Any]] = []
        self.num_kv_blocks = 0
        self.stage_summary: list[dict[str, Any]] = []  # per stage, see stage_summary()
        self._pg: Any = None

    @property
    def all_workers(self) -> list[Any]:
        """Every worker, by global rank (``pp_rank * tp_size + tp_rank``)."""
        return [w for lane in self.workers for w in lane]

    def lane(self, tp_rank: int) -> list[Any]:
        """The workers of one TP index, in PP-rank order (one PP group)."""
        return [stage[tp_rank] for stage in self.workers]

    def name(self, index: int) -> str:
        """``"stage k (actor raypp_worker_k_t)"`` of the worker at global rank ``index``."""
        pp_rank, tp_rank = divmod(index, self.tp_size)
        return f"stage {pp_rank} (actor raypp_worker_{pp_rank}_{tp_rank})"

    # -- start-up ----------------------------------------------------------------------
    def start(self) -> None:
        """Create, connect and load every worker and size their KV caches."""
        ensure_ray(self.config.parallel.ray_address)
        self._create_actors()
        self.num_kv_blocks = self._init_workers()

    def _create_actors(self) -> None:
        on_gpu = self.config.device == "cuda"
        share = self.config.parallel.gpus_per_worker if on_gpu else 0
        bundle = {"GPU": share, "CPU": WORKER_CPUS} if on_gpu else {"CPU": WORKER_CPUS}
        world = self.pp_size * self.tp_size
        if on_gpu:
            self._check_gpus(world)
        self._reserve_bundles([dict(bundle) for _ in range(world)])
        # Ray's own compiled-graph knobs, if the user set any, apply in the stages too
        env = {k: v for k, v in os.environ.items() if k.startswith("RAY_CGRAPH_")}
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
                        num_cpus=WORKER_CPUS,
                        num_gpus=share,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            self._pg, placement_group_bundle_index=rank
                        ),
                        runtime_env={"env_vars": env},
                    ).remote(self.config, pp_rank, tp_rank)
                )

    def _check_gpus(self, world: int) -> None:
        """``ValueError`` naming the numbers when the cluster has too few GPUs."""
        per_gpu = self.config.parallel.workers_per_gpu
        need = -(-world // per_gpu)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if gpus >= need:
            return
        hint = (f"; with fewer GPUs, let workers share one: workers_per_gpu={-(-world // gpus)}"
                f" (--workers-per-gpu, RAYPP_WORKERS_PER_GPU)" if gpus else "")
        raise ValueError(
            f"tensor_parallel_size × pipeline_parallel_size = {world} workers at "
            f"workers_per_gpu={per_gpu} need {need} GPUs, but the Ray cluster has {gpus}{hint}")

    def _reserve_bundles(self, bundles: list[dict[str, float]]) -> None:
        """Hold one placement-group bundle per worker, waiting up to the start-up timeout.

        A node that dies while its bundles are reserved (a replaced stage's raylet
        can crash in Ray: ray-project/ray#63229) removes the group: a new one
        is asked for until the cluster can hold it again.
        """
        strategy = self.config.parallel.placement_strategy
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            self._pg = placement_group(bundles, strategy=strategy)
            try:
                self._wait_ready(bundles, deadline)
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
                    f"({bundles[0]} each, placement {strategy}) within {STARTUP_TIMEOUT_S} s; "
                    f"{len(alive)} node(s) alive with {ray.available_resources()} free"
                ) from None

    def _wait_ready(self, bundles: list[dict[str, float]], deadline: float) -> None:
        """Wait for the placement group until ``deadline``; one WARNING naming what is free
        once the wait passes ``RESERVE_WARN_AFTER_S`` (another engine or job holding the
        GPUs shows there, not only when the start-up timeout ends)."""
        ready = self._pg.ready()
        try:
            ray.get(ready, timeout=max(1.0, min(RESERVE_WARN_AFTER_S, deadline - time.monotonic())))
            return
        except GetTimeoutError:
            if time.monotonic() >= deadline:
                raise
        logger.warning(
            "waiting for the Ray cluster to hold %d stage workers (%s each): %s free now; "
            "another engine or job may hold them (giving up after %d s)",
            len(bundles), bundles[0], ray.available_resources(), STARTUP_TIMEOUT_S)
        ray.get(ready, timeout=max(1.0, deadline - time.monotonic()))

    def _remove_placement_group(self) -> None:
        if self._pg is not None:
            with contextlib.suppress(Exception):  # the cluster may be gone at exit
                remove_placement_group(self._pg)
            self._pg = None

    def _init_workers(self) -> int:
        init_method = ray.get(self.workers[0][0].rendezvous_address.remote(),
                              timeout=STARTUP_TIMEOUT_S)
        self.gather([w.init_distributed.remote(init_method) for w in self.all_workers])
        self.load_info = self.gather([w.load_model.remote() for w in self.all_workers])
        budgets = self.gather([w.kv_budget.remote() for w in self.all_workers])
        index = min(range(len(budgets)), key=lambda i: budgets[i].blocks)
        num_blocks = budgets[index].blocks
        self.stage_summary = stage_summary(self.load_info, [b.blocks for b in budgets], self.tp_size)
        logger.info("stages:\n%s", format_stage_table(self.stage_summary, index // self.tp_size))
        self._fit_max_model_len(num_blocks, f"{self.name(index)}: {budgets[index].explain()}")
        self.gather([w.init_kv_cache.remote(num_blocks) for w in self.all_workers])
        return num_blocks

    def _fit_max_model_len(self, num_blocks: int, budget: str) -> None:
        """Make one ``max_model_len`` sequence fit ``num_blocks``: lower ``max_model_len``
        to what they hold when the user gave none (one WARNING naming both numbers), else
        ``ValueError`` naming the numbers and what to change."""
        model, block_size = self.config.model, self.config.cache.block_size
        need = -(-model.max_model_len // block_size)
        if num_blocks >= need:
            return
        wanted, fits = model.max_model_len, num_blocks * block_size
        if fits > 0 and model.fit_max_model_len(fits):
            logger.warning(
                "max_model_len lowered from %d (the checkpoint's max_position_embeddings) to %d "
                "tokens, what the KV cache holds (%d blocks; %s); --max-model-len "
                "(max_model_len) sets it, --kv-cache-memory (kv_cache_memory_bytes) or "
                "--gpu-memory-utilization gives the cache more memory",
                wanted, fits, num_blocks, budget)
            return
        raise ValueError(
            f"KV cache budget holds {num_blocks} blocks but one max_model_len ({wanted}) "
            f"sequence needs {need}: {budget}; raise the KV memory budget (--kv-cache-memory, "
            "--gpu-memory-utilization), lower max_model_len (--max-model-len), or give the "
            "workers more memory each")

    @staticmethod
    def gather(refs: list[Any], timeout: float = STARTUP_TIMEOUT_S) -> list[Any]:
        return ray.get(refs, timeout=timeout)

    # -- liveness ----------------------------------------------------------------------
    def dead_stages(self, timeout: float = PING_TIMEOUT_S) -> list[str]:
        """``"stage k (actor …) died: …"`` for every worker Ray reports dead within
        ``timeout`` seconds (all pinged at once); a slow answer is not a death."""
        workers = self.all_workers
        refs = [w.ping.remote() for w in workers]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        dead = []
        for index, ref in enumerate(refs):
            if ref not in done:
                continue  # busy or slow, not known dead: the step timeout bounds the wait
            try:
                ray.get(ref, timeout=0)
            except RayActorError as e:
                dead.append(f"{self.name(index)} died: {type(e).__name__}: {first_line(e)}")
            except Exception:  # noqa: BLE001 - the cluster going away is not a stage death
                continue
        return dead

    def progress(self, timeout: float) -> list[StageProgress | None]:
        """Every worker's :class:`~raypp.worker.progress.StageProgress`, in rank order;
        ``None`` for one that did not answer within ``timeout`` seconds (or is gone)."""
        refs = [w.progress.remote() for w in self.all_workers]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out: list[StageProgress | None] = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=0) if ref in done else None)
            except Exception:  # noqa: BLE001 - a dead stage is dead_stages()' to report
                out.append(None)
        return out

    def watch(self, timeout_s: float) -> ProgressWatch:
        """A :class:`~raypp.executor.liveness.ProgressWatch` over these workers, for one
        wait for a step result."""
        names = [self.name(i) for i in range(len(self.all_workers))]
        return ProgressWatch(self.progress, names, timeout_s)

    def call_all(self, method: str, timeout: float, *args: Any) -> list[Any]:
        """``method(*args)`` on every worker, in rank order (raises on any failure)."""
        return ray.get([getattr(w, method).remote(*args) for w in self.all_workers],
                       timeout=timeout)

    def write_stacks(self) -> Path:
        """Every worker's thread stacks (where a stuck step waits), written to a file in
        ``<tmp>/raypp/``; returns its path (the stacks are also logged at DEBUG)."""
        refs = [w.stacks.remote() for w in self.all_workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)  # 5 s for all of them
        parts = []
        for index, ref in enumerate(refs):
            try:
                stacks = ray.get(ref, timeout=0) if ref in ready else "(no answer within 5 s)"
            except Exception as e:  # noqa: BLE001 - a report, not a requirement
                stacks = f"(unavailable: {first_line(e)})"
            parts.append(f"== stacks of {self.name(index)}:\n{stacks}\n")
        text = "\n".join(parts)
        logger.debug("stuck step:\n%s", text)
        folder = Path(tempfile.gettempdir()) / "raypp"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"stacks-{self.namespace}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        path.write_text(text)
        return path

    # -- teardown ------------------------------------------------------------------------
    def kill(self) -> None:
        """Kill the workers and free the placement group (idempotent)."""
        for worker in self.all_workers:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(worker, no_restart=True)
        self.workers.clear()
        self._remove_placement_group()
