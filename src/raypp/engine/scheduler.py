"""Continuous batching: forms one micro-batch per free pipeline slot.

FCFS. Each call to :meth:`Scheduler.schedule` forms a micro-batch while fewer than
``max_inflight`` are in flight: decode rows of running sequences not in flight first
(at most ``ceil(decodes / max_inflight)``, so decodes spread evenly over the
micro-batches), then the next chunks of running prompts, then waiting sequences while
the token, sequence and block budgets allow (prefills are never held back by the
decode cap). A waiting sequence starts with
the longest run of its leading blocks the prefix cache holds and computes from the
first token after them (always at least its last token). When blocks run out a running
sequence is preempted by recompute (its blocks are freed, the computed ones staying
cached, and it re-enters the waiting queue at the front; its output so far is kept, so
the result is identical to an unpreempted run). Cached blocks nobody uses count as
free: taking one evicts it. A sequence is never in two micro-batches at once, except
that :meth:`Scheduler.continue_batch` may put a decode round's sequences into their
next round while the current one runs (asynchronous scheduling), and that a prompt's
next chunk may enter while its earlier chunks are in flight (chunked pipeline prefill,
:mod:`raypp.engine.chunking`, which says why their KV stays right); results are
completed in submission order. Which micro-batches are decode rounds, of how many steps, and
when one is continued is :mod:`raypp.engine.rounds`'s policy, applied here; what each
sequence has in flight is its ``num_inflight_tokens``.
"""

from __future__ import annotations

from collections import deque

from raypp.config import SchedulerConfig
from raypp.engine import draft_proposer
from raypp.engine.block_manager import BlockManager
from raypp.engine.chunking import ChunkPolicy
from raypp.engine.micro_batch import MicroBatch, ScheduledSeq
from raypp.engine.rounds import RoundPolicy
from raypp.engine.sequence import Sequence, SequenceStatus
from raypp.speculative_config import SpeculativeConfig
from raypp.step import StepMode

__all__ = ["MicroBatch", "ScheduledSeq", "Scheduler"]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 speculative: SpeculativeConfig | None = None, hidden_size: int | None = None):
        if None in (config.max_num_seqs, config.max_num_batched_tokens, config.max_inflight,
                    config.num_decode_steps):
            raise ValueError("the scheduler's limits are unset: SchedulerConfig.size_for(device)")
        self.config = config
        self.rounds = RoundPolicy(config, speculative)
        self.chunks = ChunkPolicy(config, hidden_size)
        self.num_inflight_batches = 0  # scheduled, not yet completed
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # prompt tokens looked up in the prefix cache when first scheduled, and found
        self.prefix_cache_queries = 0
        self.num_overlapped_chunks = 0  # prompt chunks scheduled while earlier ones were in flight
        self.prefix_cache_hits = 0

    # -- queue management ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.rounds.draft_model is not None:
            self.rounds.draft_model.start(seq)
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
        """The next micro-batch, or ``None`` if nothing can run or ``max_inflight``
        micro-batches are in flight.

        The step's token budget goes to decode rows first (running sequences with one
        token to feed; with ``balanced_decode`` at most ``ceil(decodes / max_inflight)``
        of them, so the decodes spread evenly over the micro-batches in flight), then to the next chunks of
        running prompts (one whose earlier chunks are still in flight too, with
        pipelined prefill: :mod:`raypp.engine.chunking`), then to waiting sequences.
        """
        slots = self.config.max_inflight
        if self.num_inflight_batches >= slots:
            return None
        budget = self.config.max_num_batched_tokens
        chosen: list[ScheduledSeq] = []
        decodes = sum(1 for s in self.running if s.num_tokens - s.next_position <= 1)
        decode_cap = max(1, -(-decodes // slots)) if self.config.balanced_decode else decodes
        for seq in list(self.running):  # decode rows (and prompts down to their last token)
            if budget <= 0 or len(chosen) >= decode_cap:
                break
            if seq.in_flight or seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_uncomputed_tokens != 1:
                continue
            draft = self._draft(seq, budget)
            if draft and not self.blocks.can_allocate(seq, seq.num_tokens + len(draft)):
                draft = []  # drafts never preempt anyone
            if not self._reserve(seq, 1 + len(draft), chosen):
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # preempted itself
                break
            chosen.append(self._item(seq, 1, draft))
            budget -= 1 + len(draft)
        for seq in list(self.running):  # chunks of running prompts
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens <= 1:
                continue
            if seq.in_flight and not self.chunks.may_overlap(seq):
                continue
            start = seq.next_position
            n = self.chunks.size(start, seq.num_tokens - start, budget)
            if not self._reserve(seq, n, chosen):
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                break
            self.num_overlapped_chunks += seq.in_flight
            chosen.append(self._item(seq, n))
            budget -= n
        self._admit_waiting(chosen, budget)
        if not chosen:
            return None
        mode, steps = self.rounds.mode(chosen), 1
        limit = self.rounds.max_steps(self.can_admit())
        if mode is StepMode.DECODE_ROUND and limit > 1:
            steps = self._decode_horizon([item.seq for item in chosen], limit)
        return self._launch(MicroBatch(chosen, steps, mode))

    def _admit_waiting(self, chosen: list[ScheduledSeq], budget: int) -> None:
        """Add waiting sequences to ``chosen`` while the token, sequence and block budgets
        allow, each from the longest cached prefix of its prompt."""
        while self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]  # holds no blocks: new, or preempted (it recomputes)
            cached = self.blocks.find_cached(seq)
            start = len(cached) * self.blocks.block_size
            n = self.chunks.size(start, seq.num_tokens - start, budget)
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
            chosen.append(self._item(seq, n))
            budget -= n

    def continue_batch(self, batch: MicroBatch) -> MicroBatch | None:
        """The next round of decode round ``batch`` while it is still in flight, or
        ``None``.

        Its sequences are those of ``batch`` still running that have room for a
        token after the ones they sample in flight; each feeds the last token
        ``batch`` samples (the stage takes it on the device). ``None`` if the round
        policy allows no continuation now (:meth:`RoundPolicy.may_continue`), none of
        its sequences qualifies, or cache blocks for even one step are short (a
        continuation never preempts).
        """
        if not self.rounds.may_continue(batch, self.num_inflight_batches, self.can_admit()):
            return None
        seqs = [item.seq for item in batch.seqs
                if item.seq.status is SequenceStatus.RUNNING
                and self.room(item.seq, item.seq.num_tokens_ahead) > 0]
        if not seqs:
            return None
        steps = self._decode_horizon(seqs, self.rounds.max_steps(can_admit=False))
        if steps == 0:
            return None
        items = [ScheduledSeq(seq, seq.next_position, 1, True) for seq in seqs]
        return self._launch(MicroBatch(items, steps, StepMode.DECODE_ROUND, continues=batch))

    @staticmethod
    def _item(seq: Sequence, n: int, draft: list[int] | None = None) -> ScheduledSeq:
        """``seq`` feeding its next ``n`` tokens from its next position, and ``draft``."""
        start = seq.next_position
        draft = draft or []
        return ScheduledSeq(seq, start, n + len(draft), start + n == seq.num_tokens, draft)

    def _draft(self, seq: Sequence, token_budget: int) -> list[int]:
        """Drafted tokens for decode row ``seq``: no more than the step's token budget
        leaves beside its own token, nor than fit its length limits with the extra
        token a verification samples."""
        return self.rounds.draft(seq, min(token_budget - 1, self.room(seq) - 1))

    def _launch(self, batch: MicroBatch) -> MicroBatch:
        """Count ``batch`` in flight, and each sequence's positions it feeds."""
        self.num_inflight_batches += 1
        drafting = self.rounds.draft_model is not None
        for item in batch.seqs:
            item.seq.num_inflight_tokens += batch.span(item)
            if drafting:
                draft_proposer.launch(item, batch)
        return batch

    def room(self, seq: Sequence, ahead: int = 0) -> int:
        """Tokens ``seq`` may still sample before its length limit (``max_tokens`` or
        ``max_model_len``), after the ``ahead`` it has in flight."""
        room = self.max_model_len - seq.num_tokens - ahead
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - ahead)
        return room

    def _decode_horizon(self, seqs: list[Sequence], limit: int) -> int:
        """Decode steps (at most ``limit``) ``seqs`` may run in one round from their
        next positions, with cache blocks reserved for all.

        No more steps than any sequence could use, none past ``max_model_len``, and
        fewer when free blocks run short (no preemption for look-ahead); 0 when not
        even one step's blocks are free (only possible for a continuation).
        """
        wanted = max(self.room(s, s.num_tokens_ahead) if s.params.max_tokens is not None
                     else limit for s in seqs)
        room = min(self.max_model_len - s.num_tokens - s.num_tokens_ahead for s in seqs)
        steps = max(1, min(limit, wanted, room))

        def needed(n: int) -> int:
            return sum(self.blocks.blocks_needed(s, s.next_position + n) for s in seqs)

        while steps > 1 and needed(steps) > self.blocks.num_free:
            steps -= 1
        if needed(steps) > self.blocks.num_free:
            return 0
        for seq in seqs:
            self.blocks.allocate(seq, seq.next_position + steps)
        return steps

    def _reserve(self, seq: Sequence, n: int, chosen: list[ScheduledSeq]) -> bool:
        """Allocate blocks for ``n`` more tokens after ``seq``'s next position, preempting
        later arrivals if needed."""
        if n == 0:
            return False
        target = seq.next_position + n
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
        seq.num_inflight_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def readmit(self, seq: Sequence) -> None:
        """Put a sequence taken out with :meth:`finish` but not finished (a request held
        back after a pipeline failure: :mod:`raypp.engine.recovery`) at the front of the
        queue; it recomputes."""
        seq.num_inflight_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    # -- results --------------------------------------------------------------------------
    def complete(self, batch: MicroBatch, ok: bool = True,
                 sampled: list[list[int]] | None = None) -> None:
        """Mark a micro-batch's tokens as computed (before appending sampled tokens)
        and offer the blocks this fills to the prefix cache; ``ok=False``: the step
        failed (or was never submitted), nothing it fed counts as computed. Every
        micro-batch scheduled here must be completed, once, in submission order.
        ``sampled``: the step's tokens per sampled row (``StepOutput.token_ids``),
        needed where rows drafted: a row that returns ``a + 1`` tokens had ``a`` of its
        drafted tokens accepted, and only those count as computed.

        After ``k`` decode steps a sequence's input token and the first ``k - 1``
        sampled ones are in the cache; the last sampled one is not.
        """
        self.num_inflight_batches = max(0, self.num_inflight_batches - 1)
        if ok:
            self.rounds.observe(batch)
        block_size = self.blocks.block_size
        caching = self.blocks.enable_caching
        rows = iter(sampled or ())
        for item in batch.seqs:
            seq, span = item.seq, batch.span(item)
            seq.num_inflight_tokens = max(0, seq.num_inflight_tokens - span)
            tokens = next(rows, None) if item.sample and sampled is not None else None
            if ok and seq.status is SequenceStatus.RUNNING:
                if item.draft:
                    assert tokens is not None, "a verification's result is needed"
                    accepted = len(tokens) - 1
                    self.rounds.observe_draft(seq, len(item.draft), accepted)
                    span -= len(item.draft) - accepted  # rejected positions recompute
                seq.num_computed_tokens += span
                draft_proposer.settle(seq)
                # most decode steps fill no block: skip the call (this runs per row per step)
                if caching and seq.num_computed_tokens >= (seq.num_registered_blocks + 1) * block_size:
                    self.blocks.register(seq)
            else:
                draft_proposer.settle(seq)
