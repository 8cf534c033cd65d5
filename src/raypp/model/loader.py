"""Load only this stage's (and this TP shard's) weights from safetensors files.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``)
checkpoints are supported. Files are memory-mapped and only the tensors this
stage owns are read; each parameter's ``weight_loader`` takes its TP slice.
A ``.gguf`` path goes to :func:`raypp.model.gguf.load_gguf_weights`.

FP8 (``quant``, :mod:`raypp.model.quantization`): a weight and its scale load together,
through a view that narrows both (:mod:`raypp.model.quantization.checkpoint`): an e4m3
parameter takes the FP8 values and its ``<name>_scale`` the scales; a 16/32-bit one the
dequantized values; with ``quantization="fp8"`` of a 16/32-bit checkpoint every
``quantizable`` (linear) weight is quantized as it loads. Per-layer KV-cache scales
(``self_attn.k_scale``/``v_scale``) fill the attention's ``k_scale``/``v_scale`` buffers.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from raypp.model.base import LoadReport, StageModel
from raypp.model.quantization.checkpoint import (
    Fp8Source,
    OnlineSource,
    is_companion,
    kv_scale_name,
    scale_names,
)
from raypp.model.quantization.config import QuantConfig
from raypp.model.quantization.fp8 import FP8_DTYPE

_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                       "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                       "F64": torch.float64}

if TYPE_CHECKING:
    from raypp.model.gguf_cache import GGUFMetadata


def checkpoint_files(model_dir: str) -> dict[str, list[str]]:
    """File → tensor names in it, for every safetensors file of the checkpoint."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(str(root / file), []).append(name)
        return files
    single = root / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {str(single): list(f.keys())}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir!r}")


class LazySlice:
    """A checkpoint tensor not yet read: ``narrow`` (or ``read``) reads only the part asked.

    Counts the bytes it reads, so callers can prove a TP shard read only its slice.
    """

    def __init__(self, handle: Any):
        self._handle = handle
        self.shape = tuple(handle.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(handle.get_dtype())
        self.bytes_read = 0

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self.read(tuple(index))

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        """The region ``index`` (one slice per dimension; a 0-d tensor: ``()``)."""
        tensor = self._handle[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


class _OpenFiles:
    """The checkpoint's files, each opened once on first use, all closed at exit."""

    def __init__(self, stack: contextlib.ExitStack):
        self._stack, self._open = stack, {}

    def tensor(self, file: str, name: str) -> LazySlice:
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
        return LazySlice(self._open[file].get_slice(name))


def load_stage_weights(model: StageModel, model_dir: str,
                       gguf_meta: GGUFMetadata | None = None, *,
                       quant: QuantConfig | None = None) -> LoadReport:
    """Fill ``model``'s parameters, reading only this stage's tensors and, of
    each, only this TP rank's slice. ``model_dir``: a Hugging Face directory, or a
    ``.gguf`` file (:class:`raypp.model_config.ModelConfig` resolves a GGUF directory to
    it, and derives ``gguf_meta``, which is read from the file when not given).
    ``quant``: the checkpoint's FP8 format, or FP8 of a 16/32-bit checkpoint.

    Raises ``ValueError`` naming any parameter of the stage that the checkpoint
    does not provide, and any FP8 weight whose scale is missing or misshapen.
    """
    if model_dir.endswith(".gguf"):
        if quant is not None:
            raise ValueError("FP8 quantization applies to safetensors checkpoints, not GGUF")
        from raypp.model.gguf import load_gguf_weights, metadata

        return load_gguf_weights(model, gguf_meta or metadata(model_dir, None))
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    files = checkpoint_files(model_dir)
    file_of = {name: file for file, names in files.items() for name in names}
    scales = scale_names(set(file_of), quant) if quant is not None else {}
    loaded: set[str] = set()
    report = LoadReport()
    with contextlib.ExitStack() as stack:
        opened = _OpenFiles(stack)
        for names in files.values():
            for name in names:
                if is_companion(name, quant):
                    continue  # read with its weight
                handles = _load_one(model, name, file_of, scales, opened, params, buffers,
                                    quant, loaded)
                if handles:
                    report.names.append(name)
                    report.bytes_read += sum(h.bytes_read for h in handles)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks weights for: {', '.join(missing[:8])}")
    return report


def _load_one(model: StageModel, name: str, file_of: dict[str, str], scales: dict[str, str],
              opened: _OpenFiles, params: dict[str, Any], buffers: dict[str, torch.Tensor],
              quant: QuantConfig | None, loaded: set[str]) -> list[LazySlice]:
    """Load checkpoint tensor ``name`` (with its scale) into this stage's parameters;
    the handles it read (none: not this stage's)."""
    kv = kv_scale_name(name)
    if kv is not None:
        return _load_kv_scale(model, name, *kv, opened.tensor(file_of[name], name), buffers)
    targets = model.checkpoint_names(name)
    if not targets:
        return []
    lazy = opened.tensor(file_of[name], name)
    handles = [lazy]
    source: Any = None
    if name in scales:
        scale = opened.tensor(file_of[scales[name]], scales[name])
        handles.append(scale)
        source = Fp8Source(name, lazy, scales[name], scale, quant, lazy.dtype)
        _check_input_scale(name, file_of, opened)
    elif lazy.dtype == FP8_DTYPE:
        expected = name.rsplit(".", 1)[0] + "." + (quant.scale_name if quant else "weight_scale")
        raise ValueError(f"{name} is float8_e4m3fn but the checkpoint has no {expected}"
                         + ("" if quant else " (and its config.json no quantization_config)"))
    for target, shard in targets:
        param = params[target]
        scale_param = params.get(target + "_scale")
        src = source
        if src is None and _quantize_here(param, quant):
            src = OnlineSource(name, lazy)
        with torch.no_grad():
            if src is None:
                param.weight_loader(param, lazy, shard)
            elif param.dtype == FP8_DTYPE:  # an FP8 layer (GPU): values and scales
                param.weight_loader(param, src.fp8(param.fp8_group), shard)
                scale_param.weight_loader(scale_param, src.scales(param.fp8_group), shard)
                loaded.add(target + "_scale")
            else:  # a 16/32-bit layer: dequantized once, here
                param.weight_loader(param, src.dequantized(), shard)
        loaded.add(target)
    return handles


def _quantize_here(param: torch.Tensor, quant: QuantConfig | None) -> bool:
    """A 16/32-bit checkpoint tensor goes through FP8: into an FP8 parameter, or into a
    linear weight of a checkpoint quantized as it loads (``quantization="fp8"``)."""
    if param.dtype == FP8_DTYPE:
        return True
    return quant is not None and quant.online and getattr(param, "quantizable", False)


def _check_input_scale(weight: str, file_of: dict[str, str], opened: _OpenFiles) -> None:
    """A static activation scale must be one number (the FP8 GEMMs quantize activations
    per token, so its value is not used)."""
    name = weight.rsplit(".", 1)[0] + ".input_scale"
    if name in file_of:
        shape = opened.tensor(file_of[name], name).shape
        if int(torch.Size(shape).numel()) != 1:
            raise ValueError(f"{name} has shape {list(shape)}; a static activation scale is "
                             "one number per tensor")


def _load_kv_scale(model: StageModel, name: str, prefix: str, which: str, lazy: LazySlice,
                   buffers: dict[str, torch.Tensor]) -> list[LazySlice]:
    """A layer's KV-cache scale into its attention's ``k_scale`` or ``v_scale`` buffer."""
    layer = int(prefix.split(".")[2])
    if not model.stage.start <= layer < model.stage.end:
        return []
    target = f"{prefix}.attn.{which}"
    if target not in buffers:
        raise ValueError(f"{name}: layer {layer} has no KV-cache scale buffer {target}")
    if int(torch.Size(lazy.shape).numel()) != 1:
        raise ValueError(f"{name} has shape {list(lazy.shape)}; raypp reads one KV-cache "
                         "scale per layer")
    value = lazy.read(tuple(slice(0, s) for s in lazy.shape)).float().reshape(())
    if not (torch.isfinite(value) and value > 0):
        raise ValueError(f"{name} is {value.item()}, not a positive scale")
    buffers[target].copy_(value)
    return [lazy]
