"""Attention over the paged KV cache, with its backend chosen once when the model is built.

:class:`PagedAttention` takes a layer's fused qkv projection and does the rest of
attention: an optional per-head norm of q and k, rotary on q and k, the KV-cache store,
and attention of each query over its sequence's cached context, or over the last
``sliding_window`` tokens of it. Two backends compute the same function:

- ``"torch"`` (any device; the CPU path): plain PyTorch, SDPA over gathered blocks.
- ``"triton"`` (CUDA): :mod:`raypp.kernels` — one fused launch for decode-only
  steps (rotary + store + split-context attention, capturable in CUDA graphs), the
  Triton store and decode kernels plus SDPA for steps with prefill rows.

:func:`attention_backend` picks one from the device; a layer never checks the
device in ``forward``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raypp.model.layers import RotaryEmbedding
from raypp.model.quantization.fp8 import FP8_DTYPE, from_fp8, to_fp8

BACKENDS = ("torch", "triton")
# The most attention scores (heads x queries x keys) one SDPA call of the torch backend
# computes: a long prompt's chunk attends in blocks of queries under this, each block a
# unit of progress, so the work between two progress ticks (and the score memory) stays
# bounded at any context length.
SCORES_PER_BLOCK = 2**26


def attention_backend(device: torch.device) -> str:
    """``"triton"`` on a CUDA device, ``"torch"`` elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged cache; built once per step.

    ``slot_mapping[i]`` is token i's flat cache slot (negative: not stored, e.g. a
    CUDA-graph padding row); sequence j owns query tokens
    ``query_start[j]:query_start[j+1]`` and has ``seq_lens[j]`` tokens in context
    (those cached earlier plus this step's). Decode-only steps on a graph read the
    tensors alone (their Python lists may be empty). ``on_progress``, when set, is
    called once per layer and per block of a long attention (the stage's progress
    counter: :mod:`raypp.worker.progress`).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    decode_only: bool
    seq_lens_tensor: torch.Tensor  # [num_seqs] int64
    on_progress: Callable[[], None] | None = None

    def advance(self) -> None:
        """Report one unit of work done (no-op without ``on_progress``)."""
        if self.on_progress is not None:
            self.on_progress()


class PagedAttention(nn.Module):
    """(q/k norm,) rotary, KV store and attention of one layer, from its qkv projection.

    Cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, in the
    model's dtype or in FP8 (e4m3, ``kv_cache_dtype="fp8"``): then keys are stored as
    ``k / k_scale`` and read back as ``q · k_scale`` in the model's dtype (values alike with
    ``v_scale``); the scales are this layer's ``k_scale``/``v_scale`` buffers, 1.0 unless the
    checkpoint gives them. ``forward`` returns ``[tokens, num_heads * head_dim]``.

    Options a family may set: ``scale`` (default ``head_dim ** -0.5``);
    ``sliding_window``: a query attends only to the last ``sliding_window`` positions up
    to and including its own (prefill, chunked prefill and decode alike; the cache still
    keeps every token); ``q_norm``/``k_norm``: modules applied to each q and k head
    (``[..., head_dim]``) before rotary, both or neither.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: RotaryEmbedding, backend: str, scale: float | None = None,
                 sliding_window: int | None = None, q_norm: nn.Module | None = None,
                 k_norm: nn.Module | None = None):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window!r}")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary = rotary
        self.backend = backend
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.q_norm, self.k_norm = q_norm, k_norm
        # an FP8 cache's per-layer scales (the loader fills them from k_scale/v_scale)
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # qkv: [tokens, (heads + 2 * kv_heads) * head_dim]
        meta.advance()
        if self.backend == "triton" and meta.decode_only:
            from raypp.kernels.decode_attention import rope_decode_attention_op

            if self.q_norm is not None:
                qkv = self.normalize_qk(qkv)
            return rope_decode_attention_op(
                qkv, positions, self.rotary.cos, self.rotary.sin, kv_cache, meta.slot_mapping,
                meta.block_tables, meta.seq_lens_tensor, self.num_heads, self.scale,
                self.sliding_window or 0, self.k_scale, self.v_scale)
        q, k, v = self.split_heads(qkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if self.backend == "triton":
            from raypp.kernels.attention import paged_attention

            return paged_attention(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                                   self.k_scale, self.v_scale)
        return self._torch_attention(q, k, v, kv_cache, meta)

    def normalize_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` with each q and k head normalized (a new tensor, same layout)."""
        q, k, v = self.split_heads(qkv)
        return torch.cat((self.q_norm(q).flatten(1), self.k_norm(k).flatten(1), v.flatten(1)),
                         dim=-1)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [tokens, heads, dim]``, ``k`` and ``v [tokens, kv_heads, dim]`` (views)."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim),
                k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    # -- the torch backend ----------------------------------------------------------------
    def _torch_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] → out: [tokens, heads * dim]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        block_size = key_cache.shape[1]
        self._store(key_cache, k, self.k_scale, meta.slot_mapping)
        self._store(value_cache, v, self.v_scale, meta.slot_mapping)
        if meta.decode_only:
            out = self._decode(q, key_cache, value_cache, meta, block_size)
        else:
            out = self._varlen(q, key_cache, value_cache, meta, block_size)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _store(self, cache: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
               slots: torch.Tensor) -> None:
        """``cache[slots] = x``, through e4m3 with ``scale`` when the cache is FP8."""
        rows = cache.view(-1, self.num_kv_heads, self.head_dim)
        if cache.dtype == FP8_DTYPE:  # CPU has no FP8 index_copy_: the same bytes as uint8
            rows.view(torch.uint8).index_copy_(0, slots, to_fp8(x, scale).view(torch.uint8))
        else:
            rows.index_copy_(0, slots, x)

    @staticmethod
    def _read(cached: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cached keys or values in ``dtype`` (an FP8 cache's upcast: ``q · scale``)."""
        return from_fp8(cached, scale, dtype) if cached.dtype == FP8_DTYPE else cached

    def _decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, block_size: int) -> torch.Tensor:
        # One query token per sequence: gather each sequence's blocks, mask the padding.
        num_seqs, max_blocks = meta.block_tables.shape
        length = max_blocks * block_size
        keys = key_cache[meta.block_tables].view(num_seqs, length, self.num_kv_heads, -1)
        values = value_cache[meta.block_tables].view(num_seqs, length, self.num_kv_heads, -1)
        keys = self._read(keys, self.k_scale, q.dtype)
        values = self._read(values, self.v_scale, q.dtype)
        pos = torch.arange(length, device=q.device)[None, :]
        mask = pos < meta.seq_lens_tensor[:, None]
        if self.sliding_window is not None:
            mask = mask & (pos >= meta.seq_lens_tensor[:, None] - self.sliding_window)
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [seqs, heads, 1, dim]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out[:, :, 0, :]

    def _varlen(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, block_size: int) -> torch.Tensor:
        outs = []
        for j, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start[j], meta.query_start[j + 1]
            num_blocks = -(-seq_len // block_size)
            table = meta.block_tables[j, :num_blocks]
            keys = key_cache[table].view(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            values = value_cache[table].view(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            keys = self._read(keys, self.k_scale, q.dtype)
            values = self._read(values, self.v_scale, q.dtype)
            outs.extend(self._blocks(q[start:end], keys, values, seq_len, meta))
        return torch.cat(outs, dim=0)

    def _blocks(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                seq_len: int, meta: AttentionMetadata) -> list[torch.Tensor]:
        """Attention of one sequence's queries, in blocks of at most
        :data:`SCORES_PER_BLOCK` scores; progress is reported after each block."""
        # q: [q_len, heads, dim], the last q_len positions of a seq_len context
        q_len = q.shape[0]
        rows = max(1, SCORES_PER_BLOCK // (self.num_heads * seq_len))
        if rows >= q_len:
            return [self._causal(q, keys, values, seq_len)]
        outs = []
        for a in range(0, q_len, rows):
            b = min(q_len, a + rows)
            end = seq_len - q_len + b  # the block's context: up to its last query
            outs.append(self._causal(q[a:b], keys[:end], values[:end], end))
            meta.advance()
        return outs

    def _causal(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                seq_len: int) -> torch.Tensor:
        # q: [q_len, heads, dim] are the last q_len positions of a seq_len context.
        q_len = q.shape[0]
        gqa = self.num_heads != self.num_kv_heads
        window = self.sliding_window
        if q_len == seq_len and window is None:
            mask, causal = None, True
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            kv_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = kv_pos <= q_pos
            if window is not None:
                mask = mask & (kv_pos > q_pos - window)
            causal = False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa,
        )
        return out.transpose(0, 1)
