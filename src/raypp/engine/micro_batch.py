"""What the scheduler hands the engine: a micro-batch of sequences, each feeding its next
tokens, and how the stages run it (:mod:`raypp.engine.rounds` decides that)."""

from __future__ import annotations

from dataclasses import dataclass

from raypp.engine.sequence import Sequence
from raypp.step import StepMode


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token fed (seq.next_position when scheduled)
    num_tokens: int  # tokens fed (per step of a decode round: 1)
    sample: bool  # this chunk reaches the end: a token is sampled


@dataclass
class MicroBatch:
    seqs: list[ScheduledSeq]
    num_steps: int = 1  # decode steps back to back (> 1 only for a DECODE_ROUND)
    mode: StepMode = StepMode.FORWARD  # how the stages run it (raypp.engine.rounds)
    continues: MicroBatch | None = None  # the round whose last sampled tokens this feeds
    step_id: int | None = None  # set when built (StepBuilder)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def span(self, item: ScheduledSeq) -> int:
        """Positions ``item`` feeds over the whole micro-batch (all its steps)."""
        return item.num_tokens + self.num_steps - 1
