"""Prefill chunks: how much of a long prompt one step feeds, and whether its next chunk
may enter the pipeline while earlier ones are still in it (chunked pipeline prefill).

With ``pp`` stages and ``pipelined_prefill`` on, a prompt's chunk ``k + 1`` may be
scheduled while chunk ``k`` is in flight, so stage 0 computes chunk ``k + 1`` while stage
1 computes chunk ``k``: up to ``max_inflight`` chunks of one prompt are in the pipeline
at once, and its first token comes sooner. What keeps their KV right is order: every
stage runs the micro-batches in the order they were submitted (the compiled graph
executes its submissions in order on each actor; on the direct plane each worker's
loop takes steps from its queue in order), so chunk ``k`` has written its KV on a stage
before chunk ``k + 1`` attends over it there. The driver counts a chunk's tokens as
computed only when its result returns, in submission order, so the prefix cache
registers only blocks whose KV every stage holds (a cached prefix is skipped, the rest
chunked after it); a chunk in flight is never preempted (its sequence is in flight); a
failed chunk fails its request, and chunks of it still in flight are dropped on return
(their sequence is no longer running). Decode rounds (multi-step, or continued ahead
with asynchronous scheduling) hold only decode rows, never a prompt chunk, and go
through the same ordered queues. When a stage dies, every micro-batch in flight fails
together and the new stages hold no KV: a re-queued prompt is prefilled again from its
start (or from what the prefix cache of the new stages holds, nothing at first).

Sizes: at most ``long_prefill_chunk_tokens`` (default with pipelined prefill: the step's
token budget over the stages, so a prompt that fills a step spreads over every stage),
never more than the step's budget leaves after its decode rows (which are scheduled
first: a long prompt never starves decodes). With ``balanced_prefill_chunks``, later
chunks shrink as the context they attend over grows, so each costs about the same
stage time as the first: a token at position ``p`` is taken to cost ``1 + p / C``
linear-layer units, ``C = ATTENTION_BREAK_EVEN * hidden_size`` being the context at
which a token's attention costs what its linear layers do (attention ``4 p h`` FLOPs
per layer against ``~29 h^2`` for a Llama block's projections and MLP).
"""

from __future__ import annotations

import math

from raypp.config import SchedulerConfig
from raypp.engine.sequence import Sequence

ATTENTION_BREAK_EVEN = 7  # ~29 h^2 / 4 h, rounded
MIN_CHUNK_TOKENS = 16


class ChunkPolicy:
    """Chunk sizes and overlap for one scheduler (module docstring). ``config`` is sized;
    ``hidden_size``: the model's (``None``: chunks are not balanced by cost)."""

    def __init__(self, config: SchedulerConfig, hidden_size: int | None = None):
        budget = config.max_num_batched_tokens
        assert budget is not None and config.max_inflight is not None
        stages = 1 if config.device_loops else config.max_inflight
        self.pipelined = config.pipelined_prefill and stages > 1
        default = -(-budget // stages) if self.pipelined else budget
        self.limit = min(config.long_prefill_chunk_tokens or default, budget)
        self.scale = (ATTENTION_BREAK_EVEN * hidden_size
                      if hidden_size and self.pipelined and config.balanced_prefill_chunks
                      else None)

    def may_overlap(self, seq: Sequence) -> bool:
        """True if ``seq``, with chunks of its prompt in flight, may get its next chunk
        now (it has prompt tokens that no micro-batch feeds yet)."""
        return self.pipelined and seq.num_tokens > seq.next_position

    def size(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq``'s prompt to feed next from its next position, with ``budget``
        tokens left in the step (at least 1 if ``budget`` is)."""
        start = seq.next_position
        n = min(seq.num_tokens - start, budget, self.limit)
        if self.scale is None or n <= MIN_CHUNK_TOKENS:
            return n
        return min(n, max(MIN_CHUNK_TOKENS, self._balanced(start)))

    def _balanced(self, start: int) -> int:
        """Tokens from ``start`` that cost what ``limit`` tokens from position 0 do."""
        c = self.scale
        assert c is not None
        target = self.limit * (1 + self.limit / (2 * c))
        # n (1 + (start + n / 2) / c) = target  ->  n^2 / (2c) + n (1 + start / c) - target = 0
        b = 1 + start / c
        return int(c * (-b + math.sqrt(b * b + 2 * target / c)))
