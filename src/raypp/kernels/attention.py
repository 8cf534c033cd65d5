"""Attention over the paged KV cache on CUDA: Triton kernels plus an SDPA prefill.

Cache layout per layer (as :class:`raypp.model.attention.PagedAttention`):
``[2, num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.

- :func:`store_kv` writes this step's keys/values into their cache slots in one
  launch; a slot of ``-1`` is skipped (CUDA-graph padding rows use it).
- :func:`paged_decode` is flash-decoding over the block table: each program
  takes one (sequence, kv head, split of the context) and all query heads of
  that kv head's GQA group, reads the keys/values of its blocks in place (no
  gather into a contiguous copy) and keeps an online softmax in fp32; a second
  kernel combines the splits. A row with context length 0 gives zeros. With a
  sliding ``window`` a query sees only the last ``window`` tokens of its context
  (positions ``>= seq_len - window``), and the splits cover only that span.
- An FP8 (e4m3) cache: every kernel takes the layer's ``k_scale``/``v_scale`` (fp32
  scalars on the device, so graphs replay without a host read): stores write
  ``x / scale`` saturated and rounded to e4m3, reads upcast ``q · scale`` to the query's
  dtype before the dot products; the prefill path reads this step's keys as they come back
  from the cache, so every backend attends to the same rounded keys.
- :func:`paged_attention` is a layer's step with prefill rows: store, then the
  decode kernel for one-token rows and ``scaled_dot_product_attention`` (flash /
  efficient backends) per multi-token sequence. Decode-only steps take
  :mod:`raypp.kernels.decode_attention`'s fused op instead (rotary, store and this
  decode algorithm in one kernel, plus the split combine), which CUDA graphs capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from raypp.kernels.tuning import DecodeLaunch, sm_count, tables

MIN_SPLIT_TOKENS = 64  # a split never covers fewer tokens than this
MAX_SPLITS = 32
_SPLITS_PAD = 32  # combine kernel reads up to this many splits (masked)


# -- kernels ------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, k_scale_ptr,
                     v_scale_ptr, stride_k, stride_v, ROW: tl.constexpr, ROW_PAD: tl.constexpr,
                     FP8: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = offs < tl.where(slot >= 0, ROW, 0)  # a skipped slot masks the whole row
    k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
    if FP8:
        k = _to_fp8(k, tl.load(k_scale_ptr), key_cache_ptr.dtype.element_ty)
        v = _to_fp8(v, tl.load(v_scale_ptr), value_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(value_cache_ptr + slot * ROW + offs, v, mask=mask)


@triton.jit
def _to_fp8(x, scale, dtype: tl.constexpr):
    """``x / scale`` saturated to ±448 and rounded to e4m3 (``dtype``)."""
    return tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0).to(dtype)


@triton.jit
def _paged_decode_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    k_scale_ptr, v_scale_ptr, scale, part_tokens, num_splits, window,
    stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr, IEEE: tl.constexpr,
    SLIDING: tl.constexpr, FP8: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * part_tokens
    if SLIDING:  # the splits cover the window's span [seq_len - window, seq_len)
        start += tl.maximum(seq_len - window, 0)
    end = tl.minimum(start + part_tokens, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    table = block_tables_ptr + seq * stride_bt
    k_scale, v_scale = 1.0, 1.0
    if FP8:
        k_scale, v_scale = tl.load(k_scale_ptr), tl.load(v_scale_ptr)
    m_i, l_i, acc = _attend_pages(q, key_cache_ptr, value_cache_ptr, table, start, end,
                                  kv_head, scale, GROUP_PAD, NUM_KV_HEADS, HEAD_DIM, DIM_PAD,
                                  BLOCK_SIZE, BLOCK, IEEE, k_scale, v_scale, FP8)
    _write_split(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, m_i, l_i, acc, seq, heads,
                 split, num_splits, stride_ot, stride_oh, g_mask, NUM_HEADS, HEAD_DIM, DIM_PAD,
                 SINGLE)


@triton.jit
def _attend_pages(q, key_cache_ptr, value_cache_ptr, table, start, end, kv_head, scale,
                  GROUP_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                  IEEE: tl.constexpr, k_scale, v_scale, FP8: tl.constexpr):
    """Online softmax of ``q`` ([GROUP_PAD, DIM_PAD], one kv head's query heads) over the
    cached tokens ``[start, end)`` of one sequence's block ``table``, read in place:
    ``(running max, running sum, unnormalized output)`` in fp32. An FP8 cache is upcast
    to ``q``'s dtype with ``k_scale``/``v_scale`` as it is read."""
    offs_d = tl.arange(0, DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    row: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for n0 in range(start, end, BLOCK):
        toks = n0 + tl.arange(0, BLOCK)
        t_mask = toks < end
        page = tl.load(table + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slots = page * BLOCK_SIZE + toks % BLOCK_SIZE
        kv_offs = slots[:, None] * row + kv_head * HEAD_DIM + offs_d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if FP8:  # e4m3 → q's dtype, scaled (one multiply per element read)
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if IEEE:  # noqa: SIM108 - constexpr branch; fp32 models get exact fp32, not tf32
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(t_mask[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:  # noqa: SIM108 - constexpr branch
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _write_split(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, m_i, l_i, acc, seq, heads,
                 split, num_splits, stride_ot, stride_oh, g_mask, NUM_HEADS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SINGLE: tl.constexpr):
    """One split's result: the normalized output when it is the only split, else its
    partials (max, sum, unnormalized output) for the combine."""
    offs_d = tl.arange(0, DIM_PAD)
    if SINGLE:
        denom = tl.where(l_i > 0, l_i, 1.0)
        out = acc / denom[:, None]
        o_ptrs = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & (offs_d < HEAD_DIM)[None, :])
    else:
        part = (seq * NUM_HEADS + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_max_ptr + part, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part, l_i, mask=g_mask)
        tl.store(part_out_ptr + part[:, None] * DIM_PAD + offs_d[None, :], acc,
                 mask=g_mask[:, None])


@triton.jit
def _combine_kernel(part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_splits,
                    stride_ot, stride_oh, NUM_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < num_splits
    part = (seq * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # empty context: all weights 0
    w = tl.exp(m - m_max)
    total = tl.sum(l_part * w, axis=0)
    offs_d = tl.arange(0, DIM_PAD)
    acc = tl.load(part_out_ptr + part[:, None] * DIM_PAD + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# -- launchers -----------------------------------------------------------------------------


def _pad(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def attended_span(max_tokens: int, window: int | None) -> int:
    """The most context tokens one query attends to: the block table's capacity, or the
    sliding window when that is shorter. Depends only on shapes (graph-stable)."""
    return max_tokens if not window else min(max_tokens, window)


def num_splits(num_seqs: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Context splits per (sequence, kv head).

    One when (sequence, kv head) pairs already fill two waves of the GPU; else enough
    for ~8 waves, as splits of the block table's width (the context may be shorter,
    leaving trailing splits empty). Depends only on shapes, so a captured graph keeps
    its launch grid.
    """
    pairs = max(1, num_seqs * num_kv_heads)
    if pairs >= 2 * sm_count(device):
        return 1
    most = max(1, -(-max_tokens // MIN_SPLIT_TOKENS))
    return max(1, min(-(-8 * sm_count(device) // pairs), most, MAX_SPLITS))


def fp8_scales(key_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """``(the cache is FP8, k_scale, v_scale)``, a scale left ``None`` taken as 1.0."""
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    one = None
    if fp8 and (k_scale is None or v_scale is None):
        one = torch.ones((), dtype=torch.float32, device=key_cache.device)
    k_scale = k_scale if k_scale is not None else (one if fp8 else key_cache)
    v_scale = v_scale if v_scale is not None else (one if fp8 else key_cache)
    return fp8, k_scale, v_scale


def store_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """``cache[slot_mapping[i]] = k[i], v[i]``; rows whose slot is negative are skipped
    (an FP8 cache: through e4m3 with ``k_scale``/``v_scale``, default 1.0)."""
    # k, v: [tokens, kv_heads, dim] (each token's heads contiguous); caches contiguous
    tokens = k.shape[0]
    if tokens == 0:
        return
    k = k if k.stride(-1) == 1 and k.stride(-2) == k.shape[-1] else k.contiguous()
    v = v if v.stride(-1) == 1 and v.stride(-2) == v.shape[-1] else v.contiguous()
    row = k.shape[1] * k.shape[2]
    fp8, k_scale, v_scale = fp8_scales(key_cache, k_scale, v_scale)
    _store_kv_kernel[(tokens,)](
        k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale, k.stride(0), v.stride(0),
        ROW=row, ROW_PAD=triton.next_power_of_2(row), FP8=fp8,
    )


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 splits: int | None = None, launch: DecodeLaunch | None = None,
                 window: int | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its cached context.

    ``q``: [seqs, heads, dim]; ``block_tables``: [seqs, width] (int32/int64);
    ``seq_lens``: [seqs] context lengths, this step's token included (0: a
    padding row, output zeros). ``window`` (a sliding window): attend only to the
    last ``window`` tokens of the context. Returns [seqs, heads, dim] in q's dtype.
    ``splits`` and ``launch`` override :func:`num_splits` and the device's tuning table;
    ``k_scale``/``v_scale``: an FP8 cache's scales (default 1.0).
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    assert q.stride(-1) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    group = num_heads // num_kv_heads
    launch = launch or tables(q.device).decode_launch
    max_tokens = attended_span(block_tables.shape[1] * block_size, window)
    if splits is None:
        splits = num_splits(num_seqs, num_kv_heads, max_tokens, q.device)
    part_tokens = -(-max_tokens // splits)
    part_tokens = -(-part_tokens // launch.block) * launch.block
    dim_pad = _pad(head_dim)
    single = splits == 1
    if single:
        part_out = part_max = part_sum = out  # unused
    else:
        part_out = torch.empty(num_seqs * num_heads * splits, dim_pad, dtype=torch.float32,
                               device=q.device)
        part_max = torch.empty(num_seqs * num_heads * splits, dtype=torch.float32,
                               device=q.device)
        part_sum = torch.empty_like(part_max)
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, key_cache, value_cache, block_tables, seq_lens,
        out, part_out, part_max, part_sum, *fp8_scales(key_cache, k_scale, v_scale)[1:],
        scale, part_tokens, splits, window or 0,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=_pad(group),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, BLOCK=launch.block,
        SINGLE=single, IEEE=q.dtype == torch.float32, SLIDING=bool(window),
        FP8=key_cache.dtype == torch.float8_e4m3fn,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    if not single:
        assert splits <= _SPLITS_PAD
        _combine_kernel[(num_seqs, num_heads)](
            part_out, part_max, part_sum, out, splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, SPLITS_PAD=_SPLITS_PAD, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
            num_warps=2,
        )
    return out


# -- the layer step ------------------------------------------------------------------------


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta, scale: float, window: int | None = None,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Store this step's k/v, then attend (each query to the last ``window`` tokens up to
    its own, when a sliding window is given); returns [tokens, heads * dim]. An FP8 cache
    stores and reads through e4m3 with ``k_scale``/``v_scale``.

    ``meta`` is a :class:`raypp.model.attention.AttentionMetadata`; its Python lists
    drive a per-sequence prefill (not graph-capturable).
    """
    # q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    fp8, k_scale, v_scale = fp8_scales(key_cache, k_scale, v_scale)
    store_kv(k, v, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
    if fp8:  # attend to the keys and values as the cache holds them
        k, v = _through_fp8(k, k_scale), _through_fp8(v, v_scale)
    return _mixed(q, k, v, key_cache, value_cache, meta, scale, window,
                  (k_scale, v_scale) if fp8 else None).reshape(q.shape[0], -1)


def _through_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` as an FP8 cache gives it back (as :func:`_to_fp8`, then ``q · scale``)."""
    q = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def _mixed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
           value_cache: torch.Tensor, meta, scale: float, window: int | None = None,
           fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One-token rows through the decode kernel (one launch); longer queries through SDPA
    (``fp8_scales``: the FP8 cache's, to upcast what a later chunk reads from it)."""
    k_scale, v_scale = fp8_scales or (None, None)
    starts = meta.query_start
    query_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    out = torch.empty_like(q)
    single = [j for j, n in enumerate(query_lens) if n == 1]
    if single:
        rows = torch.tensor(single, dtype=torch.int64, device=q.device)
        tokens = torch.tensor([starts[j] for j in single], dtype=torch.int64, device=q.device)
        out[tokens] = paged_decode(q.index_select(0, tokens), key_cache, value_cache,
                                   meta.block_tables.index_select(0, rows),
                                   meta.seq_lens_tensor.index_select(0, rows), scale,
                                   window=window, k_scale=k_scale, v_scale=v_scale)
    block_size = key_cache.shape[1]
    for j, n in enumerate(query_lens):
        if n <= 1:
            continue
        start, end, seq_len = starts[j], starts[j + 1], meta.seq_lens[j]
        if n == seq_len:  # the whole context is this step's: use k/v as computed
            keys, values = k[start:end], v[start:end]
        else:  # a later prefill chunk: this sequence's blocks (and only its) from the cache
            table = meta.block_tables[j, : -(-seq_len // block_size)]
            keys = key_cache[table].flatten(0, 1)[:seq_len]
            values = value_cache[table].flatten(0, 1)[:seq_len]
            if fp8_scales is not None:
                keys = (keys.float() * k_scale).to(q.dtype)
                values = (values.float() * v_scale).to(q.dtype)
        if window:
            out[start:end] = _windowed_sdpa(q[start:end], keys, values, scale, window)
        else:
            out[start:end] = _causal_sdpa(q[start:end], keys, values, scale)
    return out


def _windowed_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                   window: int) -> torch.Tensor:
    """:func:`_causal_sdpa` where each query sees only the last ``window`` positions up to
    its own: the keys no query reaches are cut off, the rest masked."""
    q_len, kv_len = q.shape[0], keys.shape[0]
    first = max(0, kv_len - q_len - window + 1)  # the earliest key the first query sees
    keys, values = keys[first:], values[first:]
    group = q.shape[1] // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
    kv_pos = torch.arange(first, kv_len, device=q.device)[None, :]
    mask = (kv_pos <= q_pos) & (kv_pos > q_pos - window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, scale=scale,
    )
    return out[0].transpose(0, 1)


def _causal_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 scale: float) -> torch.Tensor:
    # q: [q_len, heads, dim] are the last q_len positions of keys/values: [kv_len, kv_heads, dim]
    q_len, kv_len = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    if group > 1:  # expand GQA so the flash backend applies
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    mask = None
    if q_len != kv_len:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale,
    )
    return out[0].transpose(0, 1)
