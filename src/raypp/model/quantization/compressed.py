"""compressed-tensors checkpoints (llm-compressor's output), read with the
``compressed-tensors`` package, not by hand: its ``QuantizationConfig`` validates the
``quantization_config`` (presets such as ``FP8_DYNAMIC`` included) and this module maps
the FP8 schemes raypp serves onto a :class:`~raypp.model.quantization.config.QuantConfig`.

Served: ``format`` ``float-quantized`` (or ``naive-quantized``), every config group the
same FP8 weight scheme — 8-bit float, symmetric, scales per tensor, per channel or per
block — with dynamic (per-token or per-tensor) or static (per-tensor ``input_scale``)
FP8 activations, or none (weight-only). Any other scheme (integer, 4-bit, grouped,
packed or sparse formats, mixed groups) is an
:class:`~raypp.model.quantization.config.UnsupportedQuantizationError` naming it.
"""

from __future__ import annotations

from typing import Any

from raypp.model.quantization.config import QuantConfig, UnsupportedQuantizationError

_FORMATS = ("float-quantized", "naive-quantized")


def read_compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    """The :class:`QuantConfig` of a compressed-tensors ``quantization_config``."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as e:
        raise ImportError("reading a compressed-tensors checkpoint needs the "
                          "compressed-tensors package (pip install compressed-tensors)") from e
    if qc.get("sparsity_config"):
        raise UnsupportedQuantizationError("compressed-tensors sparsity (sparsity_config) is "
                                           "not supported")
    try:
        config = QuantizationConfig.model_validate(
            {k: v for k, v in qc.items() if k != "quant_method"})
    except Exception as e:  # noqa: BLE001 - the package's own validation error, re-worded
        raise UnsupportedQuantizationError(
            f"compressed-tensors quantization_config not readable: {e}") from None
    fmt = str(config.format)
    if fmt not in _FORMATS:
        raise UnsupportedQuantizationError(
            f"compressed-tensors format {fmt!r} is not supported (raypp reads FP8 "
            f"checkpoints: {', '.join(_FORMATS)})")
    schemes = {name: _scheme_key(name, s) for name, s in config.config_groups.items()}
    distinct = set(schemes.values())
    if len(distinct) != 1:
        raise UnsupportedQuantizationError(
            f"compressed-tensors config groups with different schemes ({schemes}) are not "
            "supported")
    weights, block, activations = distinct.pop()
    kv_scales = config.kv_cache_scheme is not None
    if kv_scales:
        kv = config.kv_cache_scheme
        if str(kv.type) != "float" or kv.num_bits != 8:
            raise UnsupportedQuantizationError(
                f"compressed-tensors kv_cache_scheme {kv.type} {kv.num_bits}-bit: only FP8 "
                "KV scales are supported")
    return QuantConfig(method="compressed-tensors", weights=weights, activations=activations,
                       block=block, scale_name="weight_scale", kv_scales=kv_scales,
                       ignore=tuple(config.ignore or ()))


def _scheme_key(name: str, scheme: Any) -> tuple[str, tuple[int, int] | None, str]:
    """``(weight strategy, block, activation scheme)`` of one config group, checked."""
    w = scheme.weights
    if w is None:
        raise UnsupportedQuantizationError(f"compressed-tensors group {name!r} quantizes no "
                                           "weights")
    what = f"compressed-tensors group {name!r}: weights {w.type} {w.num_bits}-bit {w.strategy}"
    if str(w.type) != "float" or w.num_bits != 8 or not w.symmetric:
        raise UnsupportedQuantizationError(f"{what} is not supported (FP8 e4m3 only)")
    strategy = str(w.strategy)
    if strategy not in ("tensor", "channel", "block"):
        raise UnsupportedQuantizationError(f"{what} is not supported (scales per tensor, "
                                           "channel or block)")
    block = tuple(int(b) for b in w.block_structure) if strategy == "block" else None
    if scheme.output_activations is not None:
        raise UnsupportedQuantizationError(f"{what} with output activations quantized is not "
                                           "supported")
    a = scheme.input_activations
    if a is None:
        return strategy, block, "none"
    if str(a.type) != "float" or a.num_bits != 8:
        raise UnsupportedQuantizationError(f"compressed-tensors group {name!r}: input "
                                           f"activations {a.type} {a.num_bits}-bit are not "
                                           "supported (FP8 only)")
    if a.dynamic:
        return strategy, block, "dynamic"
    if str(a.strategy) != "tensor":
        raise UnsupportedQuantizationError(f"compressed-tensors group {name!r}: static "
                                           f"activation scales per {a.strategy} are not "
                                           "supported (per tensor only)")
    return strategy, block, "static"
