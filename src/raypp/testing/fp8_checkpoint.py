"""FP8 copies of tiny checkpoints, quantized by each format's own rule (for tests and the
GPU benchmarks), and their dequantized twins (the reference transformers runs).

:func:`quantize_checkpoint` reads a 16/32-bit Hugging Face directory and writes one in
a format raypp loads, quantizing every linear weight of the decoder layers (attention
and MLP projections, each expert's; never embeddings, norms, routers or the LM head):

- ``"block"``: ``quant_method: "fp8"`` with ``weight_block_size``, ``weight_scale_inv``
  per block (DeepSeek-V3 / Qwen3-FP8);
- ``"ct-channel"``: compressed-tensors ``FP8_DYNAMIC`` (per-channel ``weight_scale``,
  dynamic per-token activations);
- ``"ct-tensor"``: compressed-tensors ``FP8`` (per-tensor ``weight_scale``, static
  ``input_scale``);
- ``"ct-block"``: compressed-tensors ``FP8_BLOCK`` (128×128 by default, ``weight_scale``).

compressed-tensors configs are written by the ``compressed-tensors`` package from its
presets. ``kv_scales`` adds per-layer ``self_attn.k_scale``/``v_scale`` tensors.
:func:`dequantize_checkpoint` writes ``q · scale`` in fp32 with no ``quantization_config``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from raypp.model.quantization import fp8

FORMATS = ("block", "ct-channel", "ct-tensor", "ct-block")
_LINEAR = re.compile(r"^model\.layers\.\d+\..*(?:_proj|\.w[123])\.weight$")
_PRESETS = {"ct-channel": "FP8_DYNAMIC", "ct-tensor": "FP8", "ct-block": "FP8_BLOCK"}


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _copy_side_files(src: Path, dst: Path) -> dict[str, Any]:
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix not in (".safetensors",) and file.name not in (
                "model.safetensors.index.json", "config.json"):
            shutil.copy(file, dst / file.name)
    return json.loads((src / "config.json").read_text())


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str,
                        block: tuple[int, int] = (16, 16),
                        kv_scales: dict[int, tuple[float, float]] | None = None,
                        max_shard_bytes: int | None = None) -> Path:
    """Write ``src`` quantized in ``fmt`` (:data:`FORMATS`) to ``dst``; ``block`` is the
    scale tile of the block formats; ``kv_scales``: layer → ``(k_scale, v_scale)``;
    ``max_shard_bytes`` splits the weights over several files (an index names them), so a
    weight and its scale may lie in different files."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    src, dst = Path(src), Path(dst)
    config = _copy_side_files(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, w in _tensors(src).items():
        if not _LINEAR.match(name) or w.dim() != 2:
            out[name] = w
            continue
        base = name[: -len(".weight")]
        if fmt in ("block", "ct-block"):
            q, scale = fp8.quantize_blocks(w, block)
        elif fmt == "ct-channel":
            q, scale = fp8.quantize_rows(w, None)  # [rows, 1]
        else:
            q, scale = fp8.quantize_tensor(w)
            out[f"{base}.input_scale"] = torch.tensor([0.05])
        out[name] = q
        out[f"{base}.{'weight_scale_inv' if fmt == 'block' else 'weight_scale'}"] = scale
    for layer, (k, v) in (kv_scales or {}).items():
        out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    config["quantization_config"] = _quant_config(fmt, block, bool(kv_scales))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    _save(out, dst, max_shard_bytes)
    return dst


def _quant_config(fmt: str, block: tuple[int, int], kv_scales: bool) -> dict[str, Any]:
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    scheme = preset_name_to_scheme(_PRESETS[fmt], ["Linear"])
    if fmt == "ct-block":
        weights = scheme.weights.model_copy(update={"block_structure": list(block)})
        scheme = QuantizationScheme(targets=["Linear"], weights=weights,
                                    input_activations=scheme.input_activations)
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor") if kv_scales else None
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized",
                                ignore=["lm_head"], kv_cache_scheme=kv,
                                quantization_status="compressed")
    return {**config.model_dump(mode="json", exclude_none=False),
            "quant_method": "compressed-tensors"}


def _save(tensors: dict[str, torch.Tensor], dst: Path, max_shard_bytes: int | None) -> None:
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):  # a weight's scale sorts after it: often the next shard
        t = tensors[name]
        if shards[-1] and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * t.element_size()
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def dequantize_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """``src`` (written by :func:`quantize_checkpoint`) with every FP8 weight replaced by
    ``q · scale`` in fp32, scales dropped, no ``quantization_config``: what transformers
    runs as the reference."""
    src, dst = Path(src), Path(dst)
    config = _copy_side_files(src, dst)
    qc = config.pop("quantization_config")
    block = qc.get("weight_block_size") or (
        qc["config_groups"]["group_0"]["weights"].get("block_structure"))
    tensors = _tensors(src)
    out = {}
    for name, t in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if t.dtype != fp8.FP8_DTYPE:
            out[name] = t
            continue
        base = name[: -len(".weight")]
        scale = tensors.get(f"{base}.weight_scale_inv", tensors.get(f"{base}.weight_scale"))
        if scale.dim() == 2 and scale.shape[1] != 1:  # a block grid
            scale = fp8.block_scale_rows(scale, tuple(block), *t.shape)
        out[name] = fp8.from_fp8(t, scale)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    _save(out, dst, None)
    return dst
