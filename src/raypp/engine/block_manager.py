"""Paged KV-cache block accounting and the prefix cache (plain Python; the stages hold
the tensors).

Blocks are fixed-size slots of ``block_size`` tokens, identical on every stage
(each stage stores only its layers' share of each block), so a block id means
the same tokens on every stage and TP rank: sharing a block is a driver-side
decision that every stage follows through the block tables.

Reference counts let sequences share blocks. With prefix caching on, a block
that is full and whose KV is computed is *registered* under its content hash
(:mod:`raypp.engine.block_hash`); a new sequence whose leading blocks hash alike
takes those blocks instead of computing them. A block whose count drops to zero
stays registered but counts as free: free blocks form one queue, least recently
released first, and allocation takes from its front, evicting (unregistering)
a cached block only then. Blocks holding nothing reusable go to the front.

What callers may rely on:

- A block is written only by the one sequence that allocated it fresh, at
  positions it has not computed yet; a registered block is never written again
  until it was evicted and allocated anew. So a shared block is only read.
- :meth:`find_cached` never covers a whole sequence: at least its last token is
  left to compute (its logits are needed), and hits are whole blocks.
- ``num_free`` counts every block :meth:`allocate` may take, cached ones included.
- A sequence's ``block_table`` only grows, by appending, until :meth:`free` empties it
  and bumps its ``block_epoch``; :meth:`drain_freed` lists the sequences freed so (the
  step builder tells the stages to drop their copies of those tables).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceABC

from raypp.engine.block_hash import block_hashes
from raypp.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockManager.allocate` when the free list runs out."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # content hash -> the block registered under it
        self._freed: list[int] = []  # ids of sequences whose non-empty tables were freed

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, in use or free."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def hash_of(self, block: int) -> bytes | None:
        """The content hash ``block`` is registered under, or ``None``."""
        return self._hash_of[block]

    # -- allocation ---------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold its first ``num_tokens`` tokens."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, cached: SequenceABC[int] = ()) -> bool:
        """True if :meth:`allocate` with the same arguments would succeed."""
        total = -(-num_tokens // self.block_size)
        fresh = max(0, total - len(seq.block_table) - len(cached))
        revived = sum(1 for block in cached if self._ref_counts[block] == 0)
        return fresh + revived <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int, cached: SequenceABC[int] = ()) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens`` tokens.

        ``cached``: a :meth:`find_cached` result for ``seq``, which must hold no
        blocks yet; its blocks start the table and their tokens count as computed.
        """
        if not self.can_allocate(seq, num_tokens, cached):
            raise NoFreeBlocksError(f"{len(self._free)} blocks free: too few for {num_tokens} tokens")
        if cached:
            assert not seq.block_table, "cached blocks start a sequence's table"
            for block in cached:
                if self._ref_counts[block] == 0:
                    del self._free[block]
                self._ref_counts[block] += 1
            seq.block_table = list(cached)
            seq.num_registered_blocks = len(cached)
            seq.num_computed_tokens = len(cached) * self.block_size
            if seq.num_draft_computed is not None:  # a cached block holds the draft's KV too
                seq.num_draft_computed = seq.num_computed_tokens
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block, _ = self._free.popitem(last=False)
            evicted = self._hash_of[block]
            if evicted is not None:
                del self._cached[evicted]
                self._hash_of[block] = None
            self._ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references and end its table's epoch. Its computed full blocks
        stay cached (see :meth:`register`) until evicted; its other blocks are reused
        first."""
        seq.block_epoch += 1
        if seq.block_table:
            self._freed.append(seq.seq_id)
        self.register(seq)
        for block in reversed(seq.block_table):  # a sequence's tail is evicted before its head
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] >= 0, f"block {block} freed twice"
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._hash_of[block] is None:
                    self._free.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        if seq.num_draft_computed is not None:
            seq.num_draft_computed = 0
        seq.num_registered_blocks = 0

    def drain_freed(self) -> list[int]:
        """Ids of the sequences whose (non-empty) tables :meth:`free` emptied since the
        last call, oldest first; a sequence freed twice is listed twice."""
        freed, self._freed = self._freed, []
        return freed

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of token ``position`` of ``seq``."""
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    # -- the prefix cache ---------------------------------------------------------------
    def find_cached(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest run of ``seq``'s leading full blocks.

        Never all of ``seq``'s tokens: a sequence whose every full block is cached
        still computes its last block's tokens (its last token's logits are
        needed, and a shared block is never written). Empty with caching off.
        Changes nothing (pass the result to :meth:`allocate`).
        """
        if not self.enable_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        if not limit or not self._cached:
            return []
        hits = []
        for block_hash in block_hashes(seq, self.block_size, limit)[:limit]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def register(self, seq: Sequence) -> None:
        """Offer ``seq``'s full blocks whose KV is computed (and whose tokens are
        known; with a draft model, whose draft KV is computed too) to the cache. A
        block whose content is already cached under another block is left out: the
        first one computed serves later sequences."""
        if not self.enable_caching:
            return
        computed = seq.num_computed_tokens
        if seq.num_draft_computed is not None:  # and the draft's KV (Sequence docstring)
            computed = min(computed, seq.num_draft_computed)
        full = min(computed, seq.num_tokens) // self.block_size
        start = seq.num_registered_blocks
        if full <= start:
            return
        hashes = block_hashes(seq, self.block_size, full)
        for i in range(start, full):
            block = seq.block_table[i]
            assert self._hash_of[block] is None, "a sequence computed a cached block"
            if hashes[i] not in self._cached:
                self._cached[hashes[i]] = block
                self._hash_of[block] = hashes[i]
        seq.num_registered_blocks = full

    def reset_cache(self) -> bool:
        """Forget every cached block; False (and nothing forgotten) while a block is in use."""
        if self.num_used:
            return False
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
        return True
