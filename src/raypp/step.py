"""The wire contract between the engine and the stages, and between stages.

A :class:`StepInput` is the compact descriptor of one micro-batch: flat token
ids and positions, where those tokens go in the paged cache, and how to sample
the rows that end a sequence's query. It holds plain Python lists, so it pickles
small and never aliases a channel buffer. The last stage answers with a
:class:`StepOutput` of sampled ids (and logprobs when asked), again plain lists.
A pure decode micro-batch may ask for several decode steps at once (``num_steps``),
and a decode round may continue the previous round of the same sequences
(``continues``): its input ids are then that round's last sampled tokens, which
the stage still holds on the device, so the engine can submit it before they return.

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
against its mirror into a :class:`ResolvedStep` (with each row's whole table) that
only it sees; what it passes on is the step as it came
(:mod:`raypp.worker.block_tables`; the engine side is
:class:`~raypp.engine.step_builder.StepBuilder`).

The token history that penalties need travels the same way, to the last stage only:
``penalty_history_updates`` holds ``(seq_id, prompt, start, tokens)`` for sampled rows
with penalties: ``prompt`` (not ``None``) starts the sequence's history (its prompt,
output empty), then its output tokens from index ``start`` on are ``tokens``; a
sequence sampled again sends only the tokens it gained. ``finished_seq_ids`` drop
histories too (:mod:`raypp.worker.penalty_history`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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
    positions: list[int]
    query_start: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # tokens in context after this step, per sequence
    seq_ids: list[int]  # the engine's sequence id of each row: keys the stages' block tables
    slot_mapping: list[int]
    sample_rows: list[int]  # flat token indices whose next token is sampled
    sampling: SamplingBatch | None
    # what changed in the stages' block tables (module docstring): drops, then updates
    block_table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    # penalized sequences' token history as changes (module docstring): (seq_id, prompt
    # or None, start, output tokens from index start on)
    penalty_history_updates: list[tuple[int, list[int] | None, int, list[int]]] = field(
        default_factory=list)
    # decode steps to run back to back (> 1 only for pure decode on a one-stage pipeline):
    # the stage feeds each sampled token back as the next input on the device
    num_steps: int = 1
    # step id of the decode round this one continues (one-stage pipeline): input id r is
    # that round's last sampled token of its row continue_rows[r] (input_ids are placeholders)
    continues: int | None = None
    continue_rows: list[int] = field(default_factory=list)
    # test-only tracing: stages record compute intervals when set
    trace: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass(kw_only=True)
class ResolvedStep(StepInput):
    """A :class:`StepInput` as one stage runs it: with each row's whole block table,
    resolved from the stage's mirror (:mod:`raypp.worker.block_tables`). Never sent:
    a stage passes the step it received on, not this."""

    block_tables: list[list[int]]  # per row; read them, never change them

    @classmethod
    def of(cls, step: StepInput, block_tables: list[list[int]]) -> ResolvedStep:
        return cls(**{**vars(step), "block_tables": block_tables})


@dataclass
class RowLogprobs:
    """Logprobs at one sampled position: top-N plus the sampled token."""

    top_ids: list[int]
    top_logprobs: list[float]
    sampled_logprob: float
    sampled_rank: int


@dataclass
class StepOutput:
    """What the last stage returns: per sampled row, its ``num_steps`` sampled ids.

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

    @classmethod
    def pack(cls, step: StepInput, hidden_states: torch.Tensor,
             residual: torch.Tensor) -> StageHandoff:
        import torch

        return cls(step, torch.stack((hidden_states, residual)))

    @property
    def hidden_states(self) -> torch.Tensor:  # [tokens, hidden]
        return self.packed[0]

    @property
    def residual(self) -> torch.Tensor:  # [tokens, hidden]
        return self.packed[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors to send point to point (``GroupCoordinator.send_tensor_dict``)."""
        return {"packed": self.packed}

    @classmethod
    def from_tensors(cls, step: StepInput, tensors: dict[str, torch.Tensor]) -> StageHandoff:
        """Inverse of :meth:`tensors`, given the step descriptor."""
        return cls(step, tensors["packed"])
