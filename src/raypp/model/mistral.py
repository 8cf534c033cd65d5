"""Mistral: Llama with a sliding attention window on every layer.

``sliding_window`` in the config (``null``: none, as in Mistral v0.2 and later) limits
each query to the last ``sliding_window`` positions up to its own, in prefill, chunked
prefill and decode alike, as transformers' ``MistralForCausalLM`` masks it.
"""

from __future__ import annotations

import torch

from raypp.model.layers import TPContext
from raypp.model.llama import DecoderLayer, LlamaStageModel


class MistralStageModel(LlamaStageModel):
    """One stage of a Mistral model; the fused CUDA decode chain is Llama's, with the window."""

    def make_layer(self, cfg: dict, index: int, tp: TPContext, dtype: torch.dtype,
                   backend: str) -> DecoderLayer:
        return DecoderLayer(cfg, tp, dtype, backend, sliding_window=cfg.get("sliding_window"),
                            quant=self.quant)
