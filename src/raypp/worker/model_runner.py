"""One stage's per-step compute: prepare inputs → eager or graph forward → (last stage)
logits → sample, and decode rounds.

:meth:`ModelRunner.execute` is the whole of a step on a stage; it does not know which
control plane drives it. It first resolves the step's block-table changes against
this stage's mirror (:mod:`raypp.worker.block_tables`); everything after runs on the
resolved step, the way its ``mode`` says (:class:`~raypp.step.StepMode`: the
scheduler decided it; the stage follows). A stage that is not last returns a :class:`~raypp.step.StageHandoff`
of the step as it came (lean); the last stage returns a
:class:`~raypp.step.StepOutput` of plain lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from raypp.model.base import StageModel
from raypp.step import ResolvedStep, StageHandoff, StepInput, StepMode, StepOutput
from raypp.worker.block_tables import BlockTableMirror
from raypp.worker.cuda_graphs import DecodeGraphs
from raypp.worker.decode_loop import DecodeInputs, run_decode_steps
from raypp.worker.draft_runner import DraftRunner, with_drafts
from raypp.worker.eager_metadata import attention_metadata
from raypp.worker.penalty_history import PenaltyHistoryMirror
from raypp.worker.sampler import SamplingTensors, sample
from raypp.worker.verifier import verified_rows, verify


class ModelRunner:
    """Runs micro-batches through one stage's model and KV cache.

    ``graphs`` (CUDA) replays captured decode graphs where a step fits them; every
    other step runs the eager forward. Holds the last decode round's sampled tokens
    on the device, for a round that ``continues`` it (asynchronous scheduling), and
    this stage's copy of every running sequence's block table (``block_tables``).
    ``on_progress`` is called as the eager forward advances (each layer, each block of a
    long attention): the stage's progress counter (:mod:`raypp.worker.progress`). On the
    first stage with a draft model, ``draft`` runs it ahead of the target on each step
    (:mod:`raypp.worker.draft_runner`).
    """

    def __init__(self, model: StageModel, kv_caches: list[torch.Tensor],
                 graphs: DecodeGraphs | None, device: torch.device, block_size: int,
                 on_progress: Callable[[], None] | None = None):
        self.model = model
        self.on_progress = on_progress
        self.kv_caches = kv_caches
        self.graphs = graphs
        self.device = device
        self.block_size = block_size
        self.block_tables = BlockTableMirror(block_size)
        self.penalty_history = PenaltyHistoryMirror()  # used on the last stage only
        # (step id, its last sampled ids on the device) of the latest decode round
        self._last_round: tuple[int, torch.Tensor] | None = None
        self.draft: DraftRunner | None = None  # the first stage's draft model, if any

    def execute(self, step: StepInput, handoff: StageHandoff | None
                ) -> StageHandoff | StepOutput:
        """Run ``step`` (``handoff``: the previous stage's, ``None`` on the first stage)."""
        previous, self._last_round = self._last_round, None  # only the next step may continue it
        resolved = self.block_tables.resolve(step)  # first: every step updates the mirror
        stage = self.model.stage
        # a VERIFY step's drafts: the first stage's draft model makes them (it runs on every
        # step but a decode round, keeping its KV in step), later stages get them handed on
        drafts = None if handoff is None else handoff.drafts
        if self.draft is not None and step.mode is not StepMode.DECODE_ROUND:
            drafts = self.draft.run(resolved)
        if drafts is not None:
            resolved.input_ids = with_drafts(resolved, drafts)
        if stage.is_last:  # every step updates the history mirror too
            resolved.sampling = self.penalty_history.resolve(step)
        if step.mode is StepMode.DECODE_ROUND:
            if not (stage.is_first and stage.is_last):
                raise ValueError(f"step {step.step_id} is a decode round, which only a "
                                 "one-stage pipeline runs")
            return self._decode_round(resolved, previous)
        if not stage.is_last:
            hidden, residual = self._forward(resolved, handoff)
            return StageHandoff.pack(step, hidden, residual, drafts)  # the lean step travels on
        if step.mode is StepMode.VERIFY:
            logits = self._logits(resolved, handoff, verified_rows(resolved))
            assert logits is not None
            return StepOutput(step.step_id, *verify(logits, resolved))
        return self._sample(resolved, self._logits(resolved, handoff))

    # -- one step -------------------------------------------------------------------------
    def _forward(self, step: ResolvedStep, handoff: StageHandoff | None):
        """``(hidden, residual)`` of every token of ``step`` on a stage that is not last."""
        graphs = self.graphs
        if graphs is not None and graphs.can_run(step):  # CUDA decode: replay a captured graph
            return graphs.run(step, handoff)
        return self._eager_forward(step, handoff)

    def _eager_forward(self, step: ResolvedStep, handoff: StageHandoff | None):
        dev = self.device
        positions = torch.tensor(step.positions, dtype=torch.int64, device=dev)
        meta = attention_metadata(step, dev, self.on_progress)
        if self.model.stage.is_first:
            ids = torch.tensor(step.input_ids, dtype=torch.int64, device=dev)
            return self.model(positions, meta, self.kv_caches, input_ids=ids)
        if handoff is None:
            raise ValueError(f"step {step.step_id}: a stage after the first needs the previous "
                             "stage's hand-off")
        return self.model(positions, meta, self.kv_caches, hidden_states=handoff.hidden_states,
                          residual=handoff.residual)

    def _logits(self, step: ResolvedStep, handoff: StageHandoff | None,
                rows: list[int] | None = None) -> torch.Tensor | None:
        """Run the last stage on ``step``: logits of the token indices ``rows`` (default:
        its sampled rows; ``None`` if there are none)."""
        rows = step.sample_rows if rows is None else rows
        picked = torch.tensor(rows, dtype=torch.int64, device=self.device) if rows else None
        graphs = self.graphs
        if graphs is not None and graphs.can_run(step):
            logits = graphs.run(step, handoff)  # every row's, computed inside the graph
            if rows is step.sample_rows and len(rows) == step.num_seqs:  # decode: every row
                return logits
            return None if picked is None else logits.index_select(0, picked)
        hidden, _ = self._eager_forward(step, handoff)
        return None if picked is None else self.model.compute_logits(hidden.index_select(0, picked))

    @staticmethod
    def _sample(step: ResolvedStep, logits: torch.Tensor | None) -> StepOutput:
        if logits is None:
            return StepOutput(step.step_id, [], [])
        tokens, logprobs = sample(logits, step.sampling)
        return StepOutput(step.step_id, [[t] for t in tokens],
                          [None if lp is None else [lp] for lp in logprobs])

    # -- decode rounds --------------------------------------------------------------------
    def _decode_round(self, step: ResolvedStep, previous: tuple[int, torch.Tensor] | None
                      ) -> StepOutput:
        """``step.num_steps`` (one or more) decode steps of a one-stage pipeline, in one
        call; the last step's tokens stay on the device for a round that continues it.

        A step that ``continues`` a round takes its input ids from that round's last
        tokens: ``previous``, the round this stage ran just before (else ``ValueError``).
        """
        if step.continues is not None and (previous is None or previous[0] != step.continues):
            raise ValueError(f"step {step.step_id} continues step {step.continues}, but the "
                             "latest decode round here is "
                             f"{'none' if previous is None else previous[0]}")
        graphs = self.graphs
        forward: Any
        if graphs is not None and graphs.can_run(step):
            inputs = graphs.load(step)
            forward = graphs.replay
        else:
            inputs = DecodeInputs.from_step(step, self.device)
            meta = inputs.metadata()
            meta.on_progress = self.on_progress

            def forward() -> torch.Tensor:
                hidden, _ = self.model(inputs.positions, meta, self.kv_caches,
                                       input_ids=inputs.input_ids)
                return self.model.compute_logits(hidden)

        if step.continues is not None:
            assert previous is not None
            _feed_last_tokens(inputs.input_ids, previous[1], step.continue_rows)
        assert step.sampling is not None
        if step.sampling.token_bitmask or step.sampling.logit_bias:  # RoundPolicy keeps them out
            raise ValueError(f"step {step.step_id} is a decode round with token masks or logit "
                             "biases, which only a FORWARD step applies")
        run = run_decode_steps(
            forward, inputs, SamplingTensors.build(step.sampling, self.device), step.num_steps,
            self.block_size)
        self._last_round = (step.step_id, run.last_tokens)
        return StepOutput(step.step_id, run.token_ids, run.logprobs)


def _feed_last_tokens(input_ids: torch.Tensor, last: torch.Tensor, rows: list[int]) -> None:
    """``input_ids[r] = last[rows[r]]``, on the device (no host sync)."""
    if rows == list(range(len(rows))):
        input_ids.copy_(last[: len(rows)])
    else:
        index = torch.tensor(rows, dtype=torch.int64).to(last.device, non_blocking=True)
        torch.index_select(last, 0, index, out=input_ids)
