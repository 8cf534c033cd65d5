"""The stage worker: one process per (pp_rank, tp_rank), run as a Ray actor.

It owns the device, this stage's model shard and KV cache, and its process
groups. ``execute_step`` is the whole per-step compute of a stage; it does not
know which control plane (compiled graph or otherwise) drives it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from raypp import envs
from raypp.config import EngineConfig, partition_layers
from raypp.distributed import parallel_state, ray_compat
from raypp.distributed.parallel_state import RankLayout
from raypp.distributed.ports import free_port
from raypp.engine.sampler import SamplingTensors, sample
from raypp.engine.step import StepInput, StepOutput
from raypp.executor.cuda_graphs import DecodeGraphs
from raypp.executor.decode_loop import DecodeInputs, run_decode_steps
from raypp.executor.errors import StageError
from raypp.executor.faults import FaultInjector
from raypp.model.layers import AttentionMetadata, TPContext
from raypp.model.llama import StageSpec
from raypp.model.loader import load_stage_weights
from raypp.model.registry import model_class

logger = logging.getLogger(__name__)

Intermediate = dict[str, torch.Tensor]


class StageWorker:
    """Everything one pipeline stage (one TP rank of it) does."""

    def __init__(self, config: EngineConfig, pp_rank: int, tp_rank: int):
        self.config = config
        self.layout = RankLayout(config.parallel.tensor_parallel_size,
                                 config.parallel.pipeline_parallel_size)
        self.pp_rank, self.tp_rank = pp_rank, tp_rank
        self.rank = self.layout.rank(pp_rank, tp_rank)
        self.device = torch.device("cuda", 0) if config.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            threads = max(1, (os.cpu_count() or 1) // self.layout.world_size)
            torch.set_num_threads(threads)
        ray_compat.apply(on_cpu=self.device.type == "cpu")
        self.model: Any = None
        self.decode_graphs: DecodeGraphs | None = None  # captured in init_kv_cache (CUDA)
        self.kv_caches: list[torch.Tensor] = []
        self.timeline: list[tuple[int, float, float]] = []
        # (step id, its last sampled ids on the device) of the latest decode round
        self._last_round: tuple[int, torch.Tensor] | None = None
        self._fault = FaultInjector.from_env(pp_rank)

    # -- set-up ----------------------------------------------------------------------
    def rendezvous_address(self) -> str:
        """A ``tcp://ip:port`` on this node with a port free right now (rank 0 only)."""
        ip = _node_ip()
        return f"tcp://{ip}:{free_port(ip)}"

    def init_distributed(self, init_method: str) -> None:
        parallel_state.init_distributed(
            self.layout, self.rank, init_method, self.device, envs.RAYPP_DIST_TIMEOUT_S
        )

    def load_model(self) -> dict[str, Any]:
        """Build only this stage's layers on the device and load their weights."""
        mc = self.config.model
        bounds = partition_layers(mc.num_layers, self.layout.pp_size,
                                  self.config.parallel.layer_partition)
        start, end = bounds[self.pp_rank]
        self.stage = StageSpec(start, end, self.pp_rank == 0, self.pp_rank == self.layout.pp_size - 1)
        tp_group = parallel_state.get_tp_group()
        tp = TPContext(tp_group.rank_in_group, tp_group.world_size,
                       tp_group if tp_group.world_size > 1 else None)
        torch.manual_seed(mc.seed)
        with torch.device(self.device):
            self.model = model_class(mc.architecture)(mc.hf_config, self.stage, tp, mc.torch_dtype)
        report = load_stage_weights(self.model, mc.model)
        self.model.eval()
        return {
            "pp_rank": self.pp_rank,
            "tp_rank": self.tp_rank,
            "layers": [start, end],
            "checkpoint_tensors": report.names,
            "bytes_read": report.bytes_read,
            "param_shapes": {n: list(p.shape) for n, p in self.model.named_parameters()},
        }

    def kv_block_bytes(self) -> int:
        mc = self.config.model
        kv_heads = self.model.model.layers[str(self.stage.start)].self_attn.num_kv_heads
        per_layer = 2 * self.config.cache.block_size * kv_heads * mc.head_dim
        return per_layer * (self.stage.end - self.stage.start) * mc.torch_dtype.itemsize

    def available_kv_blocks(self) -> int:
        """How many KV blocks of this stage's layers fit its memory budget."""
        cache = self.config.cache
        if cache.num_blocks_override:
            return cache.num_blocks_override
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - cache.gpu_memory_utilization) * total
        else:
            budget = cache.kv_cache_memory_bytes
        return max(0, int(budget // self.kv_block_bytes()))

    def init_kv_cache(self, num_blocks: int) -> None:
        mc = self.config.model
        first = self.model.model.layers[str(self.stage.start)].self_attn
        shape = (2, num_blocks, self.config.cache.block_size, first.num_kv_heads, mc.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=mc.torch_dtype, device=self.device)
            for _ in range(self.stage.end - self.stage.start)
        ]
        self.decode_graphs = None
        if self.device.type == "cuda" and not envs.RAYPP_ENFORCE_EAGER:
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_caches, is_first=self.stage.is_first,
                is_last=self.stage.is_last,
                max_num_seqs=self.config.scheduler.max_num_seqs,
                max_blocks_per_seq=-(-mc.max_model_len // self.config.cache.block_size),
                hidden_size=mc.hidden_size, dtype=mc.torch_dtype, device=self.device,
                compile_forward=envs.RAYPP_COMPILE_DECODE, fused_max_rows=envs.RAYPP_FUSED_DECODE,
            ).capture()

    # -- the step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_step(self, payload: StepInput | tuple[StepInput, Intermediate]):
        """Run this stage on one micro-batch.

        Returns ``(step, {"hidden_and_residual": [2, tokens, hidden]})`` for the next
        stage, or a :class:`StepOutput` on the last stage. Errors name the stage.
        """
        step, inputs = (payload, None) if isinstance(payload, StepInput) else payload
        started = time.time()
        previous, self._last_round = self._last_round, None  # only the next step may continue it
        try:
            self._fault.before_step(step.step_id)
            if not self.stage.is_last:
                hidden, residual = self._forward(step, inputs)
                # one tensor, so each hop is one transfer: [2, tokens, hidden]
                out: Any = (step, {"hidden_and_residual": torch.stack((hidden, residual))})
            elif step.num_steps > 1 or step.continues is not None:
                out = self._decode_steps(step, previous)
            else:
                out = self._sample(step, self._logits(step, inputs))
        except Exception as e:  # noqa: BLE001 - re-raised with the stage named
            raise StageError(f"stage {self.pp_rank} (tp rank {self.tp_rank}) failed at step "
                             f"{step.step_id}: {type(e).__name__}: {e}") from e
        if step.trace:
            self.timeline.append((self.pp_rank, started, time.time()))
        return out

    def _forward(self, step: StepInput, inputs: Intermediate | None):
        """``(hidden, residual)`` of every token of ``step`` on a stage that is not last."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(step):  # CUDA decode: replay a captured graph
            return graphs.run(step, inputs)
        return self._eager_forward(step, inputs)

    def _eager_forward(self, step: StepInput, inputs: Intermediate | None):
        dev = self.device
        positions = torch.tensor(step.positions, dtype=torch.int64, device=dev)
        meta = _attention_metadata(step, dev)
        if self.stage.is_first:
            ids = torch.tensor(step.input_ids, dtype=torch.int64, device=dev)
            return self.model(positions, meta, self.kv_caches, input_ids=ids)
        assert inputs is not None
        return self.model(positions, meta, self.kv_caches,
                          hidden_states=inputs["hidden_and_residual"][0],
                          residual=inputs["hidden_and_residual"][1])

    def _logits(self, step: StepInput, inputs: Intermediate | None) -> torch.Tensor | None:
        """Run the last stage on ``step``: logits of its sampled rows (``None`` if none)."""
        rows = step.sample_rows
        picked = torch.tensor(rows, dtype=torch.int64, device=self.device) if rows else None
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(step):
            logits = graphs.run(step, inputs)  # every row's, computed inside the graph
            if len(rows) == step.num_seqs:  # a decode step samples every row, in order
                return logits
            return None if picked is None else logits.index_select(0, picked)
        hidden, _ = self._eager_forward(step, inputs)
        return None if picked is None else self.model.compute_logits(hidden.index_select(0, picked))

    def _sample(self, step: StepInput, logits: torch.Tensor | None) -> StepOutput:
        if logits is None:
            return StepOutput(step.step_id, [], [])
        tokens, logprobs = sample(logits, step.sampling)
        return StepOutput(step.step_id, [[t] for t in tokens],
                          [None if lp is None else [lp] for lp in logprobs])

    def _decode_steps(self, step: StepInput, previous: tuple[int, torch.Tensor] | None
                      ) -> StepOutput:
        """``step.num_steps`` decode steps of a one-stage pipeline, in one call.

        A step that ``continues`` a round takes its input ids from that round's last
        tokens: ``previous``, the round this stage ran just before (else ``ValueError``).
        """
        if step.continues is not None and (previous is None or previous[0] != step.continues):
            raise ValueError(f"step {step.step_id} continues step {step.continues}, but the "
                             "latest decode round here is "
                             f"{'none' if previous is None else previous[0]}")
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(step):
            inputs = graphs.load(step)
            forward = graphs.replay
        else:
            inputs = DecodeInputs.from_step(step, self.device)
            meta = inputs.metadata()

            def forward() -> torch.Tensor:
                hidden, _ = self.model(inputs.positions, meta, self.kv_caches,
                                       input_ids=inputs.input_ids)
                return self.model.compute_logits(hidden)

        if step.continues is not None:
            assert previous is not None
            _feed_last_tokens(inputs.input_ids, previous[1], step.continue_rows)
        assert step.sampling is not None
        run = run_decode_steps(
            forward, inputs, SamplingTensors.build(step.sampling, self.device), step.num_steps,
            self.config.cache.block_size)
        self._last_round = (step.step_id, run.last_tokens)
        return StepOutput(step.step_id, run.token_ids, run.logprobs)

    # -- introspection for tests and operators -----------------------------------------
    def comm_stats(self) -> dict[str, Any]:
        pp = parallel_state.get_pp_group()
        stats = pp.device_communicator.stats
        return {"pp_rank": self.pp_rank, "tp_rank": self.tp_rank, "sends": stats.sends,
                "recvs": stats.recvs,
                "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received}

    def channel_communicators(self) -> list[str]:
        """Type names of the communicators Ray's channels use in this actor."""
        from ray.experimental.channel import ChannelContext

        return [type(c).__name__ for c in ChannelContext.get_current().communicators.values()]

    def traced_intervals(self) -> list[tuple[int, float, float]]:
        out, self.timeline = list(self.timeline), []
        return out

    def ping(self) -> int:
        return os.getpid()

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


def _feed_last_tokens(input_ids: torch.Tensor, last: torch.Tensor, rows: list[int]) -> None:
    """``input_ids[r] = last[rows[r]]``, on the device (no host sync)."""
    if rows == list(range(len(rows))):
        input_ids.copy_(last[: len(rows)])
    else:
        index = torch.tensor(rows, dtype=torch.int64).to(last.device, non_blocking=True)
        torch.index_select(last, 0, index, out=input_ids)


def _attention_metadata(step: StepInput, device: torch.device) -> AttentionMetadata:
    width = max(len(t) for t in step.block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in step.block_tables],
                          dtype=torch.int64, device=device)
    query_lens = [b - a for a, b in zip(step.query_start, step.query_start[1:])]
    return AttentionMetadata(
        slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64, device=device),
        query_start=step.query_start,
        seq_lens=step.seq_lens,
        block_tables=tables,
        decode_only=all(q == 1 for q in query_lens),
        seq_lens_tensor=torch.tensor(step.seq_lens, dtype=torch.int64, device=device),
    )


def _node_ip() -> str:
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        return "127.0.0.1"
