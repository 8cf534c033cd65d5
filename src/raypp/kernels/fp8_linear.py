"""A GEMM that reads FP8 (e4m3) weights: ``x @ (q · scale).T (+ bias)`` with the weight
scaled per row and per group of input columns, multiplied in ``x``'s dtype (weight-only
FP8: the weight bytes halve, the activations are not rounded).

``scale`` is ``[N, G]`` fp32: column ``g`` scales the input columns ``[g·GROUP,
(g+1)·GROUP)`` of every row (``GROUP`` 0: one scale per row, ``G = 1``), the layout of
:mod:`raypp.model.quantization.fp8`. Each program owns a ``BLOCK_M × BLOCK_N`` tile of the
output and walks K one group at a time: a group's partial product is scaled by that
group's scales and added to the fp32 accumulator. Small decode batches are bound by the
weight bytes, so the tile is narrow in N there, enough programs to fill the GPU.

:func:`fp8_gemm_op` is the same as the custom op ``torch.ops.raypp.fp8_gemm``, which
``torch.compile`` treats as one opaque call (CUDA graphs capture it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raypp.kernels.tuning import sm_count


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, G, span, stride_xm, stride_wn,
                     stride_sn, stride_om, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     IEEE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g in range(0, G):
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kk in range(0, span, BLOCK_K):
            k = g * span + kk + rk
            k_mask = (k < K) & (kk + rk < span)
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            w = w.to(dtype)  # every e4m3 value is exact in fp16, bf16 and fp32
            if IEEE:  # noqa: SIM108 - constexpr branch; fp32 models get fp32, not tf32
                part += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                part += tl.dot(x, tl.trans(w))
        s = tl.load(s_ptr + rn.to(tl.int64) * stride_sn + g, mask=n_mask, other=0.0)
        acc += part * s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _tiles(m: int, n: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)``: the widest N tile that still gives two waves of
    programs (a small batch reads each weight once; it needs every SM streaming)."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    waves = 2 * sm_count(device) if device.type == "cuda" else 1
    tiles_m = -(-m // block_m)
    block_n = 16
    for candidate in (128, 64, 32):
        if tiles_m * -(-n // candidate) >= waves:
            block_n = candidate
            break
    return block_m, block_n, 128


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None, group: int,
             tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x [M, K] @ (weight [N, K] e4m3 · scale [N, G]).T + bias`` in ``x``'s dtype;
    ``group`` input columns per scale (0: per row). ``tiles`` overrides the tile sizes
    (``BLOCK_K`` must divide ``group``)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.is_contiguous()
    g = 1 if group == 0 else -(-k // group)
    assert scale.shape == (n, g), (scale.shape, n, g)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k = tiles or _tiles(m, n, x.device)
    if group:
        block_k = min(block_k, group)
        assert group % block_k == 0, (group, block_k)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k, g, group or k,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, num_warps=4, num_stages=3)
    return out


@torch.library.custom_op("raypp::fp8_gemm", mutates_args=())
def fp8_gemm_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """:func:`fp8_gemm` as a custom op (opaque to ``torch.compile``)."""
    return fp8_gemm(x, weight, scale, bias, group)


@fp8_gemm_op.register_fake
def _(x, weight, scale, bias, group):
    return x.new_empty((x.shape[0], weight.shape[0]))
