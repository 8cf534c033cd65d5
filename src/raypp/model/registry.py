"""Hugging Face ``architectures`` name → stage model class, and which one a config names."""

from __future__ import annotations

from raypp.model.base import StageModel
from raypp.model.gemma3 import Gemma3StageModel
from raypp.model.llama import LlamaStageModel
from raypp.model.mistral import MistralStageModel
from raypp.model.mixtral import MixtralStageModel
from raypp.model.qwen3 import Qwen3StageModel
from raypp.model.qwen3_moe import Qwen3MoeStageModel

_MODELS: dict[str, type[StageModel]] = {
    "LlamaForCausalLM": LlamaStageModel,
    "Qwen2ForCausalLM": LlamaStageModel,
    "Qwen3ForCausalLM": Qwen3StageModel,
    "MistralForCausalLM": MistralStageModel,
    "Gemma3ForCausalLM": Gemma3StageModel,
    "Qwen3MoeForCausalLM": Qwen3MoeStageModel,
    "MixtralForCausalLM": MixtralStageModel,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def model_class(architecture: str) -> type[StageModel]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(_MODELS)}"
        ) from None


def resolve_architecture(hf_config: dict) -> str:
    """The supported architecture a checkpoint's config names.

    The first of its ``architectures`` that raypp supports; a config without
    ``architectures`` (e.g. one read from GGUF metadata) falls back to its
    ``model_type``, through transformers' own causal-LM mapping (``"qwen3"`` →
    ``Qwen3ForCausalLM``, ``"gemma3_text"`` → ``Gemma3ForCausalLM``). ``ValueError``
    naming the supported architectures otherwise.
    """
    archs = list(hf_config.get("architectures") or [])
    for arch in archs:
        if arch in _MODELS:
            return arch
    model_type = hf_config.get("model_type")
    if not archs and model_type:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if arch in _MODELS:
            return arch
        archs = [arch] if arch else []
    raise ValueError(
        f"architectures {archs} (model_type {model_type!r}) are not supported; raypp supports "
        f"{', '.join(_MODELS)}"
    )
