"""An FP8 weight format (:class:`QuantConfig`), what every part of loading and the FP8
layers read; :mod:`raypp.model.quantization.resolve` makes one from a checkpoint's config:

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
