"""Write tiny, deterministic Hugging Face–format checkpoints for tests.

The directory is what a real checkpoint looks like: ``config.json``, safetensors
weights written by ``transformers``' own ``save_pretrained`` (single file or
sharded with an index), and a ``tokenizer.json`` trained with ``tokenizers`` on
``data/corpus.txt`` (an excerpt of the CPython documentation, PSF licence).
Weights are drawn large enough that every layer changes the argmax: with tiny
default init a model merely echoes its input and tests could not fail.

Families: ``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``gemma3`` (text), and the
mixture-of-experts ``qwen3_moe`` and ``mixtral`` (their expert counts and routing come
through ``extra_config``), each built by transformers' own config and model classes.
``save_original_format=False`` writes transformers' in-memory layout (fused 3-D expert
tensors) instead of the Hub's (one tensor per expert).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
# a Hermes/Qwen-style chat template: system, user, assistant (with <tool_call> calls), tool
# results, and the tools listed in the system turn
TOOL_CHAT_TEMPLATE = (Path(__file__).parent / "data" / "tool_chat_template.jinja").read_text()
_SPECIAL = ["<s>", "</s>", "<pad>"]


@dataclass
class TinyModelSpec:
    architecture: str = "llama"  # a key of _FAMILIES
    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    seed: int = 0
    max_shard_size: str | None = None  # e.g. "100KB" for a sharded checkpoint
    dtype: str = "float32"
    head_dim: int | None = None  # None: hidden_size // num_heads
    sliding_window: int | None = None  # mistral, qwen3 (with use_sliding_window), gemma3
    extra_config: dict[str, Any] = field(default_factory=dict)
    save_original_format: bool = True  # False: transformers' fused expert tensors
    chat_template: str | None = None  # Jinja; TOOL_CHAT_TEMPLATE renders tools (Hermes/Qwen style)


# architecture → (transformers config class, model class) names
_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on the shipped corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.read_text().split("\n\n"), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def make_tiny_model(path: str | Path, spec: TinyModelSpec | None = None, **overrides: Any) -> Path:
    """Write a checkpoint to ``path`` (created) and return it."""
    import torch
    import transformers

    spec = spec or TinyModelSpec(**overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size)
    vocab = len(tokenizer)
    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **spec.extra_config,
    )
    if spec.rope_scaling is not None:
        common["rope_scaling"] = spec.rope_scaling
    if spec.head_dim is not None:
        common["head_dim"] = spec.head_dim
    if spec.sliding_window is not None:
        common["sliding_window"] = spec.sliding_window
    if spec.architecture not in _FAMILIES:
        raise ValueError(f"unknown tiny architecture {spec.architecture!r}")
    config_name, model_name = _FAMILIES[spec.architecture]
    config = getattr(transformers, config_name)(**common)
    torch.manual_seed(spec.seed)
    model = getattr(transformers, model_name)(config)
    _init_weights(model, spec.seed, gemma_norms=spec.architecture == "gemma3")
    model = model.to(getattr(torch, spec.dtype))
    kwargs: dict[str, Any] = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    if not spec.save_original_format:
        kwargs["save_original_format"] = False
    model.save_pretrained(path, **kwargs)
    if spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
    tokenizer.save_pretrained(path)
    _drop_generation_defaults(path)
    return path


def _init_weights(model: Any, seed: int, gemma_norms: bool = False) -> None:
    """Random weights that matter (see the module docstring); Gemma's norms scale by
    ``1 + w``, so theirs are drawn around 0 rather than 1."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_((0 if gemma_norms else 1) + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                std = 1.5 / param.shape[-1] ** 0.5
                param.copy_(std * torch.randn(param.shape, generator=gen))


def _drop_generation_defaults(path: Path) -> None:
    """Keep only eos/bos in generation_config.json so HF's greedy is plain argmax."""
    gen = path / "generation_config.json"
    if gen.is_file():
        data = json.loads(gen.read_text())
        keep = {k: data[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in data}
        gen.write_text(json.dumps(keep, indent=2))
