"""The stage worker: one process per (pp_rank, tp_rank), run as a Ray actor.

It owns the device, this stage's model shard and KV cache, and its process groups.
Set-up runs in the order the stage pool calls it: :meth:`StageWorker.rendezvous_address`
(rank 0) → :meth:`~StageWorker.init_distributed` → :meth:`~StageWorker.load_model` →
:meth:`~StageWorker.kv_budget` → :meth:`~StageWorker.init_kv_cache`.
:meth:`~StageWorker.execute_step` is the whole per-step compute of a stage (a
:class:`~raypp.worker.model_runner.ModelRunner` does it); it does not know which
control plane drives it. Everything the worker does is set by the
:class:`~raypp.config.EngineConfig` it is built with; it reads no environment variable.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from raypp.config import EngineConfig
from raypp.distributed import parallel_state, ray_compat
from raypp.distributed.communicator import drain_comm_trace
from raypp.distributed.parallel_state import RankLayout
from raypp.distributed.ports import free_port
from raypp.errors import StageError
from raypp.model.attention import attention_backend
from raypp.model.base import StageModel, StageSpec
from raypp.model.layers import TPContext
from raypp.model.loader import load_stage_weights
from raypp.model.quantization.linear import weight_format
from raypp.model.registry import model_class
from raypp.step import StageHandoff, StepInput, StepOutput
from raypp.worker.cpu_threads import StepThreads, stage_threads
from raypp.worker.draft_runner import DraftModel
from raypp.worker.faults import FaultInjector
from raypp.worker.kv_memory import KVBudget, cpu_budget, zeros
from raypp.worker.model_runner import ModelRunner
from raypp.worker.occupancy import OccupancyTotals, StageOccupancy
from raypp.worker.progress import StageProgress, StepProgress

logger = logging.getLogger(__name__)
_GIB = 2**30


class StageWorker:
    """Everything one pipeline stage (one TP rank of it) does."""

    def __init__(self, config: EngineConfig, pp_rank: int, tp_rank: int):
        self.config = config
        self.layout = RankLayout(config.parallel.tensor_parallel_size,
                                 config.parallel.pipeline_parallel_size)
        self.pp_rank, self.tp_rank = pp_rank, tp_rank
        self.rank = self.layout.rank(pp_rank, tp_rank)
        self.device = torch.device("cuda", 0) if config.device == "cuda" else torch.device("cpu")
        self._threads: StepThreads | None = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            self._threads = StepThreads(stage_threads(config.runtime.cpu_threads,
                                                      self.layout.world_size))
            torch.set_num_threads(self._threads.full)  # loading and set-up
        ray_compat.apply(on_cpu=self.device.type == "cpu")
        if config.model.gguf is not None:  # its imports overlap the rendezvous
            from raypp.model.gguf import preload

            preload()
        start, end = config.stage_layers()[pp_rank]
        self.stage = StageSpec(start, end, pp_rank == 0, pp_rank == self.layout.pp_size - 1)
        self.model: Any = None
        self.draft: DraftModel | None = None  # the first stage's draft model (load_model)
        self.runner: ModelRunner | None = None  # made in init_kv_cache
        self.timeline: list[tuple[int, float, float]] = []
        self.occupancy = StageOccupancy(self.pp_rank)
        self._fault = FaultInjector.for_stage(config.runtime.fault_inject, pp_rank)
        self._progress = StepProgress()
        self._direct_loop: Any = None

    # -- set-up ----------------------------------------------------------------------
    def rendezvous_address(self) -> str:
        """A ``tcp://ip:port`` on this node with a port free right now (rank 0 only)."""
        ip = _node_ip()
        return f"tcp://{ip}:{free_port(ip)}"

    def init_distributed(self, init_method: str) -> None:
        rc, pc = self.config.runtime, self.config.parallel
        parallel_state.init_distributed(self.layout, self.rank, init_method, self.device,
                                        rc.dist_timeout_s, use_local_pipes=pc.cpu_p2p == "auto")
        pp = parallel_state.get_pp_group()
        pp.instrument(trace=rc.trace_comm,
                      after_send=self._fault.after_send if self._fault.delays_sends else None)
        if not pp.is_last_rank:  # each edge named once, by its sender
            logger.info("stage %d (tp rank %d) → stage %d: %s", self.pp_rank, self.tp_rank,
                        self.pp_rank + 1, pp.device_communicator.transport(pp.next_rank))
        if parallel_state.get_tp_group().shares_device:
            logger.info("stage %d: its %d TP ranks share a GPU: all-reduces staged through "
                        "host memory", self.pp_rank, self.layout.tp_size)

    def load_model(self) -> dict[str, Any]:
        """Build only this stage's layers on the device and load their weights."""
        mc = self.config.model
        tp_group = parallel_state.get_tp_group()
        tp = TPContext(tp_group.rank_in_group, tp_group.world_size,
                       tp_group if tp_group.world_size > 1 else None)
        torch.manual_seed(mc.seed)
        fp8 = weight_format(mc.quant_config, self.device)  # None: 16/32-bit (CPU dequantizes)
        with torch.device(self.device):
            self.model = model_class(mc.architecture)(mc.hf_config, self.stage, tp,
                                                      mc.torch_dtype,
                                                      attention_backend(self.device), quant=fp8)
        report = load_stage_weights(self.model, *mc.checkpoint_on_this_node(),
                                    quant=mc.quant_config)
        self.model.eval()
        quant = mc.quant_config
        self.draft = DraftModel.load(self.config, self.stage, self.device, tp)
        return {
            "weight_format": ("16/32-bit" if quant is None else quant.describe()
                              + ("" if fp8 else "; held dequantized to "
                                 + str(mc.torch_dtype).replace("torch.", ""))),
            "draft": None if self.draft is None else self.draft.report,
            "pp_rank": self.pp_rank,
            "tp_rank": self.tp_rank,
            "layers": [self.stage.start, self.stage.end],
            "checkpoint_tensors": report.names,
            "bytes_read": report.bytes_read,
            "weight_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "param_shapes": {n: list(p.shape) for n, p in self.model.named_parameters()},
        }

    def kv_block_bytes(self) -> int:
        kv_heads, head_dim = self.model.kv_cache_layout()
        per_layer = 2 * self.config.cache.block_size * kv_heads * head_dim
        draft = 0 if self.draft is None else self.draft.kv_block_bytes(self.config.cache.block_size)
        return per_layer * self.model.num_layers * self.kv_dtype.itemsize + draft

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's element type (``kv_cache_dtype``)."""
        return self.config.cache.kv_torch_dtype(self.config.model.torch_dtype)

    def kv_budget(self) -> KVBudget:
        """How many KV blocks of this stage's layers fit its memory budget.

        On CUDA the workers of one GPU (every model loaded, no cache allocated yet)
        split what ``gpu_memory_utilization`` leaves of the device evenly; on CPU each
        worker takes ``kv_cache_memory_bytes``, or when that is unset its share of the
        host's available memory (:func:`raypp.worker.kv_memory.cpu_budget`).
        """
        cache = self.config.cache
        block = self.kv_block_bytes()
        if cache.num_blocks_override:
            n = cache.num_blocks_override
            return KVBudget(n, n * block, block, "num_blocks_override")
        world = parallel_state.get_world_group()
        sharing = world.localities.count(world.localities[world.rank_in_group])
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = (free - (1 - cache.gpu_memory_utilization) * total) / sharing
            source = (f"{free / _GIB:.2f} GiB free of {total / _GIB:.2f} GiB, keeping "
                      f"{1 - cache.gpu_memory_utilization:.0%} free, shared by {sharing} "
                      "worker(s) on this GPU")
            return KVBudget.of(budget, block, source)
        if cache.kv_cache_memory_bytes is not None:
            return KVBudget.of(cache.kv_cache_memory_bytes, block, "kv_cache_memory_bytes")
        import psutil

        per_seq = -(-self.config.model.max_model_len // cache.block_size)
        return cpu_budget(psutil.virtual_memory().available, sharing, block,
                          self.config.scheduler.max_num_seqs * per_seq)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache and, on CUDA unless ``enforce_eager``, capture the
        decode graphs (the draft model's too, over its own cache); the worker is then ready
        to run steps."""
        mc = self.config.model
        kv_heads, head_dim = self.model.kv_cache_layout()
        shape = (2, num_blocks, self.config.cache.block_size, kv_heads, head_dim)
        kv_caches = [zeros(shape, self.kv_dtype, self.device)
                     for _ in range(self.model.num_layers)]
        graphs = self._decode_graphs(self.model, kv_caches, num_blocks, mc.hidden_size,
                                     mc.torch_dtype, "stage")
        tick = self._advance if self._fault.in_forward else self._progress.tick
        self.runner = ModelRunner(self.model, kv_caches, graphs, self.device,
                                  self.config.cache.block_size, on_progress=tick)
        if self.draft is not None:  # its own blocks, as many as the target's
            draft = self.draft.runner(num_blocks, self.config.cache.block_size, self.device,
                                      on_progress=tick)
            dc = self.config.speculative_config.draft
            draft.graphs = self._decode_graphs(draft.model, draft.kv_caches, num_blocks,
                                               dc.hidden_size, dc.torch_dtype, "draft model")
            self.runner.draft = draft

    def _decode_graphs(self, model: StageModel, kv_caches: list[torch.Tensor], num_blocks: int,
                       hidden_size: int, dtype: torch.dtype, what: str) -> Any:
        """``model``'s captured decode graphs over ``kv_caches``, or ``None`` (CPU,
        ``enforce_eager``, TP ranks sharing a GPU, a model that cannot be captured: the
        last two logged as a WARNING naming ``what`` runs eagerly)."""
        rc = self.config.runtime
        if self.device.type != "cuda" or rc.enforce_eager:
            return None
        if parallel_state.get_tp_group().shares_device:
            logger.warning("%s %d runs eagerly: its TP ranks share a GPU, and an all-reduce "
                           "staged through host memory cannot be captured in a CUDA graph",
                           what, self.pp_rank)
            return None
        uncapturable = model.decode_graphs_unsupported()
        if uncapturable:
            logger.warning("%s %d runs eagerly (no decode CUDA graphs): %s", what, self.pp_rank,
                           uncapturable)
            return None
        from raypp.worker.cuda_graphs import DecodeGraphs

        return DecodeGraphs(
            model, kv_caches, is_first=model.stage.is_first, is_last=model.stage.is_last,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            # the engine may have fitted max_model_len to num_blocks after this config was sent
            max_blocks_per_seq=min(-(-self.config.model.max_model_len
                                     // self.config.cache.block_size), num_blocks),
            hidden_size=hidden_size, dtype=dtype, device=self.device,
            compile_forward=rc.compile_decode, fused_max_rows=rc.fused_decode_max_rows,
        ).capture()

    @property
    def decode_graphs(self) -> Any:
        """The captured decode graphs (``None`` on CPU or with ``enforce_eager``)."""
        return None if self.runner is None else self.runner.graphs

    # -- the step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_step(self, payload: StepInput | StageHandoff) -> StageHandoff | StepOutput:
        """Run this stage on one micro-batch: a :class:`StepInput` on the first stage,
        the previous stage's :class:`StageHandoff` on the others.

        Returns this stage's :class:`StageHandoff` for the next stage, or a
        :class:`StepOutput` on the last stage. Errors are :class:`StageError` naming
        the stage and the step.
        """
        handoff = payload if isinstance(payload, StageHandoff) else None
        step = payload.step if handoff is not None else payload
        started = time.time()
        self._progress.begin(step.step_id)
        try:
            self._fault.before_step(step)
            if self._threads is not None:
                self._threads.for_step(step.num_tokens)
            out = self.runner.execute(step, handoff)
        except Exception as e:  # noqa: BLE001 - re-raised with the stage named
            raise StageError(f"stage {self.pp_rank} (tp rank {self.tp_rank}) failed at step "
                             f"{step.step_id}: {type(e).__name__}: {e}") from e
        finally:
            self._progress.end()
        ended = time.time()
        self.occupancy.record(step.submitted_at, started, ended, step.num_tokens * step.num_steps)
        if step.trace:
            self.timeline.append((self.pp_rank, started, ended))
        return out

    def first_output(self, *outputs: StepOutput) -> StepOutput:
        """The compiled graph's output with TP: the last stage's TP ranks sample alike, and
        this (on its rank 0) returns rank 0's output once every rank has one."""
        return outputs[0]

    # -- the direct control plane ------------------------------------------------------
    def start_direct_loop(self, spec: Any) -> int:
        """Start this worker's direct-plane loop (:mod:`raypp.worker.stage_loop`) on
        threads of the actor; returns the actor's pid."""
        from raypp.worker.stage_loop import StageLoop

        if self.direct_loop_alive():
            raise RuntimeError(f"worker {spec.index} already runs a direct-plane loop")
        self._direct_loop = StageLoop(self, spec)
        self._direct_loop.start()
        return os.getpid()

    def direct_loop_alive(self) -> bool:
        return self._direct_loop is not None and self._direct_loop.alive()

    # -- introspection for tests and operators -----------------------------------------
    def comm_stats(self) -> dict[str, Any]:
        """This worker's PP traffic, and how each PP edge travels (``transports``: peer
        PP rank → ``"nccl"``, ``"host-staged"``, ``"shm-pipe"`` or ``"gloo"``)."""
        pp = parallel_state.get_pp_group()
        stats = pp.device_communicator.stats
        return {"pp_rank": self.pp_rank, "tp_rank": self.tp_rank, "sends": stats.sends,
                "recvs": stats.recvs,
                "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
                "transports": pp.transports()}

    def channel_communicators(self) -> list[str]:
        """Type names of the communicators Ray's channels use in this actor."""
        from ray.experimental.channel import ChannelContext

        return [type(c).__name__ for c in ChannelContext.get_current().communicators.values()]

    def occupancy_totals(self) -> OccupancyTotals:
        """This stage's busy/wait counters now (:mod:`raypp.worker.occupancy`)."""
        return self.occupancy.totals()

    def traced_intervals(self) -> list[tuple[int, float, float]]:
        out, self.timeline = list(self.timeline), []
        return out

    def drain_comm_trace(self) -> list[tuple[str, int, float, float, int]]:
        """This stage's traced PP send/recv intervals since the last call (``trace_comm``)."""
        return drain_comm_trace()

    def _advance(self) -> None:
        """The forward's progress tick when a fault acts inside the forward (test-only)."""
        self._progress.tick()
        self._fault.on_progress(self._progress)

    def ping(self) -> int:
        return os.getpid()

    def progress(self) -> StageProgress:
        """How far this stage's compute has come; answered while a step runs (on another
        thread of the actor), without waiting for it (:mod:`raypp.worker.progress`)."""
        return self._progress.snapshot()

    def stacks(self) -> str:
        """Every thread's Python stack in this stage (what a stuck step is waiting on)."""
        import sys
        import threading
        import traceback

        names = {t.ident: t.name for t in threading.enumerate()}
        return "\n".join(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
                         for ident, frame in sys._current_frames().items())

    def node_id(self) -> str:
        """The Ray node this stage runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        parallel_state.destroy_distributed()


def _node_ip() -> str:
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        return "127.0.0.1"
