"""Single-sequence decode forward of a Llama stage as a chain of Triton kernels.

At batch 1 a decode step reads every weight once and does almost no arithmetic, so
what costs beyond the bytes is kernels that each take microseconds to start and drain:
about a dozen per layer on the compiled path (cuBLAS GEMVs, Inductor's norm, rotary
and SiLU kernels, KV store, attention, split combine). :func:`fused_decode_forward`
runs a layer as seven kernels of :mod:`raypp.model.triton_decode`:

    add+RMSNorm → qkv GEMV → rotary + KV store + attention → split combine
    → o GEMV → add+RMSNorm → gate/up GEMV with SiLU·mul → down GEMV

launched with programmatic dependent launch on Hopper, so each kernel loads its
weights while the previous one drains. It computes what
:meth:`raypp.model.llama.LlamaStageModel.forward` computes for one decode token,
rounding where that path rounds; the batch-1 decode CUDA graph captures it
(:mod:`raypp.executor.cuda_graphs`).
"""

from __future__ import annotations

from typing import Any

import torch

from raypp.model.triton_decode import gemv, pdl_supported, rms_norm, rope_decode_attention


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
    """``decode_forward``'s contract (:mod:`raypp.executor.cuda_graphs`) for one row."""
    assert positions.shape[0] == 1, "the fused decode path serves batch 1"
    pdl = pdl_supported(positions.device)
    if model.stage.is_first:
        hidden, residual = model.model.embed_tokens(input_ids), None
    else:
        hidden = hidden_states
    for cache, layer in zip(kv_caches, model.model.layers.values(), strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        x, residual = rms_norm(hidden, residual, norm.weight, norm.eps, pdl)
        qkv = gemv(x, attn.qkv_proj.weight, attn.qkv_proj.bias, False, pdl)
        out = rope_decode_attention(qkv, positions, attn.rotary.cos, attn.rotary.sin, cache,
                                    slot_mapping, block_tables, seq_lens, attn.num_heads,
                                    attn.attn.scale, pdl)
        out = gemv(out, attn.o_proj.weight, attn.o_proj.bias, False, pdl)
        norm = layer.post_attention_layernorm
        x, residual = rms_norm(out, residual, norm.weight, norm.eps, pdl)
        hidden = gemv(gemv(x, mlp.gate_up_proj.weight, None, True, pdl),
                      mlp.down_proj.weight, None, False, pdl)
    if model.stage.is_last:
        norm = model.model.norm
        return rms_norm(hidden, residual, norm.weight, norm.eps, pdl)[0], None
    return hidden, residual
