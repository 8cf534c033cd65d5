"""Random-weight Llama checkpoints for the lab scripts, at real models' shapes (and, through
:func:`sharp_init_checkpoint`'s ``family``, other transformers families).

Both builders write a Hugging Face directory raypp and transformers load: config,
safetensors, a plain greedy ``generation_config.json`` (no sampling defaults) and a
word-level tokenizer covering the whole vocabulary (``<s>`` 0, ``</s>`` 1, ``<pad>`` 2,
then ``t3``, ``t4``, …). Weights depend only on the shape and seed 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Llama-3.2-1B and Llama-3-8B shapes (transformers.LlamaConfig fields)
LLAMA_1B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
    rope_theta=500000.0, tie_word_embeddings=True)
LLAMA_8B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
    rope_theta=500000.0, tie_word_embeddings=False)
SPECIAL_TOKENS: dict[str, int] = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level fast tokenizer over ``vocab_size`` ids (whitespace-split words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<pad>")


def _plain_generation_config(path: Path) -> None:
    (path / "generation_config.json").write_text(json.dumps(SPECIAL_TOKENS))


def hf_init_checkpoint(path: Path, config_fields: dict[str, Any]) -> dict[str, Any]:
    """transformers' own init (``LlamaForCausalLM(config)``, std 0.02, on the GPU), saved
    in bf16. ``config_fields`` must include the special token ids. Returns ``{"params",
    "weight_bytes", "config"}`` (a tied embedding counted once)."""
    import transformers

    config = transformers.LlamaConfig(**config_fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    if (path / "generation_config.json").is_file():
        _plain_generation_config(path)
    word_tokenizer(config.vocab_size).save_pretrained(path)
    del model
    return {"params": n_params, "weight_bytes": 2 * n_params, "config": config_fields}


LLAMA_FAMILY = ("LlamaConfig", "LlamaForCausalLM")


def sharp_init_checkpoint(path: Path, shape: dict[str, Any], shard_bytes: int = 4 << 30,
                          family: tuple[str, str] = LLAMA_FAMILY) -> None:
    """Sharded bf16 safetensors drawn (on the GPU when there is one) with
    :mod:`raypp.testing`'s init recipe: norms near 1, projections of std 1.5/√fan-in and
    the LM head 4× sharper, so greedy argmaxes are decisive rather than bf16 near-ties.
    Each shard is written as soon as it is full (an 8B model never sits in host memory).

    ``family``: transformers' config and model class names (default Llama; e.g.
    ``("Qwen3MoeConfig", "Qwen3MoeForCausalLM")``, whose experts are written in
    transformers' fused 3-D layout). Gemma's norms scale by ``1 + w``, so theirs are drawn
    near 0. ``shape`` may set ``rms_norm_eps`` and the special token ids (default 1e-5 and
    :data:`SPECIAL_TOKENS`)."""
    import transformers
    from safetensors.torch import save_file

    config_cls, arch = family
    config = getattr(transformers, config_cls)(**{"rms_norm_eps": 1e-5, **SPECIAL_TOKENS, **shape},
                                               dtype="bfloat16")
    norm_center = 0.0 if arch.startswith("Gemma") else 1.0
    with torch.device("meta"):
        names = [(n, tuple(p.shape)) for n, p in getattr(transformers, arch)(config)
                 .named_parameters()]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    index: dict[str, str] = {}
    shard: dict[str, Any] = {}
    total = 0

    def flush() -> None:
        fname = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        index.update({n: fname for n in shard})
        shard.clear()

    for name, dims in names:
        x = torch.randn(dims, generator=gen, device=device, dtype=torch.float32)
        if "norm" in name:
            x = norm_center + 0.1 * x
        elif "embed_tokens" not in name:  # lm_head 4× sharper: fewer bf16 near-ties
            x *= (6.0 if name == "lm_head.weight" else 1.5) / dims[-1] ** 0.5
        t = x.to(torch.bfloat16).cpu()
        if shard and sum(v.nbytes for v in shard.values()) + t.nbytes > shard_bytes:
            flush()
        shard[name] = t
        total += t.nbytes
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    config.architectures = [arch]
    config.save_pretrained(path)
    _plain_generation_config(path)
    word_tokenizer(shape["vocab_size"]).save_pretrained(path)
