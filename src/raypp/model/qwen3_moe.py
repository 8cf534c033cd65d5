"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, explicit ``head_dim``) with a
mixture-of-experts MLP on the sparse layers, as transformers' ``Qwen3MoeForCausalLM``
reads its config.

A layer is sparse when it is not in ``mlp_only_layers`` and ``(index + 1) %
decoder_sparse_step == 0`` (and ``num_experts > 0``); dense layers have a gated MLP of
``intermediate_size``, experts one of ``moe_intermediate_size``. The router picks
``num_experts_per_tok`` of ``num_experts`` experts (``num_local_experts``, the name
transformers 5 writes) and renormalises their weights only when ``norm_topk_prob``.
``use_sliding_window`` puts ``sliding_window`` on every layer.
"""

from __future__ import annotations

from raypp.model.moe import MoESpec
from raypp.model.moe_stage import MoEStageModel
from raypp.model.qwen3 import Qwen3StageModel


def qwen3_moe_num_experts(cfg: dict) -> int:
    return int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)


class Qwen3MoeStageModel(MoEStageModel):
    """One stage of a Qwen3-MoE model."""

    qk_norm = True
    renamed_params = Qwen3StageModel.renamed_params

    @staticmethod
    def moe_spec(cfg: dict) -> MoESpec:
        return MoESpec(num_experts=qwen3_moe_num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                       intermediate_size=int(cfg["moe_intermediate_size"]),
                       renormalize=bool(cfg.get("norm_topk_prob", False)), fp32_weights=False)

    @staticmethod
    def sparse_layers(cfg: dict) -> list[bool]:
        dense = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        experts = qwen3_moe_num_experts(cfg)
        return [i not in dense and experts > 0 and (i + 1) % step == 0
                for i in range(int(cfg["num_hidden_layers"]))]

    def layer_window(self, cfg: dict, index: int) -> int | None:
        return cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
