"""Which FP8 weight format a checkpoint holds, read once from its config.

:func:`resolve_quant_config` maps a checkpoint's ``quantization_config`` (and the
``quantization`` engine option) onto a :class:`QuantConfig`:

- ``quant_method: "fp8"`` with ``weight_block_size`` — block FP8 (DeepSeek-V3, the Qwen3
  ``*-FP8`` checkpoints): ``weight`` in e4m3, ``weight_scale_inv`` one factor per block;
  without ``weight_block_size`` — per-tensor FP8 with ``weight_scale`` (and ``input_scale``
  when ``activation_scheme`` is static);
- ``quant_method: "compressed-tensors"`` — read by the ``compressed-tensors`` package
  (:mod:`raypp.model.quantization.compressed`): FP8 weights per tensor, per channel or
  per block, static or dynamic activations;
- no ``quantization_config`` and ``quantization="fp8"`` — a 16/32-bit checkpoint quantized
  while it loads, one scale per output channel (``"online"``).

Anything else is :class:`UnsupportedQuantizationError` naming the format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANTIZATION_OPTIONS = ("fp8",)  # values of the engine option ``quantization``
WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATION_SCHEMES = ("dynamic", "static", "none")


class UnsupportedQuantizationError(ValueError):
    """A checkpoint (or option) asks for a quantization format raypp does not read."""


@dataclass(frozen=True)
class QuantConfig:
    """An FP8 weight format.

    ``method``: ``"fp8"`` (the ``fp8`` quant_method), ``"compressed-tensors"`` or
    ``"online"`` (quantized at load); ``weights``: the granularity of the weight scales
    (``"tensor"``, ``"channel"``, ``"block"`` with ``block = (rows, cols)``);
    ``activations``: how the checkpoint meant its inputs quantized (``"dynamic"`` per
    token, ``"static"`` with an ``input_scale``, ``"none"`` weight-only);
    ``scale_name``: the suffix of each weight's scale tensor (``weight_scale_inv`` or
    ``weight_scale``); ``kv_scales``: the checkpoint stores ``k_scale``/``v_scale`` per layer.
    """

    method: str
    weights: str
    activations: str = "dynamic"
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    kv_scales: bool = False
    ignore: tuple[str, ...] = ()  # modules the checkpoint left unquantized (informational)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_STRATEGIES:
            raise UnsupportedQuantizationError(
                f"FP8 weight scales per {self.weights!r} are not supported "
                f"(supported: {', '.join(WEIGHT_STRATEGIES)})")
        if (self.weights == "block") != (self.block is not None):
            raise ValueError("a block size comes with block scales, and only with them")
        if self.activations not in ACTIVATION_SCHEMES:
            raise UnsupportedQuantizationError(
                f"activation scheme {self.activations!r} is not supported "
                f"(supported: {', '.join(ACTIVATION_SCHEMES)})")

    @property
    def online(self) -> bool:
        """The checkpoint is 16/32-bit: every linear weight is quantized as it loads."""
        return self.method == "online"

    @property
    def group(self) -> int | None:
        """Input columns per weight scale (``None``: a whole row shares one)."""
        return self.block[1] if self.block is not None else None

    def describe(self) -> str:
        """One line for the start-up log, e.g. ``fp8 block 128x128 (weight_scale_inv)``."""
        what = f"block {self.block[0]}x{self.block[1]}" if self.block else f"per-{self.weights}"
        source = "quantized at load" if self.online else f"{self.method} checkpoint"
        return f"fp8 e4m3 weights {what} ({source}), activations {self.activations}"


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
        from raypp.model.quantization.compressed import read_compressed_tensors

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
