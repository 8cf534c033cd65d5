"""Hugging Face ``architectures`` name → stage model class."""

from __future__ import annotations

from torch import nn

from raypp.model.llama import LlamaStageModel

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaStageModel,
    "Qwen2ForCausalLM": LlamaStageModel,
}


def model_class(architecture: str) -> type[LlamaStageModel]:
    try:
        return _MODELS[architecture]  # type: ignore[return-value]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(_MODELS)}"
        ) from None
