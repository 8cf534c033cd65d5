"""How much memory a stage's KV cache takes, and the allocation itself.

What callers may rely on: :func:`cpu_budget` is what a CPU worker takes when
``kv_cache_memory_bytes`` is left unset — :data:`CPU_FRACTION` of the memory the host
has available once every stage loaded its weights, split evenly between the stage
workers on that host, and never more than the scheduler can fill (``max_num_seqs``
sequences of ``max_model_len`` tokens). :func:`zeros` returns a zeroed tensor; on CPU
its pages are untouched until used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

_GIB = 2**30
CPU_FRACTION = 0.25  # of the host's available memory, for all its stages' KV caches


@dataclass(frozen=True)
class KVBudget:
    """How many KV blocks a worker can hold, and the numbers behind it."""

    blocks: int
    budget_bytes: int
    block_bytes: int
    source: str  # where the budget comes from, for messages

    @classmethod
    def of(cls, budget: float, block_bytes: int, source: str) -> KVBudget:
        return cls(max(0, int(budget // block_bytes)), max(0, int(budget)), block_bytes, source)

    def explain(self) -> str:
        return (f"{self.budget_bytes / _GIB:.2f} GiB for the KV cache ({self.source}), "
                f"{self.block_bytes} bytes per block")


def cpu_budget(available_bytes: int, workers_on_host: int, block_bytes: int,
               max_blocks_used: int) -> KVBudget:
    """The default CPU budget (see the module docstring); ``max_blocks_used`` is the most
    blocks the scheduler can hold at once (``max_num_seqs`` full-length sequences)."""
    share = CPU_FRACTION * available_bytes / workers_on_host
    source = (f"default: {CPU_FRACTION:.0%} of the {available_bytes / _GIB:.1f} GiB this host has "
              f"available, shared by {workers_on_host} stage worker(s); kv_cache_memory_bytes "
              "(--kv-cache-memory) sets it")
    most = max_blocks_used * block_bytes
    if most < share:
        share = most
        source += "; capped at max_num_seqs sequences of max_model_len tokens"
    return KVBudget.of(share, block_bytes, source)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor for the KV cache."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # calloc'd memory: the kernel zero-fills each page on first touch, so a large CPU cache
    # costs no start-up time and no resident memory until it is used (torch.zeros writes it all)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64  # 64-byte aligned, as torch's own allocator
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)
