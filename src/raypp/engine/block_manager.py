"""Paged KV-cache block accounting (plain Python; the stages hold the tensors).

Blocks are fixed-size slots of ``block_size`` tokens, identical on every stage
(each stage stores only its layers' share of each block). Reference counts let a
block be shared; a block returns to the free list when its count drops to zero.
"""

from __future__ import annotations

from collections import deque

from raypp.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockManager.allocate` when the free list runs out."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold its first ``num_tokens`` tokens."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens`` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise NoFreeBlocksError(f"need {needed} blocks, {len(self._free)} free")
        for _ in range(needed):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            seq.block_table.append(block)

    def share(self, block: int) -> None:
        """Take one more reference to an allocated block."""
        assert self._ref_counts[block] > 0, f"block {block} is not allocated"
        self._ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; its cached tokens are forgotten."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] >= 0, f"block {block} freed twice"
            if self._ref_counts[block] == 0:
                self._free.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token ``position`` of ``seq``."""
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size
