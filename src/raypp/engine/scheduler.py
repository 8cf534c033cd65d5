"""Continuous batching: forms one micro-batch per free pipeline slot.

FCFS. Each call to :meth:`Scheduler.schedule` picks sequences that are not
already in flight: running sequences first (one decode token, or the next chunk
of a long prompt), then waiting ones while the token, sequence and block budgets
allow. A waiting sequence starts with the longest run of its leading blocks the
prefix cache holds and computes from the first token after them (always at least
its last token). When blocks run out a running sequence is preempted by
recompute (its blocks are freed, the computed ones staying cached, and it
re-enters the waiting queue at the front; its output so far is kept, so the
result is identical to an unpreempted run). Cached blocks nobody uses count as
free: taking one evicts it. A sequence is never in two micro-batches at once,
except that :meth:`Scheduler.continue_batch` may put a decode batch's sequences
into their next round while the current one runs (asynchronous scheduling);
results are completed in submission order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from raypp.config import SchedulerConfig
from raypp.engine.block_manager import BlockManager
from raypp.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens fed this step, starting at seq.num_computed_tokens
    sample: bool  # this chunk reaches the end: a token is sampled


@dataclass
class MicroBatch:
    seqs: list[ScheduledSeq]
    # decode steps run back to back (> 1 only when every sequence is decoding)
    num_steps: int = 1
    # tokens each sequence samples in the round this one continues (0: not a continuation)
    ahead: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        if None in (config.max_num_seqs, config.max_num_batched_tokens, config.max_inflight,
                    config.num_decode_steps):
            raise ValueError("the scheduler's limits are unset: SchedulerConfig.size_for(device)")
        self.config = config
        # the most decode steps a round may take now: num_decode_steps, or fewer while the
        # engine sizes rounds by time (SchedulerConfig.adaptive_rounds)
        self.round_steps = 1 if config.adaptive_rounds else config.num_decode_steps
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # prompt tokens looked up in the prefix cache when first scheduled, and found
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queue management ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence and free its blocks (the computed
        full ones stay in the prefix cache)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """True if a waiting sequence could join the next scheduled batch (by count)."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- forming a micro-batch -------------------------------------------------------------
    def schedule(self) -> MicroBatch | None:
        """The next micro-batch of sequences not in flight, or ``None`` if none can run."""
        slots = self.config.max_inflight
        active = min(self.num_active, self.config.max_num_seqs)
        seq_cap = max(1, -(-active // slots))  # spread sequences evenly over the slots
        token_budget = self.config.max_num_batched_tokens
        chosen: list[ScheduledSeq] = []

        for seq in list(self.running):
            if len(chosen) >= seq_cap or token_budget <= 0:
                break
            if seq.in_flight or seq.status is not SequenceStatus.RUNNING:
                continue
            n = self._chunk(seq, token_budget)
            if not self._reserve(seq, n, chosen):
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # preempted itself
                break
            chosen.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            token_budget -= n

        while self.waiting and len(chosen) < seq_cap and token_budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]  # holds no blocks: new, or preempted (it recomputes)
            cached = self.blocks.find_cached(seq)
            start = len(cached) * self.blocks.block_size
            n = min(seq.num_tokens - start, token_budget)
            if not self.blocks.can_allocate(seq, start + n, cached):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, start + n, cached)
            if seq.num_cached_tokens is None:  # first scheduled: what the cache supplied
                seq.num_cached_tokens = start
                if self.blocks.enable_caching:
                    self.prefix_cache_queries += seq.num_tokens
                    self.prefix_cache_hits += start
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
            token_budget -= n

        if not chosen:
            return None
        for item in chosen:
            item.seq.in_flight += 1
        steps = 1
        # several decode steps per round only while no waiting request could join a batch:
        # a round of K steps would hold its prefill back for K steps
        if (self.round_steps > 1 and not self.can_admit()
                and all(_loops_on_device(item) for item in chosen)):
            steps = self._decode_horizon([item.seq for item in chosen], ahead=0)
        return MicroBatch(chosen, steps)

    def continue_batch(self, batch: MicroBatch) -> MicroBatch | None:
        """The next round of decode ``batch`` while it is still in flight, or ``None``.

        Its sequences are those of ``batch`` still running that have room for a
        token after ``batch``'s; each feeds the last token ``batch`` samples (the
        stage takes it on the device). ``None`` if ``batch`` is not a device-side
        decode round, none of its sequences qualifies, or cache blocks for even one
        step are short (a continuation never preempts).
        """
        if not all(_loops_on_device(item) for item in batch.seqs):
            return None
        ahead = batch.num_steps
        seqs = [item.seq for item in batch.seqs
                if item.seq.status is SequenceStatus.RUNNING and self.room(item.seq, ahead) > 0]
        if not seqs:
            return None
        steps = self._decode_horizon(seqs, ahead)
        if steps == 0:
            return None
        for seq in seqs:
            seq.in_flight += 1
        return MicroBatch([ScheduledSeq(seq, 1, True) for seq in seqs], steps, ahead)

    def room(self, seq: Sequence, ahead: int = 0) -> int:
        """Tokens ``seq`` may still sample before its length limit (``max_tokens`` or
        ``max_model_len``), after the ``ahead`` it has in flight."""
        room = self.max_model_len - seq.num_tokens - ahead
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - ahead)
        return room

    def _decode_horizon(self, seqs: list[Sequence], ahead: int) -> int:
        """Decode steps ``seqs`` may run in one go, with cache blocks reserved for all.

        ``ahead``: tokens each sequence samples in flight before this round. No
        more steps than any sequence could use, none past ``max_model_len``, and
        fewer when free blocks run short (no preemption for look-ahead); 0 when
        not even one step's blocks are free (only possible with ``ahead``).
        """
        limit = self.round_steps
        wanted = max(self.room(s, ahead) if s.params.max_tokens is not None else limit
                     for s in seqs)
        room = min(self.max_model_len - s.num_tokens - ahead for s in seqs)
        steps = max(1, min(limit, wanted, room))

        def needed(n: int) -> int:
            return sum(self.blocks.blocks_needed(s, s.num_tokens + ahead + n - 1) for s in seqs)

        while steps > 1 and needed(steps) > self.blocks.num_free:
            steps -= 1
        if needed(steps) > self.blocks.num_free:
            return 0
        for seq in seqs:
            self.blocks.allocate(seq, seq.num_tokens + ahead + steps - 1)
        return steps

    @staticmethod
    def _chunk(seq: Sequence, token_budget: int) -> int:
        # Long prompts are prefilled in chunks that fit the step's token budget.
        return min(seq.num_uncomputed_tokens, token_budget)

    def _reserve(self, seq: Sequence, n: int, chosen: list[ScheduledSeq]) -> bool:
        """Allocate blocks for ``n`` more tokens, preempting later arrivals if needed."""
        if n == 0:
            return False
        target = seq.num_computed_tokens + n
        while not self.blocks.can_allocate(seq, target):
            victim = self._preemption_victim(exclude={id(s.seq) for s in chosen} | {id(seq)})
            if victim is None:
                if not any(s.in_flight for s in self.running) and not chosen:
                    self._preempt(seq)  # nothing else to take from: wait for room
                return False
            self._preempt(victim)
        self.blocks.allocate(seq, target)
        return True

    def _preemption_victim(self, exclude: set[int]) -> Sequence | None:
        for seq in reversed(self.running):  # latest arrival first
            if not seq.in_flight and id(seq) not in exclude:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """Send a running sequence back to the front of the queue; it will recompute."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.in_flight = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    # -- results --------------------------------------------------------------------------
    def complete(self, batch: MicroBatch, ok: bool = True) -> None:
        """Mark a micro-batch's tokens as computed (before appending sampled tokens)
        and offer the blocks this fills to the prefix cache; ``ok=False``: the step
        failed, nothing it fed counts as computed.

        After ``k`` decode steps a sequence's input token and the first ``k - 1``
        sampled ones are in the cache; the last sampled one is not.
        """
        block_size = self.blocks.block_size
        caching = self.blocks.enable_caching
        for item in batch.seqs:
            seq = item.seq
            seq.in_flight = max(0, seq.in_flight - 1)
            if ok and seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += item.num_tokens + batch.num_steps - 1
                # most decode steps fill no block: skip the call (this runs per row per step)
                if caching and seq.num_computed_tokens >= (seq.num_registered_blocks + 1) * block_size:
                    self.blocks.register(seq)


def _loops_on_device(item: ScheduledSeq) -> bool:
    """True if ``item`` can decode on the device across steps: it feeds exactly its
    last token and samples without penalties (those need the tokens on the host)."""
    return item.num_tokens == 1 and item.sample and not item.seq.params.uses_penalties
