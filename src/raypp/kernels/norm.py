"""RMSNorm in one Triton launch: of a decode batch's rows (with the residual add), and of
each q and k head inside a fused qkv projection (the per-head q/k norm of Qwen3)."""

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


@triton.jit
def _head_rms_norm_kernel(qkv_ptr, q_w_ptr, k_w_ptr, eps, stride_row, NUM_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads first, then k heads: they are contiguous in the row
    offs = tl.arange(0, DIM_PAD)
    mask = offs < HEAD_DIM
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w_q = tl.load(q_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w_k = tl.load(k_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.where(head < NUM_HEADS, w_q, w_k)
    if PDL:
        tl.extra.cuda.gdc_wait()
    at = qkv_ptr + row * stride_row + head * HEAD_DIM + offs
    x = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
    dtype = qkv_ptr.dtype.element_ty
    tl.store(at, (w * (x * r).to(dtype).to(tl.float32)).to(dtype), mask=mask)


def head_rms_norm_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                   num_heads: int, num_kv_heads: int, pdl: bool) -> torch.Tensor:
    """Normalize, in place, every q head (with ``q_weight``) and k head (with ``k_weight``)
    of the rows of a fused projection ``qkv`` ``[rows, (heads + 2 kv_heads) * head_dim]``
    (``stride(1) == 1``); v is left as it is. Each head is rounded as
    :class:`raypp.model.layers.RMSNorm` over ``head_dim`` rounds. Returns ``qkv``."""
    rows = qkv.shape[0]
    head_dim = q_weight.shape[0]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    if rows:
        _head_rms_norm_kernel[(rows, num_heads + num_kv_heads)](
            qkv, q_weight, k_weight, eps, qkv.stride(0), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            DIM_PAD=triton.next_power_of_2(head_dim), PDL=pdl, num_warps=1, launch_pdl=pdl)
    return qkv
