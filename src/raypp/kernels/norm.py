"""RMSNorm of a decode batch's rows in one Triton launch (with the residual add)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, n,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # the sum is rounded to the model dtype, as the residual stream is
        x = x + tl.load(res_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n + offs, x, mask=mask)
        x = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    y = w * (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * norm(s), s)`` with ``s = x + residual`` (``x`` when no residual);
    rows of ``x`` contiguous. Matches :class:`raypp.model.layers.RMSNorm`."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out, eps, n,
        BLOCK=triton.next_power_of_2(n), HAS_RES=residual is not None, PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    return out, res_out
