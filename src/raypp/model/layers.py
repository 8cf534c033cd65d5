"""Building blocks of a decoder stage: norms, rotary embedding, TP-aware linear
layers (attention over the paged KV cache is :mod:`raypp.model.attention`).

Every parameter carries a ``weight_loader(param, loaded, shard=None)`` so that
TP slicing (and fused q/k/v, gate/up) lives in the layer, not in the loader.
``loaded`` is anything with ``shape`` and ``narrow(dim, start, length)``: a
tensor, or the loader's lazy view that reads only the narrowed range from disk.
Layers get their TP group passed in; none reads topology from globals.

A linear layer built with an FP8 format (``quant``, a GPU that computes in FP8) holds an
e4m3 weight and its ``weight_scale`` (:mod:`raypp.model.quantization.linear`), both loaded
by the same loader; without one (CPU, or a 16/32-bit model) it holds the model's dtype,
FP8 checkpoints dequantized as they load. Linear weights are marked ``quantizable``:
the loader quantizes exactly these when a 16/32-bit checkpoint is loaded as FP8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raypp.model.quantization.linear import Fp8Format, fp8_linear, fp8_weight_params


@dataclass
class TPContext:
    """This worker's place in its stage's tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # GroupCoordinator; None when size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else self.group.all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else self.group.all_gather(x, dim=-1)


def _default_loader(param: torch.Tensor, loaded: Any, shard: Any = None) -> None:
    assert tuple(param.shape) == tuple(loaded.shape), (param.shape, loaded.shape)
    param.data.copy_(loaded.narrow(0, 0, loaded.shape[0]))


def _param(*shape: int, dtype: torch.dtype, loader: Any = _default_loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


def linear_weight(module: nn.Module, out_features: int, in_features: int, dtype: torch.dtype,
                  quant: Fp8Format | None, loader: Any, lead: tuple[int, ...] = (),
                  name: str = "weight") -> None:
    """Give ``module`` its linear weight ``name`` ``[*lead, out, in]``: in ``dtype``, or
    (``quant``) in e4m3 with ``<name>_scale`` beside it; either way ``quantizable``."""
    if quant is None:
        weight = _param(*lead, out_features, in_features, dtype=dtype, loader=loader)
        setattr(module, f"{name}_scale", None)
    else:
        weight, scale = fp8_weight_params(out_features, in_features, quant, loader, lead)
        setattr(module, f"{name}_scale", scale)
    weight.quantizable = True
    setattr(module, name, weight)


def apply_linear(x: torch.Tensor, module: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ module.weight.T + bias``, through the FP8 GEMM when the weight is e4m3."""
    if module.weight_scale is None:
        return F.linear(x, module.weight, bias)
    return fp8_linear(x, module.weight, module.weight_scale, bias, module.quant)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x + residual`` normalized, and the new residual when one is given."""
        if residual is not None:
            x = x + residual
            residual = x
        orig = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(orig)
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with ``linear`` and ``llama3`` scaling (as HF)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind not in (None, "default"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported")
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# -- tensor-parallel linear layers ------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with W's output rows split over TP ranks (no gather)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext,
                 dtype: torch.dtype, quant: Fp8Format | None = None):
        super().__init__()
        assert out_features % tp.size == 0, (out_features, tp.size)
        self.tp, self.quant = tp, quant
        self.out_per_rank = out_features // tp.size
        linear_weight(self, self.out_per_rank, in_features, dtype, quant, self._load)
        self.bias = _param(self.out_per_rank, dtype=dtype, loader=self._load) if bias else None

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        start = self.tp.rank * self.out_per_rank
        param.data.copy_(loaded.narrow(0, start, self.out_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused (gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPContext,
                 dtype: torch.dtype, quant: Fp8Format | None = None):
        super().__init__(in_features, sum(out_sizes), bias, tp, dtype, quant)
        self.sizes = [s // tp.size for s in out_sizes]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        size = self.sizes[shard]
        offset = sum(self.sizes[:shard])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; kv heads are replicated when fewer than TP ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPContext, dtype: torch.dtype, quant: Fp8Format | None = None):
        if num_heads % tp.size:
            raise ValueError(f"num_attention_heads={num_heads} is not divisible by tp={tp.size}")
        if num_kv_heads >= tp.size and num_kv_heads % tp.size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} is not divisible by tp={tp.size}")
        if num_kv_heads < tp.size and tp.size % num_kv_heads:
            raise ValueError(f"tp={tp.size} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden, out, bias, tp, dtype, quant)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard == "q":
            offset, size, src = 0, q_size, self.tp.rank * q_size
        else:
            offset = q_size if shard == "k" else q_size + kv_size
            size, src = kv_size, (self.tp.rank // self.kv_replicas) * kv_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, src, size))


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard W_shardᵀ) + b`` with W's input columns split over TP."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext,
                 dtype: torch.dtype, quant: Fp8Format | None = None):
        super().__init__()
        assert in_features % tp.size == 0, (in_features, tp.size)
        self.tp, self.quant = tp, quant
        self.in_per_rank = in_features // tp.size
        linear_weight(self, out_features, self.in_per_rank, dtype, quant, self._load)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        param.data.copy_(loaded.narrow(1, self.tp.rank * self.in_per_rank, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(apply_linear(x, self, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over TP ranks (all-reduced lookup)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.per_rank = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.per_rank
        self.vocab_size = vocab_size
        self.weight = _param(self.per_rank, hidden, dtype=dtype, loader=self._load)

    def _load(self, param: torch.Tensor, loaded: Any, shard: Any = None) -> None:
        rows = max(0, min(self.per_rank, loaded.shape[0] - self.start))
        param.data.zero_()  # padding rows past the vocabulary stay zero
        if rows:
            param.data[:rows].copy_(loaded.narrow(0, self.start, rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the (TP-split, then gathered) vocabulary."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_gather(F.linear(hidden, self.weight))
        return out[:, : self.vocab_size]
