"""The CUDA half of :mod:`raypp.executor.decode_loop`: one Triton launch advances a
decode batch's inputs to the next step (instead of seven small PyTorch kernels).

Imported only when the inputs live on a GPU (Triton is not needed on CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from raypp.executor.decode_loop import DecodeInputs

_ROWS_PER_PROGRAM = 256


# rows and stride_table vary per call: specializing on them (``== 1``, ``% 16 == 0``) would
# JIT-compile a new variant mid-serving, e.g. the first time one sequence is decoded alone
@triton.jit(do_not_specialize=["rows", "stride_table"])
def _advance_kernel(tokens_ptr, ids_ptr, pos_ptr, lens_ptr, slot_ptr, tables_ptr, rows,
                    stride_table, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask = r < rows
    pos = tl.load(pos_ptr + r, mask=mask) + 1
    block = tl.load(tables_ptr + r.to(tl.int64) * stride_table + pos // BLOCK_SIZE, mask=mask)
    tl.store(ids_ptr + r, tl.load(tokens_ptr + r, mask=mask), mask=mask)
    tl.store(pos_ptr + r, pos, mask=mask)
    tl.store(lens_ptr + r, tl.load(lens_ptr + r, mask=mask) + 1, mask=mask)
    tl.store(slot_ptr + r, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)


def advance(inputs: DecodeInputs, tokens: torch.Tensor, block_size: int) -> None:
    """In place, as :meth:`DecodeInputs.advance` (rows contiguous, tables row-major)."""
    rows = tokens.shape[0]
    for t in (tokens, inputs.input_ids, inputs.positions, inputs.seq_lens, inputs.slot_mapping):
        assert t.is_contiguous() and t.dtype == torch.int64
    assert inputs.block_tables.stride(1) == 1
    _advance_kernel[(triton.cdiv(rows, _ROWS_PER_PROGRAM),)](
        tokens, inputs.input_ids, inputs.positions, inputs.seq_lens, inputs.slot_mapping,
        inputs.block_tables, rows, inputs.block_tables.stride(0),
        BLOCK_SIZE=block_size, ROWS=_ROWS_PER_PROGRAM, num_warps=4)
