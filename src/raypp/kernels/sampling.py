"""The CUDA half of :mod:`raypp.worker.decode_loop`: one Triton launch advances a
decode batch's inputs to the next step (instead of seven small PyTorch kernels), and
a greedy step is two launches: every (row, vocabulary chunk) program folds its chunk's
maximum into the row's key with an atomic max, then one program per rows block turns
the keys into tokens and advances the inputs (instead of six argmax kernels and the
advance).

Imported only when the inputs live on a GPU (Triton is not needed on CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_ROWS_PER_PROGRAM = 256


# rows and stride_table vary per call: specializing on them (``== 1``, ``% 16 == 0``) would
# JIT-compile a new variant mid-serving, e.g. the first time one sequence is decoded alone
@triton.jit(do_not_specialize=["rows", "stride_table"])
def _advance_kernel(tokens_ptr, ids_ptr, pos_ptr, lens_ptr, slot_ptr, tables_ptr, rows,
                    stride_table, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask = r < rows
    _advance_rows(tl.load(tokens_ptr + r, mask=mask), r, mask, ids_ptr, pos_ptr, lens_ptr,
                  slot_ptr, tables_ptr, stride_table, BLOCK_SIZE)


@triton.jit
def _advance_rows(tokens, r, mask, ids_ptr, pos_ptr, lens_ptr, slot_ptr, tables_ptr,
                  stride_table, BLOCK_SIZE: tl.constexpr):
    """Rows ``r``: the next step's input is ``tokens`` one position further on."""
    pos = tl.load(pos_ptr + r, mask=mask) + 1
    block = tl.load(tables_ptr + r.to(tl.int64) * stride_table + pos // BLOCK_SIZE, mask=mask)
    tl.store(ids_ptr + r, tokens, mask=mask)
    tl.store(pos_ptr + r, pos, mask=mask)
    tl.store(lens_ptr + r, tl.load(lens_ptr + r, mask=mask) + 1, mask=mask)
    tl.store(slot_ptr + r, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)


class DecodeTensors(NamedTuple):
    """A decode batch's per-row inputs (int64, contiguous rows; tables row-major)."""

    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    seq_lens: torch.Tensor  # [rows] context length including this step's token
    slot_mapping: torch.Tensor  # [rows]
    block_tables: torch.Tensor  # [rows, width]

    def check(self) -> None:
        for t in self[:4]:
            assert t.is_contiguous() and t.dtype == torch.int64
        assert self.block_tables.stride(1) == 1


def advance(inputs: DecodeTensors, tokens: torch.Tensor, block_size: int) -> None:
    """In place: the next step's input is ``tokens``, one position further on (its
    position, context length and cache slot from the block table)."""
    rows = tokens.shape[0]
    assert tokens.is_contiguous() and tokens.dtype == torch.int64
    inputs.check()
    _advance_kernel[(triton.cdiv(rows, _ROWS_PER_PROGRAM),)](
        tokens, *inputs, rows, inputs.block_tables.stride(0),
        BLOCK_SIZE=block_size, ROWS=_ROWS_PER_PROGRAM, num_warps=4)


# A row's key packs (value, -index) into one int64 so that the largest key is the
# largest logit at its first index: the fp32 bits mapped to an order-preserving int32
# in the high half, 2**32 - 1 - index in the low half. EMPTY is below every key.
EMPTY_KEY = -(2**63)
_ARGMAX_BLOCK = 4096


@triton.jit
def _argmax_chunk_kernel(logits_ptr, keys_ptr, vocab, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < vocab, other=float("-inf"))
    best, at = tl.max(x.to(tl.float32), axis=0, return_indices=True,
                      return_indices_tie_break_left=True)
    bits = best.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negatives: larger magnitude lower
    index = (chunk * BLOCK + at).to(tl.int64)
    key = (ordered.to(tl.int64) << 32) | (4294967295 - index)
    tl.atomic_max(keys_ptr + row, key)


@triton.jit(do_not_specialize=["rows", "stride_table", "stride_out"])
def _greedy_advance_kernel(keys_ptr, out_ptr, ids_ptr, pos_ptr, lens_ptr, slot_ptr, tables_ptr,
                           rows, stride_table, stride_out, BLOCK_SIZE: tl.constexpr,
                           ROWS: tl.constexpr, ADVANCE: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask = r < rows
    key = tl.load(keys_ptr + r, mask=mask)
    token = 4294967295 - (key & 4294967295)
    tl.store(out_ptr + r.to(tl.int64) * stride_out, token, mask=mask)
    tl.store(keys_ptr + r, tl.full([ROWS], -9223372036854775808, tl.int64), mask=mask)
    if ADVANCE:
        _advance_rows(token, r, mask, ids_ptr, pos_ptr, lens_ptr, slot_ptr, tables_ptr,
                      stride_table, BLOCK_SIZE)


def greedy_step(logits: torch.Tensor, keys: torch.Tensor, out: torch.Tensor,
                inputs: DecodeTensors | None, block_size: int) -> None:
    """``out[r] = argmax(logits[r])`` (first index of the maximum) and, given ``inputs``,
    :func:`advance` them with those tokens. ``keys``: ``[rows]`` int64 filled with
    :data:`EMPTY_KEY` (left so for the next call); ``out`` may be a strided column, e.g.
    one step's column of a ``[rows, steps]`` buffer."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and keys.is_contiguous() and out.dtype == torch.int64
    _argmax_chunk_kernel[(rows, triton.cdiv(vocab, _ARGMAX_BLOCK))](
        logits, keys, vocab, logits.stride(0), BLOCK=_ARGMAX_BLOCK, num_warps=8)
    if inputs is not None:
        inputs.check()
        tensors, stride_table = tuple(inputs), inputs.block_tables.stride(0)
    else:
        tensors, stride_table = (keys,) * 5, 0
    _greedy_advance_kernel[(triton.cdiv(rows, _ROWS_PER_PROGRAM),)](
        keys, out, *tensors, rows, stride_table, out.stride(0), BLOCK_SIZE=block_size,
        ROWS=_ROWS_PER_PROGRAM, ADVANCE=inputs is not None, num_warps=4)
