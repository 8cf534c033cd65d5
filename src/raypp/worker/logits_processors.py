"""Logits shaping on the last stage, before anything else reads the logits: each row's
logit bias, then its grammar's token mask (the ``logit_bias`` and ``token_bitmask``
fields of :class:`~raypp.step.SamplingBatch`).

What callers may rely on:

- :func:`shape_logits` returns ``logits`` itself (untouched) when no row has a bias
  or a mask; otherwise a float32 copy in which biased tokens have their bias added
  and every token a row's mask does not allow is ``-inf`` (tokens past the mask's
  length too). Rows with neither keep their values (upcast to float32, which changes
  no order).
- Plain torch ops, the same on CPU and CUDA: the host builds one byte tensor of the
  masks and one of the biases per step, each copied to the device once.

The mask is the driver's (:mod:`raypp.engine.structured`): a packed little-endian
int32 bitmask per row, token ``t`` allowed iff bit ``t % 32`` of word ``t // 32`` is
set. Read as bytes that is bit ``t % 8`` of byte ``t // 8``, which is how it is
unpacked here (8 bits per byte, no per-token gather).
"""

from __future__ import annotations

import torch

from raypp.step import SamplingBatch


def shape_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with ``batch``'s biases and masks applied (module
    docstring)."""
    if not any(batch.logit_bias) and not any(m is not None for m in batch.token_bitmask):
        return logits
    logits = logits.to(torch.float32, copy=True)
    if any(batch.logit_bias):
        add_logit_bias(logits, batch.logit_bias)
    if any(m is not None for m in batch.token_bitmask):
        apply_token_bitmask(logits, batch.token_bitmask)
    return logits


def add_logit_bias(logits: torch.Tensor,
                   biases: list[tuple[list[int], list[float]] | None]) -> None:
    """Add each row's ``(token ids, biases)`` to its logits, in place."""
    rows, tokens, values = [], [], []
    for r, bias in enumerate(biases):
        if bias:
            rows.extend([r] * len(bias[0]))
            tokens.extend(bias[0])
            values.extend(bias[1])
    if not rows:
        return
    index = torch.tensor([rows, tokens], dtype=torch.int64).to(logits.device, non_blocking=True)
    added = torch.tensor(values, dtype=logits.dtype).to(logits.device, non_blocking=True)
    logits.index_put_((index[0], index[1]), added, accumulate=True)


def unpack_bitmask(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` bool: which tokens ``packed`` (``[rows, bytes]`` uint8, the
    bytes of the int32 bitmask) allows; tokens past its last bit are not allowed."""
    # packed: [rows, nbytes] -> bits: [rows, nbytes * 8], bit j of byte i is token 8 i + j
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed[:, :, None] >> shifts).bitwise_and_(1).view(packed.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab].bool()
    allowed = torch.zeros(packed.shape[0], vocab, dtype=torch.bool, device=packed.device)
    allowed[:, :bits.shape[1]] = bits.bool()
    return allowed


def apply_token_bitmask(logits: torch.Tensor, masks: list[bytes | None]) -> None:
    """Set the logits of tokens a row's mask does not allow to ``-inf``, in place;
    rows whose mask is ``None`` are left alone."""
    rows = [r for r, m in enumerate(masks) if m is not None]
    data = bytearray(b"".join(masks[r] for r in rows))  # type: ignore[misc]
    host = torch.frombuffer(data, dtype=torch.uint8).view(len(rows), -1)
    allowed = unpack_bitmask(host.to(logits.device, non_blocking=True), logits.shape[1])
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
