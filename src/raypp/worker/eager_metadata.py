"""The attention metadata of an eager forward over a resolved step (the target's and the
draft model's eager forwards build theirs here)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from raypp.model.attention import AttentionMetadata
from raypp.step import ResolvedStep


def attention_metadata(step: ResolvedStep, device: torch.device,
                       on_progress: Callable[[], None] | None = None) -> AttentionMetadata:
    """The attention metadata of an eager forward over ``step`` (``on_progress``: see
    :class:`~raypp.model.attention.AttentionMetadata`)."""
    width = max(len(t) for t in step.block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in step.block_tables],
                          dtype=torch.int64, device=device)
    query_lens = [b - a for a, b in zip(step.query_start, step.query_start[1:])]
    return AttentionMetadata(
        slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64, device=device),
        query_start=step.query_start,
        seq_lens=step.seq_lens,
        block_tables=tables,
        decode_only=all(q == 1 for q in query_lens),
        seq_lens_tensor=torch.tensor(step.seq_lens, dtype=torch.int64, device=device),
        on_progress=on_progress,
    )
