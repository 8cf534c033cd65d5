"""Random-weight checkpoints of Llama-3.1-8B's and Qwen3-8B's shapes for the FP8 benchmark,
in bf16 and in block FP8, written shard by shard on the GPU (an 8B model never sits in
host memory).

- :func:`bf16_checkpoint`: :mod:`benchmarks.checkpoints`' sharp init recipe (norms near 1,
  projections of std 1.5/√fan-in, the LM head 4x sharper) for either family;
- :func:`block_fp8_checkpoint`: the bf16 checkpoint's decoder linears quantized by the
  block rule (:func:`raypp.model.quantization.fp8.quantize_blocks`, 128×128,
  ``weight_scale_inv``), ``quant_method: "fp8"`` as DeepSeek-V3 and Qwen3-FP8 ship;
  the per-channel FP8 runs quantize the bf16 checkpoint at load (``quantization="fp8"``).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoints import LLAMA_8B, SPECIAL_TOKENS, word_tokenizer

QWEN3_8B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
    rope_theta=1000000.0, tie_word_embeddings=False)
MODELS = {"llama8b": ("LlamaConfig", "LlamaForCausalLM", {**LLAMA_8B, "rope_theta": 500000.0}),
          "qwen3_8b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_8B)}
_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
SHARD_BYTES = 4 << 30


def bf16_checkpoint(path: Path, model: str) -> Path:
    """Write (once) a bf16 checkpoint of ``model`` (a key of :data:`MODELS`) to ``path``."""
    import transformers
    from safetensors.torch import save_file

    if (path / "config.json").is_file():
        return path
    config_cls, arch, shape = MODELS[model]
    config = getattr(transformers, config_cls)(**shape, rms_norm_eps=1e-6, **SPECIAL_TOKENS,
                                               dtype="bfloat16")
    with torch.device("meta"):
        names = [(n, tuple(p.shape)) for n, p in getattr(transformers, arch)(config)
                 .named_parameters()]
    gen = torch.Generator(device="cuda").manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    index: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, dims in names:
        x = torch.randn(dims, generator=gen, device="cuda")
        if "norm" in name:
            x = 1 + 0.1 * x
        elif "embed_tokens" not in name:
            x *= (6.0 if name == "lm_head.weight" else 1.5) / dims[-1] ** 0.5
        t = x.to(torch.bfloat16).cpu()
        if shard and sum(v.nbytes for v in shard.values()) + t.nbytes > SHARD_BYTES:
            flush()
        shard[name] = t
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    config.architectures = [arch]
    config.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(SPECIAL_TOKENS))
    word_tokenizer(shape["vocab_size"]).save_pretrained(path)
    return path


def block_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Write (once) ``src`` with its decoder linears in block FP8 to ``dst``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from raypp.model.quantization.fp8 import quantize_blocks

    if (dst / "config.json").is_file():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    out_index: dict[str, str] = {}
    for file in sorted(set(index.values())):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(src / file), framework="pt", device="cuda") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = f.get_tensor(name)
                if _LINEAR.match(name):
                    q, scale = quantize_blocks(t, block)
                    out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q.cpu(), scale.cpu()
                else:
                    out[name] = t.cpu()
        save_file(out, str(dst / file), metadata={"format": "pt"})
        out_index.update(dict.fromkeys(out, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": out_index}))
    for extra in src.iterdir():
        if extra.suffix != ".safetensors" and extra.name != "model.safetensors.index.json":
            shutil.copy(extra, dst / extra.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst
