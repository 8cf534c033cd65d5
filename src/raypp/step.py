"""The wire contract between the engine and the stages, and between stages.

A :class:`StepInput` is the compact descriptor of one micro-batch: flat token ids,
each row's sequence id and context length, and how to sample the rows that end a
sequence's query. It holds plain Python lists, so it pickles small and never aliases
a channel buffer. The last stage answers with a :class:`StepOutput` of sampled ids
(and logprobs when asked), again plain lists.

Positions and cache slots do not travel: row ``r`` feeds the last ``q`` tokens of its
context (``q`` from ``query_start``, the context length ``seq_lens[r]``), so its
positions are ``seq_lens[r] - q .. seq_lens[r] - 1`` and its slots follow from its
block table. Each stage derives both when it resolves the step (below).

How a stage runs a step is said by one explicit field, ``mode`` (:class:`StepMode`),
decided by the engine's scheduler (:mod:`raypp.engine.rounds`); no stage re-derives it:

- ``FORWARD``: one forward pass; the last stage samples the rows in ``sample_rows``.
- ``VERIFY``: a ``FORWARD`` some of whose sampled rows end in drafted tokens
  (speculative decoding): sampled row ``r``'s last ``draft_lens[r]`` input tokens are a
  draft; the last stage samples the target at the draft's positions and the one before
  them, accepts the draft while it equals those samples, and returns the accepted
  tokens plus the first sample that differs (or the one after the draft)
  (:mod:`raypp.worker.verifier`).
  With a draft model (:mod:`raypp.worker.draft_runner`) the driver sends the draft's
  positions as placeholders: the first stage's draft model writes its tokens there
  before the target runs, and they travel on with the activations
  (:attr:`StageHandoff.drafts`), so every later stage verifies the same draft.
- ``DECODE_ROUND`` (a one-stage pipeline only): every row feeds one token and samples
  the next, ``num_steps`` times back to back, each sampled token fed back as the next
  input on the device; the last step's tokens stay on the device. A round that
  ``continues`` the one before it takes its input ids from those tokens (row ``r``
  from that round's row ``continue_rows[r]``), so the engine can submit it before the
  earlier round's result returns (asynchronous scheduling).

Block tables travel as changes, not whole per step. Every stage (every TP rank of
it) keeps a mirror of each running sequence's block table, keyed by the engine's
sequence id (unique for the engine's life), and sees every step in submission
order. A step names its rows' sequences (``seq_ids``) and carries only what changed
since the steps before it: ``finished_seq_ids`` (tables to drop: the sequence's
blocks were freed) and then ``block_table_updates``, ``(seq_id, start, entries)``
each, after which that sequence's table is ``table[:start] + entries`` (``start`` 0:
a new table; else ``start`` is the table's length, and it grows). Drops apply before
updates, so a step may drop a sequence's old table and start its new one. A decode
step whose tables did not grow carries no entries at all. A stage resolves the step
against its mirror into a :class:`ResolvedStep` (with each row's whole table, its
positions and cache slots) that only it sees; what it passes on is the step as it
came (:mod:`raypp.worker.block_tables`; the engine side is
:class:`~raypp.engine.step_builder.StepBuilder`).

The token history that penalties need travels the same way, to the last stage only:
``penalty_history_updates`` holds ``(seq_id, prompt, start, tokens)`` for sampled rows
with penalties: ``prompt`` (not ``None``) starts the sequence's history (its prompt,
output empty), then its output tokens from index ``start`` on are ``tokens``; a
sequence sampled again sends only the tokens it gained. ``finished_seq_ids`` drop
histories too (:mod:`raypp.worker.penalty_history`).

Structured outputs travel as masks, never as grammars: the driver advances each
constrained sequence's grammar and sends, per sampled row, the packed bitmask of the
tokens its grammar allows next (``SamplingBatch.token_bitmask``, one bit per vocabulary
entry; :mod:`raypp.engine.structured`), and logit biases as ``(ids, biases)``; the last
stage applies both before sampling (:mod:`raypp.worker.logits_processors`). Only
``FORWARD`` steps carry them: such rows never join a decode round.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class StepMode(enum.Enum):
    """How a stage runs a step (module docstring)."""

    FORWARD = "forward"
    DECODE_ROUND = "decode_round"
    VERIFY = "verify"


@dataclass
class SamplingBatch:
    """Sampling settings, one entry per sampled row (in row order)."""

    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    min_p: list[float]
    seeds: list[int]
    # index of the token being sampled within its sequence's output: keys the RNG
    output_index: list[int]
    num_logprobs: list[int]  # -1: none
    presence_penalty: list[float]
    frequency_penalty: list[float]
    repetition_penalty: list[float]
    # token history for penalties, per row (empty for rows without penalties): filled on
    # the last stage from its history mirror (module docstring); the engine sends none
    prompt_tokens: list[list[int]] = field(default_factory=list)
    output_tokens: list[list[int]] = field(default_factory=list)
    # logits shaping (raypp.worker.logits_processors), each empty when no row has any, else
    # one entry per row: the grammar's allowed next tokens as a packed little-endian int32
    # bitmask (token t allowed iff bit t % 32 of word t // 32 is set; None: unconstrained),
    # and the logit bias as (token ids, biases)
    token_bitmask: list[bytes | None] = field(default_factory=list)
    logit_bias: list[tuple[list[int], list[float]] | None] = field(default_factory=list)

    def penalized(self, row: int) -> bool:
        """True if ``row`` samples with a presence, frequency or repetition penalty."""
        return (self.presence_penalty[row] != 0 or self.frequency_penalty[row] != 0
                or self.repetition_penalty[row] != 1)

    @property
    def any_penalties(self) -> bool:
        return (any(p != 0 for p in self.presence_penalty)
                or any(p != 0 for p in self.frequency_penalty)
                or any(p != 1 for p in self.repetition_penalty))


@dataclass
class StepInput:
    """One micro-batch for all stages (see module docstring)."""

    step_id: int
    input_ids: list[int]
    query_start: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # tokens in context after this step('s first decode step), per row
    seq_ids: list[int]  # the engine's sequence id of each row: keys the stages' block tables
    sample_rows: list[int]  # flat token indices whose next token is sampled
    sampling: SamplingBatch | None
    # what changed in the stages' block tables (module docstring): drops, then updates
    block_table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    # penalized sequences' token history as changes (module docstring): (seq_id, prompt
    # or None, start, output tokens from index start on)
    penalty_history_updates: list[tuple[int, list[int] | None, int, list[int]]] = field(
        default_factory=list)
    mode: StepMode = StepMode.FORWARD
    # VERIFY only: per sampled row, how many of its last input tokens are drafted
    draft_lens: list[int] = field(default_factory=list)
    # with a draft model, per row (or empty: none anywhere): tokens right before the row's
    # first input position whose KV the first stage's draft model lacks; it feeds them first
    draft_catchup: list[list[int]] = field(default_factory=list)
    # DECODE_ROUND only: decode steps to run back to back
    num_steps: int = 1
    # DECODE_ROUND only: step id of the round this one continues; input id r is that
    # round's last sampled token of its row continue_rows[r] (input_ids are placeholders)
    continues: int | None = None
    continue_rows: list[int] = field(default_factory=list)
    # test-only tracing: stages record compute intervals when set
    trace: bool = False
    # when the driver submitted it (wall clock; 0: unknown): stages count their wait for input
    submitted_at: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass(kw_only=True)
class ResolvedStep(StepInput):
    """A :class:`StepInput` as one stage runs it: with each row's whole block table, and
    each token's position and cache slot (of the first decode step, for a round),
    resolved from the stage's mirror (:mod:`raypp.worker.block_tables`). Never sent:
    a stage passes the step it received on, not this."""

    block_tables: list[list[int]]  # per row; read them, never change them
    positions: list[int]  # per token
    slot_mapping: list[int]  # per token: block * block_size + offset

    @classmethod
    def of(cls, step: StepInput, block_tables: list[list[int]], block_size: int
           ) -> ResolvedStep:
        """``step`` with ``block_tables`` (one per row) and the positions and slots they
        give its tokens."""
        if len(step.input_ids) == len(step.seq_lens):  # one token per row: a decode step
            positions = [end - 1 for end in step.seq_lens]
            slots = [table[p // block_size] * block_size + p % block_size
                     for table, p in zip(block_tables, positions)]
        else:
            positions, slots = [], []
            qs = step.query_start
            for r, (table, end) in enumerate(zip(block_tables, step.seq_lens)):
                start = end - (qs[r + 1] - qs[r])
                positions.extend(range(start, end))
                for b in range(start // block_size, (end - 1) // block_size + 1):
                    base = b * block_size  # the block's first position
                    slot0 = table[b] * block_size - base
                    slots.extend(range(slot0 + max(start, base), slot0 + min(end, base + block_size)))
        return cls(**vars(step), block_tables=block_tables, positions=positions,
                   slot_mapping=slots)


@dataclass
class RowLogprobs:
    """Logprobs at one sampled position: top-N plus the sampled token."""

    top_ids: list[int]
    top_logprobs: list[float]
    sampled_logprob: float
    sampled_rank: int


@dataclass
class StepOutput:
    """What the last stage returns: per sampled row, its ``num_steps`` sampled ids (a
    VERIFY row: its accepted drafted ids and one more).

    ``logprobs`` is empty or has one entry per row: ``None`` where not asked for,
    else one :class:`RowLogprobs` per sampled id.
    """

    step_id: int
    token_ids: list[list[int]]
    logprobs: list[list[RowLogprobs] | None] = field(default_factory=list)


@dataclass
class StageHandoff:
    """What a stage that is not last passes to the next stage: the micro-batch's
    descriptor and its activations.

    The activations are one tensor ``[2, tokens, hidden]`` (hidden states, then the
    residual stream), so a hop is one transfer. Built once by :meth:`pack` on the
    sending stage; every consumer (the eager forward, the decode-graph loader, the
    direct plane's loop) reads it through :attr:`hidden_states` and :attr:`residual`,
    so no two paths can spell its parts differently. It travels as is through a
    compiled graph (Ray moves the tensor over ``RayPPCommunicator``, the rest over
    shared memory) and as :meth:`tensors` / :meth:`from_tensors` over the PP group on
    the direct plane, whose step descriptor arrives on its own queue.
    """

    step: StepInput
    packed: torch.Tensor  # [2, tokens, hidden]
    # a VERIFY step's drafted tokens, when the first stage's draft model made them: per
    # sampled row in order, its draft_lens[r] tokens, flat (they replace the step's
    # placeholders on every later stage); None otherwise
    drafts: list[int] | None = None

    @classmethod
    def pack(cls, step: StepInput, hidden_states: torch.Tensor,
             residual: torch.Tensor, drafts: list[int] | None = None) -> StageHandoff:
        import torch

        return cls(step, torch.stack((hidden_states, residual)), drafts)

    @property
    def hidden_states(self) -> torch.Tensor:  # [tokens, hidden]
        return self.packed[0]

    @property
    def residual(self) -> torch.Tensor:  # [tokens, hidden]
        return self.packed[1]

    def tensors(self) -> dict[str, Any]:
        """What to send point to point (``GroupCoordinator.send_tensor_dict``): the
        activations, and the drafts (a plain list: it rides with the metadata)."""
        out: dict[str, Any] = {"packed": self.packed}
        if self.drafts is not None:
            out["drafts"] = self.drafts
        return out

    @classmethod
    def from_tensors(cls, step: StepInput, tensors: dict[str, Any]) -> StageHandoff:
        """Inverse of :meth:`tensors`, given the step descriptor."""
        return cls(step, tensors["packed"], tensors.get("drafts"))
