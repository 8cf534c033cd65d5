"""A Triton GEMV for decode at tiny batch: ``y = x @ w.T`` for ``x`` of 1–8 rows.

Each program owns ``BLOCK_N`` output columns (rows of ``w``), streams them over
``K`` once for all of ``x``'s rows and keeps fp32 sums. It exists to be measured
against cuBLAS (``raypp.bench.gpu_decode``'s GEMV probe) on the decode
projections, where a step's small matrices run well under the copy bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask, m_mask = rn < N, rm < M
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 8, block_k: int = 512,
         num_warps: int = 4) -> torch.Tensor:
    """``x @ w.T`` for ``x`` ``[M <= 8, K]`` and ``w`` ``[N, K]``, both contiguous."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= 8 and w.shape[1] == k and x.is_contiguous() and w.is_contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps)
    return y
