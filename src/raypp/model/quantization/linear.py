"""FP8 linear layers on a GPU that computes in FP8 (compute capability 8.9 or newer):
what such a layer holds and how it multiplies.

A layer built with an :class:`Fp8Format` holds ``weight`` in e4m3 ``[out, in]`` and
``weight_scale`` in fp32 ``[out, G]`` (:mod:`raypp.model.quantization.fp8`'s row-group
scales), both loaded by the layer's own ``weight_loader`` from the views of
:mod:`raypp.model.quantization.checkpoint`. Nowhere else: on CPU, and on GPUs without FP8,
layers hold 16/32-bit weights dequantized once at load (:func:`weight_format` is
``None`` there), so no code here runs on CPU.

:func:`fp8_linear` picks the GEMM per call, from shapes only (graph-stable):

- one scale per row, bfloat16 activations, more than :data:`SCALED_MM_MIN_ROWS` rows, on
  Hopper or newer: ``torch._scaled_mm`` with row-wise scales — activations quantized per
  token (dynamic, whatever scheme the checkpoint names: a per-token scale is at least as
  fine as a static per-tensor one), FP8 tensor cores;
- otherwise (decode batches, block scales, fp16/fp32 models): the Triton GEMM of
  :mod:`raypp.kernels.fp8_linear`, which reads e4m3 weights, scales them per row group
  and multiplies in the activations' dtype (weight-only FP8: half the weight bytes, no
  activation rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raypp.model.quantization import fp8
from raypp.model.quantization.config import QuantConfig

SCALED_MM_MIN_ROWS = 64  # below: the Triton GEMM (decode is bound by the weight bytes)
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: e4m3 conversions and FP8 tensor cores
ROWWISE_MIN_CAPABILITY = (9, 0)  # torch._scaled_mm with row-wise scales


@dataclass(frozen=True)
class Fp8Format:
    """The FP8 layout of a layer's weight: ``group`` input columns per scale (``None``:
    one scale per output row); ``rowwise_mm``: the device runs ``torch._scaled_mm`` with
    row-wise scales (decided once, at build, so the forward reads no device state)."""

    group: int | None = None
    rowwise_mm: bool = False

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group is None else -(-in_features // self.group)


def weight_format(quant: QuantConfig | None, device: torch.device) -> Fp8Format | None:
    """What FP8 layers hold on ``device``: an :class:`Fp8Format` on a CUDA device of
    compute capability 8.9 or newer, else ``None`` (16/32-bit weights, dequantized at load)."""
    device = torch.device(device)
    if quant is None or device.type != "cuda":
        return None
    if torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        return None
    return Fp8Format(group=quant.group, rowwise_mm=rowwise_scaled_mm_supported(device))


def fp8_weight_params(out_features: int, in_features: int, fmt: Fp8Format,
                      loader: object, lead: tuple[int, ...] = ()
                      ) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """``(weight [*lead, out, in] e4m3, weight_scale [*lead, out, G] fp32)``, both loaded
    by ``loader`` (the layer's weight loader; the scale narrows like its weight)."""
    weight = torch.nn.Parameter(torch.empty(*lead, out_features, in_features,
                                            dtype=fp8.FP8_DTYPE), requires_grad=False)
    scale = torch.nn.Parameter(torch.ones(*lead, out_features, fmt.num_groups(in_features),
                                          dtype=torch.float32), requires_grad=False)
    for p in (weight, scale):
        p.weight_loader = loader
    weight.fp8_group = scale.fp8_group = fmt.group
    return weight, scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, fmt: Fp8Format) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` in ``x``'s dtype."""
    # x: [tokens, K]; weight: [N, K] e4m3; scale: [N, G] fp32
    n, k = weight.shape
    if (fmt.rowwise_mm and fmt.group is None and x.dtype == torch.bfloat16
            and x.shape[0] > SCALED_MM_MIN_ROWS and k % 16 == 0 and n % 16 == 0):
        return scaled_mm_rowwise(x, weight, scale, bias)
    from raypp.kernels.fp8_linear import fp8_gemm_op

    return fp8_gemm_op(x, weight, scale, bias, fmt.group or 0)


def rowwise_scaled_mm_supported(device: torch.device) -> bool:
    """``torch._scaled_mm`` with row-wise scales: Hopper or newer."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= ROWWISE_MIN_CAPABILITY)


def scaled_mm_rowwise(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 on FP8 tensor cores: ``x`` quantized per token, ``weight`` per row, the
    product scaled by both in the epilogue (bfloat16 out)."""
    # x: [M, K] bf16; weight: [N, K] e4m3 (row-major, so weight.T is column-major)
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    x_scale = (amax / fp8.FP8_MAX).clamp(min=1e-12)
    xq = (x.float() / x_scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1),
                            bias=bias, out_dtype=torch.bfloat16)
