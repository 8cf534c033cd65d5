"""The driver's half of the draft-model proposer: how many tokens a row drafts, and
what the first stage's draft model must feed to keep its KV in step with the target's.

The draft model runs on the first stage, inside the step that verifies its draft
(:mod:`raypp.worker.draft_runner` says why there). The driver cannot know the drafted
tokens when it builds the step, so a drafting row ends in ``k`` placeholders
(:data:`PLACEHOLDER`); the stage replaces them. Everything else about a ``VERIFY``
step is as with the n-gram proposer.

The draft's KV lives in its own cache blocks on the first stage, indexed by the same
block tables as the target's, so a position's draft KV sits in the slot of its target
KV. ``Sequence.num_draft_computed`` counts the leading tokens whose draft KV is in
place. Each micro-batch that is not a decode round runs the draft on the first stage
over every row's fed tokens (prompt chunks included), after the row's *catch-up*: the
tokens between ``num_draft_computed`` and the row's first position. A drafting row
feeds its last token and the first ``k - 1`` drafts to the draft, not the ``k``-th,
so when the target accepts all ``k`` the draft lacks that one position, and the next
step's catch-up feeds it; a decode round runs no draft, and the next step catches up
its tokens. Rejected drafts' draft KV is overwritten later, like the target's.

:func:`launch` advances the count when a micro-batch is scheduled (as if every draft
were accepted: a prompt's next chunk may be scheduled before its earlier ones return);
:func:`settle` clamps it to what the sequence really has once a result is read. Prefix
caching stays exact for the draft too: a block is offered to the cache only once both
caches hold it (:meth:`~raypp.engine.block_manager.BlockManager.register`), so a cache
hit supplies the draft's KV as well, and preemption resets the count with the table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raypp.step import StepMode

if TYPE_CHECKING:
    from raypp.engine.micro_batch import MicroBatch, ScheduledSeq
    from raypp.engine.sequence import Sequence

PLACEHOLDER = 0  # a drafted position's token id until the first stage's draft model fills it


class DraftModelProposer:
    """Drafts ``k`` placeholders for the first stage's draft model to fill."""

    @staticmethod
    def draft(seq: Sequence, k: int) -> list[int]:
        """``k`` placeholder tokens (``k <= 0``: none)."""
        return [PLACEHOLDER] * max(0, k)

    @staticmethod
    def start(seq: Sequence) -> None:
        """``seq`` joins the engine: its draft KV holds nothing yet."""
        if seq.num_draft_computed is None:
            seq.num_draft_computed = 0


def launch(item: ScheduledSeq, batch: MicroBatch) -> None:
    """``item`` was scheduled in ``batch``: set its catch-up tokens and advance its
    sequence's ``num_draft_computed`` to what the first stage's draft will hold after
    the step (a decode round runs no draft: nothing changes)."""
    seq = item.seq
    if batch.mode is StepMode.DECODE_ROUND or seq.num_draft_computed is None:
        item.draft_catchup = []
        return
    start = item.start
    item.draft_catchup = seq.token_ids(min(seq.num_draft_computed, start), start)
    # the draft feeds every fed token but a drafting row's last draft
    seq.num_draft_computed = start + item.num_tokens - (1 if item.draft else 0)


def settle(seq: Sequence) -> None:
    """A result of ``seq`` was read (or its step failed): the draft holds no KV past
    the positions the sequence has computed or in flight."""
    if seq.num_draft_computed is not None:
        seq.num_draft_computed = min(seq.num_draft_computed, seq.next_position)
