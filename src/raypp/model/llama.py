"""Llama-family decoder (Llama, Qwen2; Mistral and Qwen3 build on it) holding only one
pipeline stage's layers.

Layers a stage does not own are absent, not zero: their parameters are never
allocated or read. The first stage owns the embedding, the last the final norm
and LM head. Parameter names match Hugging Face checkpoints
(``model.layers.<global index>.…``) so the loader maps names one to one.

A layer may have a sliding attention window and a per-head q/k RMSNorm
(:class:`DecoderLayer`'s options); a family that uses them is a subclass choosing them
per layer in :meth:`LlamaStageModel.make_layer`. Without them the computation is
Llama's, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raypp.model.attention import AttentionMetadata, PagedAttention
from raypp.model.base import StageModel, StageSpec
from raypp.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
)
from raypp.model.quantization.linear import Fp8Format

FUSED_DECODE_MAX_ROWS = 64  # raypp.kernels.linear.GEMM_MAX_ROWS (not imported: Triton)


class DecoderLayer(nn.Module):
    """One Llama layer; ``sliding_window`` and ``qk_norm`` (a per-head RMSNorm of q and k
    before rotary, Qwen3's) are off for Llama and Qwen2. ``mlp`` replaces the dense gated
    MLP (a mixture-of-experts block maps ``[tokens, hidden]`` to the same)."""

    def __init__(self, cfg: dict, tp: TPContext, dtype: torch.dtype, backend: str,
                 sliding_window: int | None = None, qk_norm: bool = False,
                 mlp: nn.Module | None = None, quant: Fp8Format | None = None):
        super().__init__()
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        llama_bias = bool(cfg.get("attention_bias", False))
        qwen2 = cfg.get("model_type") == "qwen2"  # Qwen2: bias on q/k/v only
        self.self_attn = Attention(
            cfg, hidden, heads, kv_heads, head_dim, llama_bias or qwen2, llama_bias, tp, dtype,
            backend, sliding_window, qk_norm, quant
        )
        self.mlp = mlp if mlp is not None else MLP(hidden, cfg["intermediate_size"], tp, dtype,
                                                   quant)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Attention(nn.Module):
    def __init__(self, cfg: dict, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 qkv_bias: bool, o_bias: bool, tp: TPContext, dtype: torch.dtype, backend: str,
                 sliding_window: int | None = None, qk_norm: bool = False,
                 quant: Fp8Format | None = None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, qkv_bias, tp, dtype,
                                          quant)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, o_bias, tp, dtype, quant)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        theta, scaling = rope_settings(cfg)
        rotary = RotaryEmbedding(head_dim, cfg.get("max_position_embeddings", 2048), theta,
                                 scaling)
        norms = {}
        if qk_norm:
            eps = cfg.get("rms_norm_eps", 1e-6)
            norms = {"q_norm": RMSNorm(head_dim, eps, dtype), "k_norm": RMSNorm(head_dim, eps, dtype)}
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, rotary, backend,
                                   sliding_window=sliding_window, **norms)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # hidden: [tokens, hidden]
        return self.o_proj(self.attn(self.qkv_proj(hidden), positions, kv_cache, meta))


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` from either config style.

    Older checkpoints have top-level ``rope_theta`` and ``rope_scaling``;
    transformers >= 5 writes both into ``rope_parameters``.
    """
    params = dict(cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0
    scaling = cfg.get("rope_scaling") or params or None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TPContext, dtype: torch.dtype,
                 quant: Fp8Format | None = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False, tp, dtype,
                                                       quant)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp, dtype, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaStageModel(StageModel):
    """One stage of a Llama-family model (Llama, Qwen2).

    ``forward`` takes token ids (first stage) or the previous stage's
    ``hidden_states``/``residual`` and returns the same pair, except on the last
    stage, which returns final normalized hidden states of the requested rows.
    """

    fused_decode_max_rows = FUSED_DECODE_MAX_ROWS
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: dict, stage: StageSpec, tp: TPContext, dtype: torch.dtype,
                 attention_backend: str = "torch", quant: Fp8Format | None = None):
        super().__init__()
        self.cfg = cfg
        self.stage = stage
        self.quant = quant  # FP8 linears (a GPU computing in FP8), read by make_layer
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
        self.model = nn.Module()
        if stage.is_first:
            self.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, tp, dtype)
        self.model.layers = nn.ModuleDict(
            {str(i): self.make_layer(cfg, i, tp, dtype, attention_backend)
             for i in range(stage.start, stage.end)}
        )
        if stage.is_last:
            self.model.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6), dtype)
            self.lm_head = ParallelLMHead(vocab, hidden, tp, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.stage.is_first:
            hidden_states = self.model.embed_tokens(input_ids)
            residual = None
        for cache, layer in zip(kv_caches, self.model.layers.values()):
            hidden_states, residual = layer(positions, hidden_states, residual, cache, meta)
        if self.stage.is_last:
            hidden_states, _ = self.model.norm(hidden_states, residual)
            return hidden_states, None
        return hidden_states, residual

    def make_layer(self, cfg: dict, index: int, tp: TPContext, dtype: torch.dtype,
                   backend: str) -> DecoderLayer:
        """Global layer ``index`` of this family (a subclass picks its options; every one
        passes :attr:`quant` on)."""
        return DecoderLayer(cfg, tp, dtype, backend, quant=self.quant)

    # -- the fused decode chain (CUDA graphs of small decode batches) ----------------------
    def fused_decode_unsupported(self) -> str | None:
        if self.quant is not None:
            return "FP8 weights (the chain's GEMV and GEMM read 16-bit weights)"
        for layer in self.model.layers.values():
            attn = layer.self_attn
            if attn.qkv_proj.tp.size != 1:
                return "tensor parallelism (the fused path has no all-reduce)"
            if attn.head_dim % 2:
                return f"odd head_dim {attn.head_dim}"
        return None

    def fused_decode_forward(self, kv_caches: list[torch.Tensor], positions: torch.Tensor,
                             slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, input_ids: torch.Tensor | None,
                             hidden_states: torch.Tensor | None, residual: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` of a decode batch of up to :data:`FUSED_DECODE_MAX_ROWS` rows as a
        chain of :mod:`raypp.kernels` launches, seven per layer::

            add+RMSNorm → qkv → rotary + KV store + attention → o → add+RMSNorm
            → gate/up with SiLU·mul → down

        (a layer with a q/k norm adds one launch after qkv, normalizing its q and k heads
        in place; a sliding window is the attention kernel's).

        The projections are GEMVs at batch 1 and tensor-core GEMMs split over K above.
        On Hopper every kernel is launched with programmatic dependent launch, so it
        loads its first weights while the previous one drains: a small decode batch
        reads every weight once and does little arithmetic, so what costs beyond the
        bytes is kernels that each take microseconds to start and drain. It rounds
        where :meth:`forward` rounds.
        """
        from raypp.kernels.decode_attention import rope_decode_attention
        from raypp.kernels.linear import linear
        from raypp.kernels.norm import head_rms_norm_, rms_norm
        from raypp.kernels.tuning import pdl_supported

        assert positions.shape[0] <= FUSED_DECODE_MAX_ROWS
        pdl = pdl_supported(positions.device)

        def norm_linear(x: torch.Tensor, res: torch.Tensor | None, norm: Any, w: torch.Tensor,
                        bias: torch.Tensor | None, gated: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
            # (linear(rms_norm(x + res)), x + res)
            x, res = rms_norm(x, res, norm.weight, norm.eps, pdl)
            return linear(x, w, bias, gated, pdl), res

        if self.stage.is_first:
            hidden, residual = self.model.embed_tokens(input_ids), None
        else:
            hidden = hidden_states
        for cache, layer in zip(kv_caches, self.model.layers.values(), strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            qkv, residual = norm_linear(hidden, residual, layer.input_layernorm,
                                        attn.qkv_proj.weight, attn.qkv_proj.bias, False)
            paged = attn.attn
            if paged.q_norm is not None:
                head_rms_norm_(qkv, paged.q_norm.weight, paged.k_norm.weight, paged.q_norm.eps,
                               attn.num_heads, attn.num_kv_heads, pdl)
            rotary = paged.rotary
            out = rope_decode_attention(qkv, positions, rotary.cos, rotary.sin, cache,
                                        slot_mapping, block_tables, seq_lens, attn.num_heads,
                                        paged.scale, pdl, window=paged.sliding_window,
                                        k_scale=paged.k_scale, v_scale=paged.v_scale)
            out = linear(out, attn.o_proj.weight, attn.o_proj.bias, False, pdl)
            act, residual = norm_linear(out, residual, layer.post_attention_layernorm,
                                        mlp.gate_up_proj.weight, None, True)
            hidden = linear(act, mlp.down_proj.weight, None, False, pdl)
        if self.stage.is_last:
            norm = self.model.norm
            return rms_norm(hidden, residual, norm.weight, norm.eps, pdl)[0], None
        return hidden, residual
