"""Mixture-of-experts MLP: a router and stacked gated experts, one implementation for CPU
and CUDA (plain PyTorch), tensor-parallel, and the checkpoint names of its weights.

What a sparse layer computes (transformers' ``Qwen3MoeSparseMoeBlock`` and
``MixtralSparseMoeBlock``, and their ``grouped_mm`` experts implementation, which
transformers uses by default):

1. route: router logits ``x Wᵣᵀ`` in the model's dtype, softmax in fp32, top-k, the chosen
   weights renormalised to sum to 1 where :attr:`MoESpec.renormalize` (always for
   Mixtral, per ``norm_topk_prob`` for Qwen3-MoE); Qwen3-MoE then rounds them to the
   model's dtype, Mixtral keeps them in fp32 (:attr:`MoESpec.fp32_weights`);
2. sort the ``tokens × k`` (token, expert) pairs by expert, so each expert's rows are
   contiguous, delimited by device-side offsets (``searchsorted``, no host sync);
3. one grouped GEMM for every expert's gate/up, SiLU·mul, one grouped GEMM for down
   (:func:`grouped_linear`: ``torch.nn.functional.grouped_mm`` where this torch has it
   for the device and dtype, else a loop over the experts that reads the offsets on the
   host);
4. scale each pair's output by its routing weight, put the pairs back in token order and
   sum each token's k outputs (a gather and a sum, not ``index_add_``: deterministic on
   CUDA, where ``index_add_`` accumulates with atomics).

Tensor parallelism splits every expert's intermediate dimension: each rank holds the
rows ``[r·I/tp, (r+1)·I/tp)`` of each expert's gate and up and the same columns of its
down; the router is replicated (every rank routes alike), and the block's output is
all-reduced once.

Without a host sync (step 3 on ``grouped_mm``) the block can be captured in a CUDA graph;
:meth:`SparseMoeBlock.graph_capturable` says whether it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raypp.model.layers import TPContext, _param, linear_weight
from raypp.model.quantization.linear import Fp8Format, fp8_linear


@dataclass(frozen=True)
class MoESpec:
    """One family's sparse-layer settings, read from its config."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's (before the TP split)
    renormalize: bool  # the chosen k weights are divided by their sum
    fp32_weights: bool  # routing weights applied in fp32 (Mixtral), else in the model dtype


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...]) -> bool:
    """Whether :func:`torch.nn.functional.grouped_mm` serves ``dtype`` on ``device`` for
    matrices whose inner dimensions are ``dims``: on CPU wherever this torch has it; on
    CUDA for bfloat16 on compute capability 8.0 or newer, with every dimension a multiple
    of 8 (rows of 16 bytes, as its kernels need)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return (dtype == torch.bfloat16 and all(d % 8 == 0 for d in dims)
                and torch.cuda.get_device_capability(device) >= (8, 0))
    return False


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   grouped: bool, scale: torch.Tensor | None = None,
                   quant: Fp8Format | None = None) -> torch.Tensor:
    """``x[rows of e] @ weight[e]ᵀ`` for every expert ``e``: ``x`` is ``[S, K]`` sorted by
    expert, ``weight`` ``[E, N, K]``, ``offsets[e]`` (int32) the end of expert ``e``'s rows.
    ``grouped``: one ``grouped_mm`` (no host sync), else one GEMM per expert with rows
    (FP8 experts, ``scale`` ``[E, N, G]``: always, each through the FP8 GEMM)."""
    if grouped:
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = (F.linear(x[start:end], weight[e]) if scale is None else
                              fp8_linear(x[start:end], weight[e], scale[e], None, quant))
        start = end
    return out


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP: ``gate`` (the router, ``[E, hidden]``) and ``experts``.

    Parameters (names as the loader sees them under the layer's ``mlp``):
    ``gate.weight``, ``experts.w13_weight`` ``[E, 2·I/tp, hidden]`` (each expert's gate
    rows, then its up rows) and ``experts.w2_weight`` ``[E, hidden, I/tp]``; FP8 experts
    (``quant``, a GPU computing in FP8) add ``…_weight_scale`` per expert and run one FP8
    GEMM per expert (no ``grouped_mm``: such a stage runs without CUDA graphs).
    """

    def __init__(self, hidden: int, spec: MoESpec, tp: TPContext, dtype: torch.dtype,
                 quant: Fp8Format | None = None):
        super().__init__()
        if spec.intermediate_size % tp.size:
            raise ValueError(f"the experts' intermediate size {spec.intermediate_size} is not "
                             f"divisible by tensor_parallel_size={tp.size}")
        self.spec, self.tp = spec, tp
        self.gate = nn.Module()
        self.gate.weight = _param(spec.num_experts, hidden, dtype=dtype)
        self.experts = StackedExperts(spec.num_experts, hidden, spec.intermediate_size, tp, dtype,
                                      quant)
        self.grouped = quant is None and grouped_mm_supported(
            self.gate.weight.device, dtype, (hidden, self.experts.per_rank))

    def graph_capturable(self) -> bool:
        """True when :meth:`forward` never waits for the host (a CUDA graph may hold it)."""
        return self.grouped

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, each ``[tokens, k]``: the chosen experts by falling
        probability and their routing weights (fp32 or the model dtype, see the module)."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.spec.fp32_weights else weights.to(x.dtype)), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden]
        tokens, k = x.shape[0], self.spec.top_k
        weights, experts = self.route(x)
        sorted_experts, order = torch.sort(experts.reshape(-1), stable=True)
        ids = torch.arange(self.spec.num_experts, device=x.device)
        offsets = torch.searchsorted(sorted_experts, ids, right=True).to(torch.int32)
        w = self.experts
        h = grouped_linear(x[order // k], w.w13_weight, offsets, self.grouped, w.w13_weight_scale,
                           w.quant)
        gate, up = h.chunk(2, dim=-1)
        y = grouped_linear(F.silu(gate) * up, w.w2_weight, offsets, self.grouped,
                           w.w2_weight_scale, w.quant)
        y = y * weights.reshape(-1)[order, None]
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        out = unsorted.view(tokens, k, -1).sum(dim=1).to(x.dtype)
        return self.tp.all_reduce(out)


class StackedExperts(nn.Module):
    """Every expert's gate/up and down, stacked; this TP rank's slice of each.

    The loaders take one expert's tensor (``shard=(e, "gate" | "up" | "down")``, the
    per-expert checkpoint layout of the Hub) or all experts' at once (``shard=(None,
    "gate_up" | "down")``, transformers' fused ``experts.gate_up_proj`` ``[E, 2I, hidden]``
    and ``experts.down_proj`` ``[E, hidden, I]``), reading only this rank's rows.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPContext,
                 dtype: torch.dtype, quant: Fp8Format | None = None):
        super().__init__()
        self.tp, self.intermediate, self.quant = tp, intermediate, quant
        self.per_rank = intermediate // tp.size
        linear_weight(self, 2 * self.per_rank, hidden, dtype, quant, self._load_w13,
                      (num_experts,), "w13_weight")
        linear_weight(self, hidden, self.per_rank, dtype, quant, self._load_w2, (num_experts,),
                      "w2_weight")

    def _load_w13(self, param: torch.Tensor, loaded: Any, shard: tuple[int | None, str]) -> None:
        expert, part = shard
        n, start = self.per_rank, self.tp.rank * self.per_rank
        if expert is None:  # fused [E, 2I, hidden]: gate rows, then up rows
            param.data[:, :n].copy_(loaded.narrow(1, start, n))
            param.data[:, n:].copy_(loaded.narrow(1, self.intermediate + start, n))
            return
        offset = 0 if part == "gate" else n
        param.data[expert, offset:offset + n].copy_(loaded.narrow(0, start, n))

    def _load_w2(self, param: torch.Tensor, loaded: Any, shard: tuple[int | None, str]) -> None:
        expert, _ = shard
        n, start = self.per_rank, self.tp.rank * self.per_rank
        if expert is None:  # fused [E, hidden, I]
            param.data.copy_(loaded.narrow(2, start, n))
        else:
            param.data[expert].copy_(loaded.narrow(1, start, n))


# -- checkpoint names ---------------------------------------------------------------------

_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
# Mixtral's w1 is the gate, w3 the up and w2 the down projection
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down", "gate_up_proj": "gate_up"}


def expert_checkpoint_name(name: str) -> tuple[int, str, object] | None:
    """``(layer, our parameter, shard)`` for a checkpoint tensor of a sparse layer's experts
    or a Mixtral router, ``None`` for any other name.

    Reads both layouts: one tensor per expert (``…mlp.experts.<e>.gate_proj.weight``,
    Mixtral's ``…block_sparse_moe.experts.<e>.w1.weight``), as checkpoints on the Hub and
    transformers' ``save_pretrained`` store them, and the fused 3-D tensors transformers
    holds in memory (``…mlp.experts.gate_up_proj``, written with
    ``save_original_format=False``).
    """
    if m := _PER_EXPERT.match(name):
        layer, expert, part = int(m[1]), int(m[2]), _PART[m[3]]
        target = "w2_weight" if part == "down" else "w13_weight"
        return layer, f"model.layers.{layer}.mlp.experts.{target}", (expert, part)
    if m := _FUSED.match(name):
        layer, part = int(m[1]), _PART[m[2]]
        target = "w2_weight" if part == "down" else "w13_weight"
        return layer, f"model.layers.{layer}.mlp.experts.{target}", (None, part)
    if m := _ROUTER.match(name):
        layer = int(m[1])
        return layer, f"model.layers.{layer}.mlp.gate.weight", None
    return None
