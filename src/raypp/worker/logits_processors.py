"""Logits shaping on the last stage, before anything else reads the logits: each row's
logit bias, then its grammar's token mask (the ``logit_bias`` and ``token_bitmask``
fields of :class:`~raypp.step.SamplingBatch`).

What callers may rely on:

- :func:`shape_logits` returns ``logits`` itself (untouched) when no row has a bias
  or a mask; otherwise a new float32 tensor in which biased tokens have their bias
  added and every token a row's mask does not allow is ``-inf`` (tokens past the
  mask's length too). Rows with neither keep their values (upcast to float32, which
  changes no order). ``logits`` is never written (it may be a CUDA graph's output).
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
    masked = any(m is not None for m in batch.token_bitmask)
    biased = any(batch.logit_bias)
    if not masked and not biased:
        return logits
    # one new tensor, written once (torch.where), instead of a copy then an in-place fill
    out = apply_token_bitmask(logits, batch.token_bitmask) if masked else logits.float().clone()
    if out.dtype != torch.float32:
        out = out.float()
    if biased:
        add_logit_bias(out, batch.logit_bias)
    return out


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
    # packed: [rows, nbytes] -> [rows, nbytes, 8] -> [rows, nbytes * 8]: bit j of byte i is token 8 i + j
    bits = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8).to(packed.device,
                                                                          non_blocking=True)
    allowed = (packed[:, :, None] & bits).ne(0).view(packed.shape[0], -1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    padded = torch.zeros(packed.shape[0], vocab, dtype=torch.bool, device=packed.device)
    padded[:, :allowed.shape[1]] = allowed
    return padded


def apply_token_bitmask(logits: torch.Tensor, masks: list[bytes | None]) -> torch.Tensor:
    """A new tensor: ``logits`` with the tokens a row's mask does not allow at ``-inf``
    (rows whose mask is ``None`` copied as they are)."""
    rows = [r for r, m in enumerate(masks) if m is not None]
    data = bytearray(b"".join(masks[r] for r in rows))  # type: ignore[misc]
    host = torch.frombuffer(data, dtype=torch.uint8).view(len(rows), -1)
    allowed = unpack_bitmask(host.to(logits.device, non_blocking=True), logits.shape[1])
    if len(rows) == logits.shape[0]:
        return torch.where(allowed, logits, float("-inf"))
    out = logits.clone()
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    out.index_copy_(0, index, torch.where(allowed, out.index_select(0, index), float("-inf")))
    return out
