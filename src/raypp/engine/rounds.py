"""Decode rounds: the one owner of how a micro-batch runs on the stages and how long.

A *round* is a micro-batch whose every row feeds one token and samples the next
without penalties, on a one-stage pipeline: the stage can then run it as
:attr:`~raypp.step.StepMode.DECODE_ROUND`, several decode steps back to back with
each sampled token fed back on the device, and keep the last step's tokens there for
a round that *continues* it (asynchronous scheduling: the engine submits the next
round before it reads this one's result). Every other micro-batch is a plain
``FORWARD``. :class:`RoundPolicy` decides:

- which micro-batches are rounds (:meth:`RoundPolicy.mode`),
- how many steps a round may take now (:meth:`RoundPolicy.max_steps`): the
  configured ``num_decode_steps``, or, with engine-sized rounds, as many as fill about
  :data:`~raypp.config.ROUND_TARGET_S` at the step time measured so far
  (:meth:`RoundPolicy.observe`); one step while a waiting request could join a
  batch (a round of K steps would hold its prefill back for K steps),
- whether a round may be continued before its result is read
  (:meth:`RoundPolicy.may_continue`).

- with speculative decoding, which decode rows carry drafted tokens and how many
  (:meth:`RoundPolicy.draft`, :mod:`raypp.engine.speculative`): a micro-batch with a
  draft is a ``VERIFY`` step (one step, never continued ahead: the driver needs the
  accepted tokens before it can draft again); one with none may still be a round, and
  one of rows that have been drafting nothing ("quiet") may be continued ahead for a
  few rounds before they look for drafts again.

The scheduler owns one policy and applies it; the block reservation for a round's
steps, and which sequences join, stay the scheduler's. What a sequence has in flight
is one count on the sequence (:attr:`~raypp.engine.sequence.Sequence.num_inflight_tokens`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from raypp.config import ROUND_TARGET_S, SchedulerConfig
from raypp.engine.draft_proposer import DraftModelProposer
from raypp.engine.speculative import QUIET_CHAIN_ROUNDS, QUIET_ROUND_STEPS, Speculator
from raypp.speculative_config import SpeculativeConfig
from raypp.step import StepMode

if TYPE_CHECKING:
    from raypp.engine.micro_batch import MicroBatch, ScheduledSeq
    from raypp.engine.sequence import Sequence


class RoundPolicy:
    """Round decisions for one scheduler (module docstring). ``config`` is sized
    (:meth:`SchedulerConfig.size_for`)."""

    def __init__(self, config: SchedulerConfig, speculative: SpeculativeConfig | None = None):
        self.speculator = None if speculative is None else Speculator(speculative)
        self.device_loops = config.device_loops
        self.continues = config.rounds_ahead > 0
        self.chain = 0  # rounds continued ahead since the last fresh one
        self.limit = config.num_decode_steps  # the most steps a round ever takes
        self.adaptive = config.adaptive_rounds
        # the most steps a round may take now: sized by observe() when adaptive
        self.steps = 1 if self.adaptive else self.limit
        self.step_s: float | None = None  # decode step time, averaged (adaptive rounds)
        self._last_result_at = 0.0

    @staticmethod
    def loops_on_device(item: ScheduledSeq) -> bool:
        """True if ``item`` feeds exactly its last token and samples without penalties
        (those need the token history on the host), a grammar or a logit bias (the
        driver builds each token's mask from the tokens before it, so a constrained
        row takes one FORWARD step per round trip and is never continued ahead): a row
        a round can carry."""
        params = item.seq.params
        return (item.num_tokens == 1 and item.sample and not params.uses_penalties
                and not params.shapes_logits)

    def mode(self, items: list[ScheduledSeq]) -> StepMode:
        """``DECODE_ROUND`` if the stage can run these rows as a round, ``VERIFY`` if a row
        carries a draft, else ``FORWARD``."""
        if self.device_loops and all(self.loops_on_device(i) for i in items):
            return StepMode.DECODE_ROUND
        if any(item.draft for item in items):
            return StepMode.VERIFY
        return StepMode.FORWARD

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        """Drafted tokens for decode row ``seq`` (at most ``limit``); none without
        speculative decoding."""
        return [] if self.speculator is None else self.speculator.draft(seq, limit)

    @property
    def draft_model(self) -> DraftModelProposer | None:
        """The draft-model proposer, when the first stage runs a draft model."""
        return None if self.speculator is None else self.speculator.draft_model

    def observe_draft(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verification of ``seq`` accepted ``accepted`` of ``drafted`` tokens."""
        if self.speculator is not None:
            self.speculator.observe(seq, drafted, accepted)

    def max_steps(self, can_admit: bool) -> int:
        """Steps a new round may take now; ``can_admit``: a waiting request could join a
        batch (then one step, so its prefill is not held back). With speculative
        decoding at most ``QUIET_ROUND_STEPS``: a round's rows look for no drafts."""
        if can_admit:
            return 1
        return self.steps if self.speculator is None else min(self.steps, QUIET_ROUND_STEPS)

    def may_continue(self, batch: MicroBatch, batches_in_flight: int, can_admit: bool) -> bool:
        """True if ``batch``'s next round may be submitted before ``batch``'s result is
        read: asynchronous scheduling is on, ``batch`` is a round and the only
        micro-batch in flight, and no waiting request could join a fresh batch instead.
        With speculative decoding a continued round's rows cannot draft (their tokens
        are in flight), so only a round of quiet rows continues
        (:meth:`Speculator.quiet`), and for at most ``QUIET_CHAIN_ROUNDS`` rounds in a
        row before they look for drafts again."""
        if batch.continues is None:
            self.chain = 0
        if not (self.continues and batch.mode is StepMode.DECODE_ROUND
                and batches_in_flight == 1 and not can_admit):
            return False
        if self.speculator is not None and (
                self.chain >= QUIET_CHAIN_ROUNDS
                or not self.speculator.quiet([item.seq for item in batch.seqs])):
            return False
        self.chain += 1
        return True

    def observe(self, batch: MicroBatch) -> None:
        """``batch``'s result was just read. With engine-sized rounds, a round that
        continued the previous one (the stage started it as that one ended) measures
        the decode step time: the time between the two results over its steps; later
        rounds take as many steps as fill about ``ROUND_TARGET_S`` at the average."""
        now = time.perf_counter()
        since, self._last_result_at = self._last_result_at, now
        if not self.adaptive or batch.continues is None:
            return
        per_step = (now - since) / batch.num_steps
        average = self.step_s
        self.step_s = per_step if average is None else 0.7 * average + 0.3 * per_step
        self.steps = max(1, min(self.limit, int(ROUND_TARGET_S / max(self.step_s, 1e-6))))
