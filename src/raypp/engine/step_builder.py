"""Turns a scheduled micro-batch into the step descriptor the stages run.

The descriptor (:class:`~raypp.step.StepInput`) is flat plain lists: token ids and
positions, each token's cache slot, each sequence's block table and context length,
and the sampling settings of the rows that end a sequence's query.
"""

from __future__ import annotations

import itertools

from raypp.engine.scheduler import MicroBatch, Scheduler
from raypp.engine.sequence import Sequence
from raypp.step import SamplingBatch, StepInput


class StepBuilder:
    """Builds :class:`StepInput` s with increasing step ids (ids never repeat, across
    executor restarts too)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler  # its block manager maps positions to cache slots
        self._step_ids = itertools.count()
        self.trace = False  # stages record compute intervals of the steps built while set

    def build(self, batch: MicroBatch) -> StepInput:
        ids, positions, slots, query_start, seq_lens, tables, rows = [], [], [], [0], [], [], []
        sampled: list[Sequence] = []
        blocks = self.scheduler.blocks
        for item in batch.seqs:
            seq, start = item.seq, item.seq.num_computed_tokens + batch.ahead
            end = start + item.num_tokens
            if batch.ahead:  # the stage feeds the previous round's last tokens
                ids.append(0)
            else:
                ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks.slot(seq, p) for p in range(start, end))
            query_start.append(len(ids))
            seq_lens.append(end)
            tables.append(list(seq.block_table))
            if item.sample:
                rows.append(len(ids) - 1)
                sampled.append(seq)
        return StepInput(
            step_id=next(self._step_ids),
            input_ids=ids,
            positions=positions,
            query_start=query_start,
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slots,
            sample_rows=rows,
            sampling=sampling_batch(sampled, batch.ahead) if sampled else None,
            num_steps=batch.num_steps,
            trace=self.trace,
        )


def sampling_batch(seqs: list[Sequence], ahead: int = 0) -> SamplingBatch:
    """The rows' sampling settings; ``ahead``: tokens each samples in flight before these."""
    params = [s.params for s in seqs]
    penalized = [p.uses_penalties for p in params]
    return SamplingBatch(
        temperature=[p.temperature for p in params],
        top_p=[p.top_p for p in params],
        top_k=[p.top_k for p in params],
        min_p=[p.min_p for p in params],
        seeds=[s.seed for s in seqs],
        output_index=[len(s.output_token_ids) + ahead for s in seqs],
        num_logprobs=[-1 if p.logprobs is None else p.logprobs for p in params],
        presence_penalty=[p.presence_penalty for p in params],
        frequency_penalty=[p.frequency_penalty for p in params],
        repetition_penalty=[p.repetition_penalty for p in params],
        prompt_tokens=[s.prompt_token_ids if pen else [] for s, pen in zip(seqs, penalized)],
        output_tokens=[s.output_token_ids if pen else [] for s, pen in zip(seqs, penalized)],
    )
