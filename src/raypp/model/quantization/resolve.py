"""Which FP8 weight format to load, read once from a checkpoint's config and the
``quantization`` engine option (:func:`resolve_quant_config`):

- ``quant_method: "fp8"`` with ``weight_block_size``: block FP8, ``weight_scale_inv`` per
  block; without it: per-tensor FP8 with ``weight_scale`` (and ``input_scale`` when
  ``activation_scheme`` is static);
- ``quant_method: "compressed-tensors"``: :mod:`raypp.model.quantization.compressed`;
- no ``quantization_config`` and ``quantization="fp8"``: quantized as it loads, one scale
  per output channel (``"online"``).

Anything else is :class:`UnsupportedQuantizationError` naming the format.
"""

from __future__ import annotations

from typing import Any

from raypp.model.quantization.compressed import read_compressed_tensors
from raypp.model.quantization.config import QuantConfig, UnsupportedQuantizationError

QUANTIZATION_OPTIONS = ("fp8",)  # values of the engine option ``quantization``


def resolve_quant_config(hf_config: dict[str, Any], quantization: str | None
                         ) -> QuantConfig | None:
    """The weight format to load: the checkpoint's own, or ``quantization="fp8"`` of a
    16/32-bit checkpoint; ``None`` for a plain checkpoint without the option.

    Raises :class:`UnsupportedQuantizationError` naming the format for any other
    ``quant_method`` or option value.
    """
    if quantization is not None and quantization not in QUANTIZATION_OPTIONS:
        raise UnsupportedQuantizationError(
            f"quantization={quantization!r} is not supported; raypp quantizes to "
            f"{', '.join(map(repr, QUANTIZATION_OPTIONS))} (or reads a checkpoint's own FP8 "
            "format when the option is left unset)")
    qc = hf_config.get("quantization_config")
    if qc is None:
        if quantization is None:
            return None
        return QuantConfig(method="online", weights="channel", activations="dynamic")
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8_method(qc)
    if method == "compressed-tensors":
        return read_compressed_tensors(qc)
    raise UnsupportedQuantizationError(
        f"the checkpoint's quantization format {method or qc!r} (quantization_config."
        "quant_method) is not supported; raypp reads 'fp8' (block or per-tensor e4m3) and "
        "'compressed-tensors' FP8 checkpoints, and quantizes 16/32-bit checkpoints with "
        "quantization='fp8'")


def _fp8_method(qc: dict[str, Any]) -> QuantConfig:
    """``quant_method: "fp8"``: block FP8 (``weight_block_size``) or per-tensor FP8."""
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise UnsupportedQuantizationError(f"fp8 checkpoint with fmt={fmt!r}: only e4m3 is "
                                           "supported")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise UnsupportedQuantizationError(f"fp8 checkpoint with activation_scheme={scheme!r}")
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is None:
        return QuantConfig(method="fp8", weights="tensor", activations=scheme,
                           scale_name="weight_scale", ignore=ignore)
    if scheme != "dynamic":
        raise UnsupportedQuantizationError("block fp8 with static activations is not supported")
    if len(block) != 2 or min(int(b) for b in block) < 1:
        raise ValueError(f"weight_block_size must be two positive sizes, got {block!r}")
    return QuantConfig(method="fp8", weights="block", activations="dynamic",
                       block=(int(block[0]), int(block[1])), scale_name="weight_scale_inv",
                       ignore=ignore)
