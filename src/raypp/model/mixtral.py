"""Mixtral: Mistral's attention (``sliding_window`` where the config sets one) with a
mixture-of-experts MLP on every layer, as transformers' ``MixtralForCausalLM`` computes it:
``num_experts_per_tok`` of ``num_local_experts`` experts of ``intermediate_size`` each,
their weights always renormalised and applied in fp32. Checkpoints name the experts
``block_sparse_moe.experts.<e>.w1/w2/w3`` (gate, down, up) and the router
``block_sparse_moe.gate``; transformers' own names (``mlp.…``) load too.
"""

from __future__ import annotations

from raypp.model.moe import MoESpec
from raypp.model.moe_stage import MoEStageModel


class MixtralStageModel(MoEStageModel):
    """One stage of a Mixtral model."""

    @staticmethod
    def moe_spec(cfg: dict) -> MoESpec:
        return MoESpec(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                       intermediate_size=int(cfg["intermediate_size"]), renormalize=True,
                       fp32_weights=True)

    @staticmethod
    def sparse_layers(cfg: dict) -> list[bool]:
        return [True] * int(cfg["num_hidden_layers"])

    def layer_window(self, cfg: dict, index: int) -> int | None:
        return cfg.get("sliding_window")
