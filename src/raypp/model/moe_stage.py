"""A Llama-style stage whose MLP is a mixture of experts on the layers its family marks
sparse (:class:`MoEStageModel`); Qwen3-MoE and Mixtral are subclasses choosing the
attention options, the sparse layers and the router's settings.

Loading: a sparse layer's experts are stacked into two parameters per layer at load
(:mod:`raypp.model.moe`), each worker reading only its stage's layers and, of each
expert, only its TP rank's rows; dense layers load as Llama's.
"""

from __future__ import annotations

import torch

from raypp.model.layers import TPContext
from raypp.model.llama import DecoderLayer, LlamaStageModel
from raypp.model.moe import MoESpec, SparseMoeBlock, expert_checkpoint_name


class MoEStageModel(LlamaStageModel):
    """One stage of a mixture-of-experts decoder: Llama layers, a :class:`SparseMoeBlock`
    as the MLP of each sparse layer. No fused decode chain; CUDA graphs only where every
    sparse layer's experts run without a host sync (see :meth:`decode_graphs_unsupported`)."""

    qk_norm = False  # a per-head q/k RMSNorm before rotary (Qwen3-MoE)

    @staticmethod
    def moe_spec(cfg: dict) -> MoESpec:
        """The family's router and experts settings."""
        raise NotImplementedError

    @staticmethod
    def sparse_layers(cfg: dict) -> list[bool]:
        """For each global layer, whether its MLP is a mixture of experts."""
        raise NotImplementedError

    def layer_window(self, cfg: dict, index: int) -> int | None:
        """Global layer ``index``'s sliding attention window (``None``: full attention)."""
        return None

    def make_layer(self, cfg: dict, index: int, tp: TPContext, dtype: torch.dtype,
                   backend: str) -> DecoderLayer:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
        mlp = (SparseMoeBlock(cfg["hidden_size"], self.moe_spec(cfg), tp, dtype, self.quant)
               if self.sparse_layers(cfg)[index] else None)
        return DecoderLayer(cfg, tp, dtype, backend, sliding_window=self.layer_window(cfg, index),
                            qk_norm=self.qk_norm, mlp=mlp, quant=self.quant)

    def checkpoint_names(self, name: str) -> list[tuple[str, object]]:
        """Llama's names, plus the experts (either layout) and Mixtral's router
        (:func:`raypp.model.moe.expert_checkpoint_name`) of this stage's layers."""
        expert = expert_checkpoint_name(name)
        if expert is None:
            return super().checkpoint_names(name)
        layer, target, shard = expert
        return [(target, shard)] if self.stage.start <= layer < self.stage.end else []

    def fused_decode_unsupported(self) -> str | None:
        return "mixture-of-experts layers have no fused decode chain"

    def decode_graphs_unsupported(self) -> str | None:
        for index, layer in self.model.layers.items():
            if isinstance(layer.mlp, SparseMoeBlock) and not layer.mlp.graph_capturable():
                dtype = layer.mlp.gate.weight.dtype
                return (f"layer {index}'s experts run one GEMM per expert, reading the routing "
                        f"on the host (torch's grouped_mm serves bfloat16 on compute capability "
                        f">= 8.0, dimensions multiples of 8; this stage is "
                        f"{str(dtype).replace('torch.', '')})")
        return None
