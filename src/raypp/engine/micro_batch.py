"""What the scheduler hands the engine: a micro-batch of sequences, each feeding its next
tokens, and how the stages run it (:mod:`raypp.engine.rounds` decides that)."""

from __future__ import annotations

from dataclasses import dataclass, field

from raypp.engine.sequence import Sequence
from raypp.step import StepMode


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token fed (seq.next_position when scheduled)
    num_tokens: int  # tokens fed (per step of a decode round: 1), drafted ones included
    sample: bool  # this chunk reaches the end: a token is sampled
    # drafted tokens fed after the sequence's last one, for the target to verify
    # (raypp.engine.speculative); the row then samples len(draft) + 1 positions
    draft: list[int] = field(default_factory=list)
    # with a draft model: tokens before ``start`` the first stage's draft must feed first
    # (raypp.engine.draft_proposer; set when launched)
    draft_catchup: list[int] = field(default_factory=list)

    @property
    def first_sampled(self) -> int:
        """Index in the sequence of the first token this row samples."""
        return self.start + self.num_tokens - len(self.draft)


@dataclass
class MicroBatch:
    seqs: list[ScheduledSeq]
    num_steps: int = 1  # decode steps back to back (> 1 only for a DECODE_ROUND)
    # FORWARD, a DECODE_ROUND, or a VERIFY (a FORWARD some of whose rows end in drafts)
    mode: StepMode = StepMode.FORWARD  # how the stages run it (raypp.engine.rounds)
    continues: MicroBatch | None = None  # the round whose last sampled tokens this feeds
    step_id: int | None = None  # set when built (StepBuilder)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def span(self, item: ScheduledSeq) -> int:
        """Positions ``item`` feeds over the whole micro-batch (all its steps)."""
        return item.num_tokens + self.num_steps - 1
