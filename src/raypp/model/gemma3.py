"""Gemma 3 text decoder (``Gemma3ForCausalLM``) holding only one pipeline stage's layers.

What differs from Llama, each as transformers computes it:

- RMSNorm is ``x * rsqrt(mean(x²) + eps) * (1 + w)`` computed in fp32, then cast
  (:class:`GemmaRMSNorm`); a layer has four: before and after attention (the second
  normalizes the attention *output*, before the residual add), before and after the MLP;
- embeddings are scaled by √hidden, the scale rounded to the activation dtype;
- the MLP is GeGLU with the tanh GELU;
- q and k are normalized per head before rotary; attention scores are scaled by
  ``query_pre_attn_scalar ** -0.5``;
- ``layer_types`` interleaves sliding-window and global layers, each type with its own
  rotary base (and the global one with its rope scaling);
- embeddings are tied by default; ``final_logit_softcapping``, when set, caps the logits.

Stages hand each other ``(x, residual)`` with ``x + residual`` the residual stream, as
Llama's do. There is no fused CUDA decode chain: decode graphs hold the compiled forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raypp.model.attention import AttentionMetadata, PagedAttention
from raypp.model.base import StageModel, StageSpec, layer_window
from raypp.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    _param,
)
from raypp.model.quantization.linear import Fp8Format


def gemma3_layer_types(cfg: dict) -> list[str]:
    """Each layer's attention type: ``layer_types``, else every ``sliding_window_pattern``-th
    layer (default 6) global and the others sliding, as transformers derives it."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(cfg["num_hidden_layers"])]


def gemma3_rope(cfg: dict, layer_type: str) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` of a layer type, from either config style.

    transformers >= 5 writes ``rope_parameters`` keyed by layer type; older checkpoints
    have ``rope_theta`` and ``rope_scaling`` for the global layers and
    ``rope_local_base_freq`` for the sliding ones.
    """
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):
        scaling = dict(params[layer_type])
        theta = float(scaling.pop("rope_theta"))
    elif layer_type == "sliding_attention":
        theta, scaling = float(cfg.get("rope_local_base_freq", 10_000.0)), None
    else:
        theta, scaling = float(cfg.get("rope_theta", 1_000_000.0)), cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling or None


class GemmaRMSNorm(nn.Module):
    """``(x * rsqrt(mean(x²) + eps) * (1 + weight))`` in fp32, cast back to x's dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TPContext, dtype: torch.dtype,
                 quant: Fp8Format | None = None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False, tp, dtype,
                                                       quant)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp, dtype, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: dict, rotary: RotaryEmbedding, sliding_window: int | None,
                 tp: TPContext, dtype: torch.dtype, backend: str, quant: Fp8Format | None = None):
        super().__init__()
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        bias = bool(cfg.get("attention_bias", False))
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias, tp, dtype,
                                          quant)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias, tp, dtype, quant)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, head_dim, rotary, backend,
            scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            sliding_window=sliding_window,
            q_norm=GemmaRMSNorm(head_dim, eps, dtype), k_norm=GemmaRMSNorm(head_dim, eps, dtype))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(hidden), positions, kv_cache, meta))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, rotary: RotaryEmbedding, sliding_window: int | None,
                 tp: TPContext, dtype: torch.dtype, backend: str, quant: Fp8Format | None = None):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = Gemma3Attention(cfg, rotary, sliding_window, tp, dtype, backend, quant)
        self.mlp = GemmaMLP(hidden, cfg["intermediate_size"], tp, dtype, quant)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # the stream entering the layer is hidden (+ residual): transformers' hidden_states
        stream = hidden if residual is None else hidden + residual
        x = self.self_attn(positions, self.input_layernorm(stream), kv_cache, meta)
        stream = stream + self.post_attention_layernorm(x)
        x = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(stream)))
        return x, stream  # the stream leaving the layer is x + stream


class Gemma3StageModel(StageModel):
    """One stage of a Gemma 3 text model (see the module docstring).

    ``forward`` takes token ids (first stage) or the previous stage's
    ``hidden_states``/``residual`` and returns the same pair, except on the last stage,
    which returns final normalized hidden states.
    """

    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    renamed_params = {"self_attn.q_norm": "self_attn.attn.q_norm",
                      "self_attn.k_norm": "self_attn.attn.k_norm"}

    def __init__(self, cfg: dict, stage: StageSpec, tp: TPContext, dtype: torch.dtype,
                 attention_backend: str = "torch", quant: Fp8Format | None = None):
        super().__init__()
        for name in ("attn_logit_softcapping",):
            if cfg.get(name) is not None:
                raise ValueError(f"Gemma3 with {name}={cfg[name]} is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma3 with use_bidirectional_attention is not supported")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma3 with hidden_activation={act!r} is not supported")
        self.cfg = cfg
        self.stage = stage
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        self.final_logit_softcapping = cfg.get("final_logit_softcapping")
        hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.model = nn.Module()
        if stage.is_first:
            self.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, tp, dtype)
            # transformers keeps √hidden as an fp32 tensor and rounds it to the weights' dtype
            self.register_buffer("embed_scale", torch.tensor(hidden**0.5), persistent=False)
        types = gemma3_layer_types(cfg)
        window = cfg.get("sliding_window", 4096)
        head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
        rotaries: dict[str, RotaryEmbedding] = {}  # one table per layer type, shared by the stage
        layers = {}
        for i in range(stage.start, stage.end):
            kind = types[i]
            if kind not in rotaries:
                theta, scaling = gemma3_rope(cfg, kind)
                rotaries[kind] = RotaryEmbedding(
                    head_dim, cfg.get("max_position_embeddings", 131_072), theta, scaling)
            layers[str(i)] = Gemma3DecoderLayer(cfg, rotaries[kind], layer_window(window, types, i),
                                                tp, dtype, attention_backend, quant)
        self.model.layers = nn.ModuleDict(layers)
        if stage.is_last:
            self.model.norm = GemmaRMSNorm(hidden, eps, dtype)
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
            embeds = self.model.embed_tokens(input_ids)
            hidden_states = embeds * self.embed_scale.to(embeds.dtype)
            residual = None
        for cache, layer in zip(kv_caches, self.model.layers.values()):
            hidden_states, residual = layer(positions, hidden_states, residual, cache, meta)
        if self.stage.is_last:
            return self.model.norm(hidden_states + residual), None
        return hidden_states, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
