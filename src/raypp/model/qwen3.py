"""Qwen3 (dense): Llama with a per-head RMSNorm of q and k (over ``head_dim``, before
rotary), an explicit ``head_dim`` (heads × head_dim may differ from the hidden size), no
qkv bias unless ``attention_bias``, and, where ``use_sliding_window`` is set, a sliding
window on the layers ``layer_types`` marks (else on layers ``>= max_window_layers``), as
transformers' ``Qwen3ForCausalLM`` reads its config.
"""

from __future__ import annotations

import torch

from raypp.model.base import layer_window
from raypp.model.layers import TPContext
from raypp.model.llama import DecoderLayer, LlamaStageModel


def qwen3_layer_types(cfg: dict) -> list[str]:
    """Each layer's attention type, from ``layer_types`` or transformers' default rule."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    sliding = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
    first = cfg.get("max_window_layers", 28)
    return ["sliding_attention" if sliding and i >= first else "full_attention"
            for i in range(cfg["num_hidden_layers"])]


class Qwen3StageModel(LlamaStageModel):
    """One stage of a Qwen3 model. Its fused CUDA decode chain is Llama's plus one launch
    that normalizes the q and k heads (:func:`raypp.kernels.norm.head_rms_norm_`)."""

    # our q/k norms live in the layer's PagedAttention (it applies them before rotary)
    renamed_params = {"self_attn.q_norm": "self_attn.attn.q_norm",
                      "self_attn.k_norm": "self_attn.attn.k_norm"}

    def make_layer(self, cfg: dict, index: int, tp: TPContext, dtype: torch.dtype,
                   backend: str) -> DecoderLayer:
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        return DecoderLayer(cfg, tp, dtype, backend, qk_norm=True, quant=self.quant,
                            sliding_window=layer_window(window, qwen3_layer_types(cfg), index))
