"""Decode forward of a Llama stage as a chain of Triton kernels, for small batches.

A decode step at a small batch reads every weight once and does little arithmetic, so
what costs beyond the bytes is kernels that each take microseconds to start and drain:
about a dozen per layer on the compiled path (cuBLAS GEMMs, Inductor's norm, rotary and
SiLU kernels). :func:`fused_decode_forward` runs a layer as kernels of
:mod:`raypp.model.triton_decode`, seven:

    add+RMSNorm → qkv → rotary + KV store + attention → o → add+RMSNorm
    → gate/up with SiLU·mul → down

where the projections are GEMVs at batch 1 and tensor-core GEMMs split over K at
2..``GEMM_MAX_ROWS`` rows.
Every kernel is launched with programmatic dependent launch on Hopper, so it loads its
first weights while the previous one drains. It computes what
:meth:`raypp.model.llama.LlamaStageModel.forward` computes for decode tokens,
rounding where that path rounds; the decode CUDA graphs of those sizes capture it
(:mod:`raypp.executor.cuda_graphs`).
"""

from __future__ import annotations

from typing import Any

import torch

from raypp.model.triton_decode import (
    GEMM_MAX_ROWS,
    linear,
    pdl_supported,
    rms_norm,
    rope_decode_attention,
)

MAX_ROWS = GEMM_MAX_ROWS  # the largest batch the chain serves


def unsupported_reason(model: Any) -> str | None:
    """Why the fused path cannot run this stage's model (None: it can)."""
    layers = list(getattr(model.model, "layers", {}).values())
    if not layers:
        return "the stage has no layers"
    for layer in layers:
        attn = layer.self_attn
        if attn.qkv_proj.tp.size != 1:
            return "tensor parallelism (the fused path has no all-reduce)"
        if attn.head_dim % 2:
            return f"odd head_dim {attn.head_dim}"
    return None


def fused_decode_forward(model: Any, kv_caches: list[torch.Tensor], positions: torch.Tensor,
                         slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, input_ids: torch.Tensor | None,
                         hidden_states: torch.Tensor | None, residual: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``decode_forward``'s contract (:mod:`raypp.executor.cuda_graphs`) for up to
    :data:`MAX_ROWS` rows."""
    assert positions.shape[0] <= MAX_ROWS
    pdl = pdl_supported(positions.device)
    if model.stage.is_first:
        hidden, residual = model.model.embed_tokens(input_ids), None
    else:
        hidden = hidden_states
    for cache, layer in zip(kv_caches, model.model.layers.values(), strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, residual = _norm_linear(hidden, residual, layer.input_layernorm,
                                     attn.qkv_proj.weight, attn.qkv_proj.bias, False, pdl)
        out = rope_decode_attention(qkv, positions, attn.rotary.cos, attn.rotary.sin, cache,
                                    slot_mapping, block_tables, seq_lens, attn.num_heads,
                                    attn.attn.scale, pdl)
        out = linear(out, attn.o_proj.weight, attn.o_proj.bias, False, pdl)
        act, residual = _norm_linear(out, residual, layer.post_attention_layernorm,
                                     mlp.gate_up_proj.weight, None, True, pdl)
        hidden = linear(act, mlp.down_proj.weight, None, False, pdl)
    if model.stage.is_last:
        norm = model.model.norm
        return rms_norm(hidden, residual, norm.weight, norm.eps, pdl)[0], None
    return hidden, residual


def _norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: Any, w: torch.Tensor,
                 bias: torch.Tensor | None, gated: bool, pdl: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual)), x + residual)``."""
    x, residual = rms_norm(x, residual, norm.weight, norm.eps, pdl)
    return linear(x, w, bias, gated, pdl), residual
