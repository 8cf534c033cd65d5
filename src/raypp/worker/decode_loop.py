"""Several decode steps of a one-stage pipeline in one call, without leaving the device.

After each step the sampled tokens become the next step's input ids, and the
positions, context lengths and cache slots advance by one, all by device ops on
the step's input tensors (which may be a CUDA graph's static buffers). Nothing
waits on the device until every step is queued; one copy brings all sampled ids
back. The engine reserved cache blocks for every step beforehand. The last
step's tokens stay on the device too, as a following round's input ids
(:attr:`DecodeRun.last_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from raypp.model.attention import AttentionMetadata
from raypp.step import ResolvedStep, RowLogprobs
from raypp.worker.sampler import (
    SamplingTensors,
    logprob_stats,
    row_logprobs,
    sample_tokens,
    sampled_logprobs,
)


@dataclass
class DecodeInputs:
    """The per-step input tensors of a decode batch (one row per sequence)."""

    input_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor  # context length including this step's token
    block_tables: torch.Tensor  # [rows, width] int64, covering every step's slot

    @classmethod
    def from_step(cls, step: ResolvedStep, device: torch.device) -> DecodeInputs:
        width = max(len(t) for t in step.block_tables)
        tables = [t + [0] * (width - len(t)) for t in step.block_tables]
        ints = torch.tensor([step.input_ids, step.positions, step.slot_mapping, step.seq_lens],
                            dtype=torch.int64).to(device)
        return cls(ints[0], ints[1], ints[2], ints[3],
                   torch.tensor(tables, dtype=torch.int64, device=device))

    def metadata(self) -> AttentionMetadata:
        """Decode metadata over these tensors (it reads them at call time)."""
        n = self.input_ids.shape[0]
        return AttentionMetadata(slot_mapping=self.slot_mapping, query_start=list(range(n + 1)),
                                 seq_lens=[], block_tables=self.block_tables, decode_only=True,
                                 seq_lens_tensor=self.seq_lens)

    def kernel_tensors(self) -> Any:
        """These tensors as :class:`raypp.kernels.sampling.DecodeTensors` (CUDA only)."""
        from raypp.kernels.sampling import DecodeTensors

        return DecodeTensors(self.input_ids, self.positions, self.seq_lens, self.slot_mapping,
                             self.block_tables)

    def advance(self, tokens: torch.Tensor, block_size: int) -> None:
        """Make these the inputs of the next step, whose tokens are ``tokens``."""
        if tokens.is_cuda:  # one Triton launch instead of seven small kernels
            from raypp.kernels import sampling

            sampling.advance(self.kernel_tensors(), tokens, block_size)
            return
        self.input_ids.copy_(tokens)
        self.positions.add_(1)
        self.seq_lens.add_(1)
        blocks = self.block_tables.gather(1, (self.positions // block_size)[:, None])[:, 0]
        torch.add(self.positions % block_size, blocks, alpha=block_size, out=self.slot_mapping)


@dataclass
class DecodeRun:
    """What :func:`run_decode_steps` sampled."""

    token_ids: list[list[int]]  # per row, its num_steps ids
    logprobs: list[list[RowLogprobs] | None]  # per row, None unless asked for
    last_tokens: torch.Tensor  # [rows] int64 on the device: the last step's ids


def run_decode_steps(forward: Callable[[], torch.Tensor], inputs: DecodeInputs,
                     sampling: SamplingTensors, num_steps: int, block_size: int) -> DecodeRun:
    """Run ``num_steps`` decode steps; per row, its sampled ids and (if asked) logprobs.

    ``forward()`` runs the model on ``inputs`` as they are now and returns the
    rows' logits ``[rows, vocab]``. An all-greedy batch on CUDA without logprobs
    takes two Triton launches per step after the forward (argmax and advance fused).
    """
    if sampling.all_greedy and not sampling.wants_logprobs and inputs.input_ids.is_cuda:
        return _greedy_cuda_steps(forward, inputs, num_steps, block_size)
    tokens: list[torch.Tensor] = []
    stats: list[tuple[torch.Tensor, ...]] = []
    for j in range(num_steps):
        logits = forward()
        sampled = sample_tokens(logits, sampling, offset=j)
        if sampling.wants_logprobs:
            stats.append(sampled_logprobs(logprob_stats(logits, sampling), sampled))
        tokens.append(sampled)
        if j + 1 < num_steps:
            inputs.advance(sampled, block_size)
    token_ids = torch.stack(tokens, dim=1).tolist()
    if not stats:
        return DecodeRun(token_ids, [None] * len(token_ids), tokens[-1])
    per_step = [row_logprobs(*s, sampling.num_logprobs) for s in stats]
    return DecodeRun(token_ids, [None if per_step[0][r] is None else [lp[r] for lp in per_step]
                                 for r in range(len(token_ids))], tokens[-1])


def _greedy_cuda_steps(forward: Callable[[], torch.Tensor], inputs: DecodeInputs,
                       num_steps: int, block_size: int) -> DecodeRun:
    from raypp.kernels.sampling import EMPTY_KEY, greedy_step

    rows = inputs.input_ids.shape[0]
    device = inputs.input_ids.device
    out = torch.empty(rows, num_steps, dtype=torch.int64, device=device)
    keys = torch.full((rows,), EMPTY_KEY, dtype=torch.int64, device=device)
    for j in range(num_steps):
        greedy_step(forward(), keys, out[:, j],
                    inputs.kernel_tensors() if j + 1 < num_steps else None, block_size)
    return DecodeRun(out.tolist(), [None] * rows, out[:, -1])
