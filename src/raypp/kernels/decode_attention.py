"""One decode step of an attention layer from its raw qkv projection, in one launch.

:func:`rope_decode_attention`: rotary on q and k, k/v stored in the paged cache,
attention of q over the cached context plus this step's k/v (taken from registers, so
no program reads a slot another one is writing), split over the context like
:func:`raypp.kernels.attention.paged_decode`; the last split of each (sequence, kv
head) to finish combines the splits (an arrival counter, no second launch). With a sliding
``window`` the query sees only the last ``window`` tokens of its context, this step's
included, and the splits cover only that span. It is also
the custom op ``torch.ops.raypp.rope_decode_attention`` that the Triton attention
backend calls for decode-only steps (``torch.compile`` treats it as one opaque call).
An FP8 cache (e4m3, with the layer's ``k_scale``/``v_scale``) stores this step's k/v
rounded, and the step attends to its own k/v as rounded, as to every cached token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raypp.kernels.attention import (
    _attend_pages,
    _pad,
    _to_fp8,
    _write_split,
    attended_span,
    fp8_scales,
    num_splits,
)
from raypp.kernels.counters import split_counters
from raypp.kernels.tuning import decode_launch, pdl_supported


@triton.jit
def _rope_decode_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    counter_ptr, k_scale_ptr, v_scale_ptr, scale, part_tokens, num_splits, window, stride_qkv,
    stride_rope, stride_bt,
    stride_ot, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS_P2: tl.constexpr, LINES: tl.constexpr, LINE: tl.constexpr, SINGLE: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr, SLIDING: tl.constexpr, FP8: tl.constexpr,
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
    dtype = qkv_ptr.dtype.element_ty  # the model's (an FP8 cache's own type is e4m3)
    cos = tl.load(cos_ptr + pos * stride_rope + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_rope + offs_d, mask=d_mask, other=0.0)
    cos = cos.to(dtype).to(tl.float32)  # the tables in the model dtype, as the unfused path
    sin = tl.where(offs_d < half, -1.0, 1.0) * sin.to(dtype).to(tl.float32)
    # the splits cover [lo, seq_len): the whole context, or a sliding window's span of it
    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    if PDL:  # this split's first cached tokens, into L2 while the previous kernel drains
        first = lo + split * part_tokens
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
    k_scale, v_scale = 1.0, 1.0
    if FP8:  # store e4m3, and attend to this token as the cache will give it back
        k_scale, v_scale = tl.load(k_scale_ptr), tl.load(v_scale_ptr)
        k_store = _to_fp8(k_new, k_scale, key_cache_ptr.dtype.element_ty)
        v_store = _to_fp8(v_new, v_scale, value_cache_ptr.dtype.element_ty)
        k_new = (k_store.to(tl.float32) * k_scale).to(dtype)
        v_new = (v_store.to(tl.float32) * v_scale).to(dtype)
    else:
        k_store, v_store = k_new, v_new
    if (split == 0) & (slot >= 0):
        tl.store(key_cache_ptr + slot * kv_row + kv_head * HEAD_DIM + offs_d, k_store,
                 mask=d_mask)
        tl.store(value_cache_ptr + slot * kv_row + kv_head * HEAD_DIM + offs_d, v_store,
                 mask=d_mask)

    # the context cached before this step: [lo, seq_len - 1), this split's part of it
    cached = seq_len - 1
    start = lo + split * part_tokens
    end = tl.minimum(start + part_tokens, cached)
    table = block_tables_ptr + seq * stride_bt
    m_i, l_i, acc = _attend_pages(q, key_cache_ptr, value_cache_ptr, table, start, end,
                                  kv_head, scale, GROUP_PAD, NUM_KV_HEADS, HEAD_DIM, DIM_PAD,
                                  BLOCK_SIZE, BLOCK, IEEE, k_scale, v_scale, FP8)
    # this step's token, in the split whose range holds its index
    if (seq_len > 0) & (split == (cached - lo) // part_tokens):
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
                          scale: float, pdl: bool, splits: int | None = None,
                          window: int | None = None, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's decode step from its qkv projection ``[seqs, (heads + 2 kv_heads) * dim]``:
    neox rotary at ``positions`` (tables ``cos``/``sin`` ``[max_pos, dim]``), k/v written
    at ``slot_mapping`` (negative: skipped), attention over ``seq_lens`` tokens (this
    step's included; 0: a padding row, zeros out), or over the last ``window`` of them
    (a sliding window). Returns ``[seqs, heads * dim]``. ``splits`` overrides
    :func:`num_splits`'s choice; ``k_scale``/``v_scale``: an FP8 cache's (default 1.0)."""
    seqs = qkv.shape[0]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    assert qkv.stride(-1) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    out = torch.empty(seqs, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    max_tokens = attended_span(block_tables.shape[1] * block_size, window)
    splits = splits or num_splits(seqs, num_kv_heads, max_tokens, qkv.device)
    launch = decode_launch(qkv.device, seqs)
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
        counters = split_counters(qkv.device, seqs * num_kv_heads)
    fp8, k_scale, v_scale = fp8_scales(key_cache, k_scale, v_scale)
    _rope_decode_kernel[(seqs, num_kv_heads, splits)](
        qkv, positions, cos, sin, key_cache, value_cache, slot_mapping, block_tables, seq_lens,
        out, part_out, part_max, part_sum, counters, k_scale, v_scale, scale, part_tokens, splits,
        window or 0,
        qkv.stride(0), cos.stride(0), block_tables.stride(0), out.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=_pad(group),
        GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK=launch.block,
        SPLITS_P2=triton.next_power_of_2(splits),
        LINES=triton.next_power_of_2(-(-head_dim * key_cache.element_size() // 128)),
        LINE=128 // key_cache.element_size(),
        SINGLE=single,
        IEEE=qkv.dtype == torch.float32, PDL=pdl, SLIDING=bool(window), FP8=fp8,
        num_warps=launch.num_warps, num_stages=launch.num_stages, launch_pdl=pdl)
    return out


# The cache write is deliberately not declared in mutates_args: the caches are inputs
# of a compiled decode graph, and functionalizing a multi-GB in-place write would make
# the compiler copy the cache. Nothing else in a graph reads a layer's cache.
@torch.library.custom_op("raypp::rope_decode_attention", mutates_args=())
def rope_decode_attention_op(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, num_heads: int, scale: float,
                             window: int = 0, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rope_decode_attention` with PDL where the GPU has it (``window`` 0: none)."""
    return rope_decode_attention(qkv, positions, cos, sin, kv_cache, slot_mapping, block_tables,
                                 seq_lens, num_heads, scale, pdl_supported(qkv.device),
                                 window=window or None, k_scale=k_scale, v_scale=v_scale)


@rope_decode_attention_op.register_fake
def _(qkv, positions, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens, num_heads, scale,
      window=0, k_scale=None, v_scale=None):
    return qkv.new_empty((qkv.shape[0], num_heads * kv_cache.shape[-1]))
