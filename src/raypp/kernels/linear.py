"""Projections of a decode batch on Triton: a GEMV for one row, a tensor-core GEMM split
over K for 2..:data:`GEMM_MAX_ROWS` rows.

- :func:`gemv`: ``x @ w.T (+ bias)`` for one row of ``x``; each program owns a few rows
  of ``w`` and streams them over ``K``. ``gated`` computes ``silu(x @ gate.T) *
  (x @ up.T)`` from a fused gate/up weight (gate rows first).
- :func:`gemm`: the same for 2..64 rows on tensor cores, split over ``K`` where the
  weight has few rows (the last split to finish sums the partials in split order).

Both take plain tensors and a ``pdl`` flag (programmatic dependent launch, Hopper and
later: each kernel loads its first weights while the previous one drains); settings
come from :mod:`raypp.kernels.tuning` unless a ``config`` is given.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raypp.kernels.counters import split_counters
from raypp.kernels.tuning import GemmConfig, GemvConfig, gemm_config, gemv_config

GEMM_MAX_ROWS = 64


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < n
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    up_rows = rows + n.to(tl.int64) * K  # gated: the up rows follow all gate rows
    # the first tile of weights is loaded before waiting for the previous kernel
    mask = n_mask[:, None] & (rk[None, :] < K)
    w = tl.load(rows, mask=mask, other=0.0, eviction_policy="evict_first")
    if GATED:
        u = tl.load(up_rows, mask=mask, other=0.0, eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
        if GATED:
            acc_up += tl.sum(u.to(tl.float32) * x[None, :], 1)
        if k0 + BLOCK_K < K:
            mask = n_mask[:, None] & (k0 + BLOCK_K + rk[None, :] < K)
            w = tl.load(rows + k0 + BLOCK_K, mask=mask, other=0.0, eviction_policy="evict_first")
            if GATED:
                u = tl.load(up_rows + k0 + BLOCK_K, mask=mask, other=0.0,
                            eviction_policy="evict_first")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, _gated_epilogue(acc, acc_up, GATED, out_ptr.dtype.element_ty),
             mask=n_mask)


@triton.jit
def _gated_epilogue(acc, acc_up, GATED: tl.constexpr, dtype: tl.constexpr):
    """The output in ``dtype``: ``acc``, or (gated) ``silu(acc) * acc_up`` rounded where
    the unfused ``F.silu(gate) * up`` rounds."""
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * \
            acc_up.to(dtype).to(tl.float32)
    return acc.to(dtype)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gated: bool,
         pdl: bool, config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for ``x`` of one contiguous row ``[1, K]``; ``gated``:
    ``silu(x @ w[:n].T) * (x @ w[n:].T)`` with ``n = w.shape[0] // 2``. ``config``
    overrides :func:`raypp.kernels.tuning.gemv_config` (powers of two)."""
    assert x.shape[0] == 1 and x.is_contiguous() and w.is_contiguous()
    k = w.shape[1]
    n = w.shape[0] // 2 if gated else w.shape[0]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bn, bk, warps = config or gemv_config(x.device, n, k, gated, w.dtype)
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, w, bias if bias is not None else w, out, n, K=k, BLOCK_N=bn, BLOCK_K=bk,
        GATED=gated, HAS_BIAS=bias is not None, PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out


# -- GEMM for a decode batch ------------------------------------------------------------------


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counter_ptr, m, n, stride_x,
                 K: tl.constexpr, K_PER: tl.constexpr, STEPS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < m
    n_mask = rn < n
    k0 = split * K_PER
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w_at = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    up_at = w_at + n.to(tl.int64) * K  # gated: the up rows follow all gate rows
    x_at = x_ptr + rm[:, None] * stride_x + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PDL:  # x is the previous kernel's output
        tl.extra.cuda.gdc_wait()
    for i in tl.range(STEPS, num_stages=STAGES):  # STAGES tiles in flight (shared memory)
        kk = k0 + i * BLOCK_K
        k_mask = kk + rk[None, :] < K
        x = tl.load(x_at + kk, mask=m_mask[:, None] & k_mask, other=0.0)
        w = tl.load(w_at + kk, mask=n_mask[:, None] & k_mask, other=0.0,
                    eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if GATED:
            u = tl.load(up_at + kk, mask=n_mask[:, None] & k_mask, other=0.0,
                        eviction_policy="evict_first")
            acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision=PRECISION)
    out_at = rm[:, None] * n + rn[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        _gemm_store(out_ptr, b_ptr, acc, acc_up, out_at, o_mask, rn, n_mask, GATED, HAS_BIAS)
    else:
        # each split writes its fp32 partial; the last to arrive sums them in split order
        # (the same result every run) and resets the counter for the next launch
        mn = m * n
        tl.store(part_ptr + split * mn + out_at, acc, mask=o_mask)
        if GATED:
            tl.store(part_ptr + (SPLIT_K + split) * mn + out_at, acc_up, mask=o_mask)
        tl.debug_barrier()
        counter = counter_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tl.store(counter, 0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part_ptr + s * mn + out_at, mask=o_mask, other=0.0,
                               cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part_ptr + (SPLIT_K + s) * mn + out_at, mask=o_mask,
                                      other=0.0, cache_modifier=".cg")
            _gemm_store(out_ptr, b_ptr, acc, acc_up, out_at, o_mask, rn, n_mask, GATED,
                        HAS_BIAS)


@triton.jit
def _gemm_store(out_ptr, b_ptr, acc, acc_up, out_at, o_mask, rn, n_mask, GATED: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + out_at, _gated_epilogue(acc, acc_up, GATED, out_ptr.dtype.element_ty),
             mask=o_mask)


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gated: bool, pdl: bool,
         config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` (``gated``: ``silu(x @ w[:n].T) * (x @ w[n:].T)``, ``n =
    w.shape[0] // 2``) for up to :data:`GEMM_MAX_ROWS` rows of ``x`` (``stride(1) == 1``),
    on tensor cores (fp32: exact fp32 products); an output row depends only on its input
    row. ``config`` overrides :func:`raypp.kernels.tuning.gemm_config`."""
    m, k = x.shape
    assert m <= GEMM_MAX_ROWS and x.stride(1) == 1 and w.is_contiguous()
    n = w.shape[0] // 2 if gated else w.shape[0]
    bn, bk, split, warps, stages = config or gemm_config(x.device, m, n, k, gated, w.dtype)
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty((2 if gated else 1) * split * m * n, dtype=torch.float32,
                           device=x.device)
        counters = split_counters(x.device, triton.cdiv(n, bn))
    else:
        part = counters = out  # unused
    _gemm_kernel[(triton.cdiv(n, bn), split)](
        x, w, bias if bias is not None else w, out, part, counters, m, n, x.stride(0), K=k,
        K_PER=k_per, STEPS=k_per // bk, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, STAGES=stages, GATED=gated,
        HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gated: bool,
           pdl: bool) -> torch.Tensor:
    """:func:`gemv` for one row, :func:`gemm` for more."""
    if x.shape[0] == 1 and x.is_contiguous():
        return gemv(x, w, bias, gated, pdl)
    return gemm(x, w, bias, gated, pdl)
