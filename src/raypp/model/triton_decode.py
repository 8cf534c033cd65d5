"""Triton kernels of the small-batch decode chain (:mod:`raypp.model.fused_decode`).

- :func:`rms_norm`: ``x (+ residual)`` RMS-normalized in one program per row; the sum
  is written as the new residual.
- :func:`gemv`: ``x @ w.T (+ bias)`` for one row of ``x``; each program owns a few rows
  of ``w`` and streams them over ``K``. ``gated`` computes ``silu(x @ gate.T) *
  (x @ up.T)`` from a fused gate/up weight (gate rows first).
- :func:`gemm`: the same for 2..64 rows on tensor cores, split over ``K`` where the
  weight has few rows (the last split to finish sums the partials in split order).
- :func:`rope_decode_attention`: one decode step of a layer from the raw qkv
  projection: rotary on q and k, k/v stored in the paged cache, attention of q over
  the cached context plus this step's k/v (taken from registers, so no program reads
  a slot another one is writing), split over the context like
  :func:`raypp.model.triton_attention.paged_decode`; the last split of each (sequence,
  kv head) to finish combines the splits (an arrival counter, no second launch). It is
  also the custom op ``torch.ops.raypp.rope_decode_attention`` that every decode-only
  CUDA step of :class:`raypp.model.llama.Attention` calls (``torch.compile`` treats it
  as one opaque call).

On Hopper and later (compute capability 9+) every kernel here is launched with
programmatic dependent launch (PDL): it lets the next kernel in the stream start
early (``gdc_launch_dependents``), may load what no earlier kernel of the step
writes (weights, rotary tables, graph inputs), and waits for its predecessor
(``gdc_wait``) before reading that predecessor's output. A decode step is a chain of
small memory-bound kernels, and this hides each one's start-up behind the previous
one's tail. Earlier GPUs get the same kernels without PDL.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from raypp.model.triton_attention import (
    DEFAULT_LAUNCH,
    _attend_pages,
    _pad,
    _write_split,
    num_splits,
)


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch needs compute capability 9.0 (Hopper) or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# -- RMSNorm ------------------------------------------------------------------------------


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


# -- GEMV -----------------------------------------------------------------------------------


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


def gemv_config(n: int, k: int, gated: bool, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(rows of w per program, K per tile, warps)``: the fastest settings of an H200
    sweep at the Llama-3.2-1B shapes with PDL (``raypp.bench.gemv_probe``; benchmarks/gpu
    run 7), by shape class; tiles halve for 4-byte weights."""
    if gated:
        bn, bk, warps = 4, 512, 4
    elif k >= 4096:
        bn, bk, warps = 2, 2048, 8
    elif n > k:
        bn, bk, warps = 2, 1024, 4
    else:
        bn, bk, warps = 4, 2048, 4
    bk = min(bk // (2 if dtype.itemsize > 2 else 1), triton.next_power_of_2(k))
    return bn, bk, warps


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gated: bool,
         pdl: bool, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for ``x`` of one contiguous row ``[1, K]``; ``gated``:
    ``silu(x @ w[:n].T) * (x @ w[n:].T)`` with ``n = w.shape[0] // 2``. ``config``
    overrides :func:`gemv_config` (powers of two)."""
    assert x.shape[0] == 1 and x.is_contiguous() and w.is_contiguous()
    k = w.shape[1]
    n = w.shape[0] // 2 if gated else w.shape[0]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    bn, bk, warps = config or gemv_config(n, k, gated, w.dtype)
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


GEMM_MAX_ROWS = 64
GemmConfig = tuple[int, int, int, int, int]  # (BLOCK_N, BLOCK_K, split-K, warps, stages)


def gemm_config(m: int, n: int, k: int, gated: bool, dtype: torch.dtype) -> GemmConfig:
    """``(rows of w per program, K per tile, K splits, warps, pipeline stages)`` for ``m``
    rows: the fastest settings with PDL of an H200 sweep at the Llama-3.2-1B shapes and
    32 or 64 rows (``raypp.bench.gemm_probe``; benchmarks/gpu run 9), by shape class;
    K tiles halve for 4-byte weights."""
    wide = m > 32
    if gated:
        bn, bk, split, stages = (64, 128, 1, 4) if wide else (32, 256, 1, 3)
    elif k >= 4096:
        bn, bk, split, stages = (32, 256, 2, 4) if wide else (32, 128, 4, 4)
    elif n > k:
        bn, bk, split, stages = (32, 128, 4, 3) if wide else (32, 128, 4, 4)
    else:
        bn, bk, split, stages = (32, 256, 2, 4) if wide else (32, 256, 4, 4)
    if dtype.itemsize > 2:
        bk, stages = bk // 2, min(stages, 3)
    return bn, max(16, min(bk, triton.next_power_of_2(k))), split, 4, stages


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, gated: bool, pdl: bool,
         config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` (``gated``: ``silu(x @ w[:n].T) * (x @ w[n:].T)``, ``n =
    w.shape[0] // 2``) for up to :data:`GEMM_MAX_ROWS` rows of ``x`` (``stride(1) == 1``),
    on tensor cores (fp32: exact fp32 products); an output row depends only on its input
    row. ``config`` overrides :func:`gemm_config`."""
    m, k = x.shape
    assert m <= GEMM_MAX_ROWS and x.stride(1) == 1 and w.is_contiguous()
    n = w.shape[0] // 2 if gated else w.shape[0]
    bn, bk, split, warps, stages = config or gemm_config(m, n, k, gated, w.dtype)
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty((2 if gated else 1) * split * m * n, dtype=torch.float32,
                           device=x.device)
        counters = _split_counters(x.device, triton.cdiv(n, bn))
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


# -- rotary + KV store + paged decode attention -----------------------------------------------


@triton.jit
def _rope_decode_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    counter_ptr, scale, part_tokens, num_splits, stride_qkv, stride_rope, stride_bt, stride_ot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS_P2: tl.constexpr, LINES: tl.constexpr, LINE: tl.constexpr, SINGLE: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)  # rotate_half's source
    # graph inputs and rotary tables: nothing earlier in the step writes them
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    pos = tl.load(pos_ptr + seq).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    dtype = key_cache_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_rope + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_rope + offs_d, mask=d_mask, other=0.0)
    cos = cos.to(dtype).to(tl.float32)  # the tables in the model dtype, as the unfused path
    sin = tl.where(offs_d < half, -1.0, 1.0) * sin.to(dtype).to(tl.float32)
    if PDL:  # this split's first cached tokens, into L2 while the previous kernel drains
        first = split * part_tokens
        _prefetch_pages(key_cache_ptr, value_cache_ptr, block_tables_ptr + seq * stride_bt,
                        first, tl.minimum(first + BLOCK, seq_len - 1), kv_head, NUM_KV_HEADS,
                        HEAD_DIM, BLOCK_SIZE, BLOCK, LINES, LINE)
        tl.extra.cuda.gdc_wait()

    row = qkv_ptr + seq * stride_qkv
    qg_mask = g_mask[:, None] & d_mask[None, :]
    q_at = row + heads[:, None] * HEAD_DIM
    q = tl.load(q_at + offs_d[None, :], mask=qg_mask, other=0.0).to(tl.float32)
    q_partner = tl.load(q_at + partner[None, :], mask=qg_mask, other=0.0).to(tl.float32)
    q = (q * cos[None, :] + q_partner * sin[None, :]).to(dtype)
    k_at = row + NUM_HEADS * HEAD_DIM + kv_head * HEAD_DIM
    k_new = tl.load(k_at + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    k_partner = tl.load(k_at + partner, mask=d_mask, other=0.0).to(tl.float32)
    k_new = (k_new * cos + k_partner * sin).to(dtype)
    v_new = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_head * HEAD_DIM + offs_d,
                    mask=d_mask, other=0.0)
    kv_row: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    if (split == 0) & (slot >= 0):
        tl.store(key_cache_ptr + slot * kv_row + kv_head * HEAD_DIM + offs_d, k_new, mask=d_mask)
        tl.store(value_cache_ptr + slot * kv_row + kv_head * HEAD_DIM + offs_d, v_new,
                 mask=d_mask)

    # the context cached before this step: [0, seq_len - 1), this split's part of it
    cached = seq_len - 1
    start = split * part_tokens
    end = tl.minimum(start + part_tokens, cached)
    table = block_tables_ptr + seq * stride_bt
    m_i, l_i, acc = _attend_pages(q, key_cache_ptr, value_cache_ptr, table, start, end,
                                  kv_head, scale, GROUP_PAD, NUM_KV_HEADS, HEAD_DIM, DIM_PAD,
                                  BLOCK_SIZE, BLOCK, IEEE)
    # this step's token, in the split whose range holds its index
    if (seq_len > 0) & (split == cached // part_tokens):
        s = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
        m_i = m_new

    _write_split(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, m_i, l_i, acc, seq, heads,
                 split, num_splits, stride_ot, HEAD_DIM, g_mask, NUM_HEADS, HEAD_DIM, DIM_PAD,
                 SINGLE)
    if not SINGLE:
        # the last split of this (sequence, kv head) to finish combines them all: every
        # thread's stores come before the release, the reads after the acquire (from L2)
        tl.debug_barrier()
        counter = counter_ptr + seq * NUM_KV_HEADS + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)  # zero again for the next launch
            offs_h = tl.arange(0, GROUP_P2)
            offs_s = tl.arange(0, SPLITS_P2)
            hs_mask = (offs_h < GROUP)[:, None] & (offs_s < num_splits)[None, :]
            parts = (seq * NUM_HEADS + kv_head * GROUP + offs_h)[:, None] * num_splits + \
                offs_s[None, :]
            m = tl.load(part_max_ptr + parts, mask=hs_mask, other=float("-inf"),
                        cache_modifier=".cg")
            l_part = tl.load(part_sum_ptr + parts, mask=hs_mask, other=0.0, cache_modifier=".cg")
            m_max = tl.max(m, axis=1)
            m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no context: weights 0
            w = tl.where(hs_mask, tl.exp(m - m_max[:, None]), 0.0)
            total = tl.sum(l_part * w, axis=1)
            o = tl.load(part_out_ptr + parts[:, :, None] * DIM_PAD + offs_d[None, None, :],
                        mask=hs_mask[:, :, None] & d_mask[None, None, :], other=0.0,
                        cache_modifier=".cg")
            out = tl.sum(o * w[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]
            o_heads = kv_head * GROUP + offs_h
            tl.store(out_ptr + seq * stride_ot + o_heads[:, None] * HEAD_DIM + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty),
                     mask=(offs_h < GROUP)[:, None] & d_mask[None, :])


@triton.jit
def _prefetch_pages(key_cache_ptr, value_cache_ptr, table, start, end, kv_head,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, LINES: tl.constexpr,
                    LINE: tl.constexpr):
    """Ask L2 for one kv head's keys and values of the cached tokens ``[start,
    min(end, start + TOKENS))``: ``LINES`` lines of ``LINE`` elements per token (a hint,
    nothing is read into registers)."""
    toks = start + tl.arange(0, TOKENS)
    live = toks < end
    page = tl.load(table + toks // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    dim = tl.minimum(tl.arange(0, LINES) * LINE, HEAD_DIM - 1)
    offs = ((page * BLOCK_SIZE + toks % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) +
            kv_head * HEAD_DIM)[:, None] + dim[None, :]
    offs = tl.where(live[:, None], offs, 0)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [key_cache_ptr + offs], dtype=tl.int32, is_pure=False, pack=1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [value_cache_ptr + offs], dtype=tl.int32, is_pure=False, pack=1)


def rope_decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, num_heads: int,
                          scale: float, pdl: bool, splits: int | None = None) -> torch.Tensor:
    """A layer's decode step from its qkv projection ``[seqs, (heads + 2 kv_heads) * dim]``:
    neox rotary at ``positions`` (tables ``cos``/``sin`` ``[max_pos, dim]``), k/v written
    at ``slot_mapping`` (negative: skipped), attention over ``seq_lens`` tokens (this
    step's included; 0: a padding row, zeros out). Returns ``[seqs, heads * dim]``.
    ``splits`` overrides :func:`num_splits`'s choice."""
    seqs = qkv.shape[0]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    assert qkv.stride(-1) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    out = torch.empty(seqs, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    max_tokens = block_tables.shape[1] * block_size
    splits = splits or num_splits(seqs, num_kv_heads, max_tokens, qkv.device)
    part_tokens = -(-max_tokens // splits)
    dim_pad = _pad(head_dim)
    group = num_heads // num_kv_heads
    single = splits == 1
    if single:
        part_out = part_max = part_sum = counters = out  # unused
    else:
        part_out = torch.empty(seqs * num_heads * splits, dim_pad, dtype=torch.float32,
                               device=qkv.device)
        part_max = torch.empty(seqs * num_heads * splits, dtype=torch.float32, device=qkv.device)
        part_sum = torch.empty_like(part_max)
        counters = _split_counters(qkv.device, seqs * num_kv_heads)
    _rope_decode_kernel[(seqs, num_kv_heads, splits)](
        qkv, positions, cos, sin, key_cache, value_cache, slot_mapping, block_tables, seq_lens,
        out, part_out, part_max, part_sum, counters, scale, part_tokens, splits,
        qkv.stride(0), cos.stride(0), block_tables.stride(0), out.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=_pad(group),
        GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK=DEFAULT_LAUNCH.block,
        SPLITS_P2=triton.next_power_of_2(splits),
        LINES=triton.next_power_of_2(-(-head_dim * key_cache.element_size() // 128)),
        LINE=128 // key_cache.element_size(),
        SINGLE=single,
        IEEE=qkv.dtype == torch.float32, PDL=pdl,
        num_warps=4 if seqs == 1 else DEFAULT_LAUNCH.num_warps,  # batch 1: H200 sweep, run 6
        num_stages=DEFAULT_LAUNCH.num_stages, launch_pdl=pdl)
    return out


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # graphs captured earlier may still use these


def _split_counters(device: torch.device, pairs: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for ``pairs`` (sequence, kv head) pairs; the kernel
    leaves them zero, so one buffer per device serves every layer and every replay."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < pairs:
        if buf is not None:
            _RETIRED.append(buf)
        buf = _COUNTERS[device] = torch.zeros(max(pairs, 4096), dtype=torch.int32, device=device)
    return buf


# The cache write is deliberately not declared in mutates_args: the caches are inputs
# of a compiled decode graph, and functionalizing a multi-GB in-place write would make
# the compiler copy the cache. Nothing else in a graph reads a layer's cache.
@torch.library.custom_op("raypp::rope_decode_attention", mutates_args=())
def rope_decode_attention_op(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, num_heads: int, scale: float
                             ) -> torch.Tensor:
    """:func:`rope_decode_attention` with PDL where the GPU has it."""
    return rope_decode_attention(qkv, positions, cos, sin, kv_cache, slot_mapping, block_tables,
                                 seq_lens, num_heads, scale, pdl_supported(qkv.device))


@rope_decode_attention_op.register_fake
def _(qkv, positions, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens, num_heads, scale):
    return qkv.new_empty((qkv.shape[0], num_heads * kv_cache.shape[-1]))
