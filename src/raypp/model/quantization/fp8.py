"""FP8 (e4m3) arithmetic in plain PyTorch: the one place that says how a value becomes
FP8 and back, for weights, activations and the KV cache.

Every rule is symmetric and scale-based: ``q = clamp(x / s, ±448)`` rounded to
``float8_e4m3fn``, ``x ≈ q · s``. Weights carry a scale per *row group*: a ``[rows, G]``
tensor whose column ``g`` scales the input columns ``[g·B, (g+1)·B)`` of each row (``G = 1``:
one scale per row, i.e. per output channel). Every checkpoint layout maps onto it
(:func:`expand_scale`): per-tensor (one scale), per-channel (``[rows, 1]``) and block
(``[ceil(rows/Bn), ceil(cols/Bk)]``, DeepSeek's ``weight_scale_inv``), so a tensor-parallel
slice of rows or of block-aligned columns takes its scales by the same narrowing as its
weight.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_TINY = 1e-12  # an all-zero row or block gets this scale, not 0 (no division by zero)


def to_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` saturated to ±448 and rounded to e4m3 (computed in fp32)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def from_fp8(q: torch.Tensor, scale: torch.Tensor | float,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q · scale`` in fp32, then rounded once to ``dtype``."""
    return (q.float() * scale).to(dtype)


def round_through_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x`` as it comes back from an FP8 store with ``scale``, in ``x``'s dtype."""
    return from_fp8(to_fp8(x, scale), scale, x.dtype)


def group_scales(w: torch.Tensor, group: int | None) -> torch.Tensor:
    """The scales that map each row group of ``w`` (``[..., rows, cols]``) onto ±448:
    ``amax / 448`` per row and per ``group`` columns (``None``: the whole row), shape
    ``[..., rows, G]`` in fp32."""
    cols = w.shape[-1]
    group = group or cols
    pad = -cols % group
    a = w.float().abs()
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
    amax = a.unflatten(-1, (-1, group)).amax(dim=-1)
    return (amax / FP8_MAX).clamp(min=_TINY)


def expand_scale(scale: torch.Tensor, group: int | None, cols: int) -> torch.Tensor:
    """``[..., rows, G]`` row-group scales → one scale per element ``[..., rows, cols]``."""
    if group is None or scale.shape[-1] == 1:
        return scale.expand(*scale.shape[:-1], cols)
    return scale.repeat_interleave(group, dim=-1)[..., :cols]


def quantize_rows(w: torch.Tensor, group: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``w`` quantized with one scale per row and per ``group`` columns
    (``None``: per row), the :func:`group_scales` rule."""
    scale = group_scales(w, group)
    return to_fp8(w, expand_scale(scale, group, w.shape[-1])), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, group: int | None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`quantize_rows`: ``q · scale`` per element, in ``dtype``."""
    return from_fp8(q, expand_scale(scale, group, q.shape[-1]), dtype)


# -- checkpoint layouts -----------------------------------------------------------------


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 as DeepSeek-V3 and the ``*-FP8`` Qwen checkpoints store it: one scale per
    ``block[0] × block[1]`` tile of ``w [rows, cols]``, ``scale_inv [ceil(rows/b0),
    ceil(cols/b1)]`` (the factor that dequantizes: ``w ≈ q · scale_inv``)."""
    rows, cols = w.shape
    b0, b1 = block
    padded = torch.nn.functional.pad(w.float().abs(), (0, -cols % b1, 0, -rows % b0))
    tiles = padded.unflatten(0, (-1, b0)).unflatten(2, (-1, b1))  # [R, b0, C, b1]
    scale = (tiles.amax(dim=(1, 3)) / FP8_MAX).clamp(min=_TINY)
    return to_fp8(w, block_scale_rows(scale, block, rows, cols)), scale


def block_scale_rows(scale: torch.Tensor, block: tuple[int, int], rows: int,
                     cols: int) -> torch.Tensor:
    """A block grid ``[ceil(rows/b0), ceil(cols/b1)]`` as one scale per element."""
    b0, b1 = block
    return scale.repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8: one scale for all of ``w`` (shape ``[1]``)."""
    scale = (w.float().abs().amax() / FP8_MAX).clamp(min=_TINY).reshape(1)
    return to_fp8(w, scale), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: ``(q [tokens, K], scale [tokens, 1])``."""
    return quantize_rows(x, None)
