"""The reference nobody here wrote: Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch


@cache
def _hf_model(model_dir: str):
    """transformers' model of a checkpoint directory, or of a ``.gguf`` file (dequantized
    to fp32 by transformers' own GGUF loader)."""
    import transformers

    path, kwargs = Path(model_dir), {}
    if path.suffix == ".gguf":
        model_dir, kwargs["gguf_file"] = str(path.parent), path.name
    elif _quant_method(path) == "compressed-tensors":  # decompressed once, as raypp on CPU
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(run_compressed=False)
    # a block-FP8 checkpoint (quant_method "fp8"): transformers dequantizes it without a GPU
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              **kwargs)
    return model.eval()


def _quant_method(path: Path) -> str | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    return (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method")


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int,
              **generate_kwargs) -> list[list[int]]:
    """Greedy continuation of each prompt (token ids), stopping at EOS like HF does;
    ``generate_kwargs`` go to ``generate`` (e.g. ``repetition_penalty``)."""
    model = _hf_model(str(model_dir))
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=model.config.pad_token_id,
                **generate_kwargs,
            )
        outs.append(y[0, len(ids):].tolist())
    return outs


def hf_logits(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """Next-token logits at every position of ``ids``: [len(ids), vocab]."""
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def e4m3_kv_cache(model, scales: dict[int, tuple[float, float]] | None = None):
    """A transformers cache that rounds what it stores through e4m3 with each layer's
    ``(k_scale, v_scale)`` (1.0 where none): raypp's FP8 KV cache, in transformers."""
    from transformers import DynamicCache

    from raypp.model.quantization.fp8 import round_through_fp8

    scales = scales or {}

    class E4M3Cache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k, v = scales.get(layer_idx, (1.0, 1.0))
            return super().update(round_through_fp8(key_states, k),
                                  round_through_fp8(value_states, v), layer_idx, *args, **kwargs)

    return E4M3Cache(config=model.config)


def round_linear_inputs_per_token(model) -> list:
    """Rounds every decoder linear layer's input per token through e4m3 (dynamic scales,
    as raypp's W8A8 ``_scaled_mm`` path quantizes activations); the hooks' handles
    (``.remove()`` undoes it)."""
    from raypp.model.quantization import fp8

    def hook(_module, args):
        x = args[0]
        q, scale = fp8.quantize_tokens(x.flatten(0, -2))
        return (fp8.from_fp8(q, scale, x.dtype).view_as(x),)

    return [m.register_forward_pre_hook(hook) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in name]


def corpus_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Prompts of exactly the given token lengths, cut from the shipped corpus."""
    from raypp.testing.tiny_model import CORPUS

    ids = tokenizer.encode(CORPUS.read_text()[:20000])
    out, start = [], 0
    for n in lengths:
        out.append(ids[start:start + n])
        start += n + 7
    return out
