"""Turns a scheduled micro-batch into the step descriptor the stages run.

The descriptor (:class:`~raypp.step.StepInput`) is flat plain lists: token ids, each
sequence's id and context length, what changed in the stages' block tables since
the steps before, and the sampling settings of the rows that end a sequence's query;
how the stages run it (``mode``, ``num_steps``, the round it ``continues``) is the
scheduler's decision, copied as it is. Stages derive positions and cache slots from
the context lengths and their block tables.

The builder remembers, per sequence, which table the stages hold: its epoch (see
:class:`~raypp.engine.sequence.Sequence`) and length as last sent. Steps are built
in the order they are submitted, and every stage runs them in that order, so a
step may rely on every step built before it, with two exceptions the engine
reports: a step that failed may have reached only some stages (:meth:`forget`), and
new workers hold nothing (:meth:`reset`).
"""

from __future__ import annotations

import itertools

from raypp.engine import structured
from raypp.engine.scheduler import MicroBatch, Scheduler
from raypp.engine.sequence import Sequence
from raypp.step import SamplingBatch, StepInput, StepMode


class StepBuilder:
    """Builds :class:`StepInput` s with increasing step ids (ids never repeat, across
    executor restarts too), carrying block tables as changes."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler  # its block manager maps positions to cache slots
        self._step_ids = itertools.count()
        self.trace = False  # stages record compute intervals of the steps built while set
        # seq id -> (block epoch, table length) of the table the stages hold
        self._held: dict[int, tuple[int, int]] = {}
        self._drops: dict[int, None] = {}  # seq ids whose tables the next step drops
        # seq id -> output tokens of its penalty history the last stage holds
        self._history: dict[int, int] = {}

    def build(self, batch: MicroBatch) -> StepInput:
        """The step of ``batch`` (which gets its ``step_id``)."""
        ids, query_start, seq_lens, seq_ids, rows = [], [0], [], [], []
        draft_lens: list[int] = []  # per sampled row of a VERIFY step
        sampled: list[tuple[Sequence, int]] = []  # (sequence, output index sampled)
        drops = self._drain_drops()
        updates = []
        histories: list[tuple[int, list[int] | None, int, list[int]]] = []
        held = self._held
        continued = batch.continues
        for item in batch.seqs:
            seq, start = item.seq, item.start
            end = start + item.num_tokens
            if continued is not None:  # the stage feeds the previous round's last tokens
                ids.append(0)
            else:
                ids.extend(seq.token_ids(start, end - len(item.draft)))
                ids.extend(item.draft)
            query_start.append(len(ids))
            seq_lens.append(end)
            seq_id, table = seq.seq_id, seq.block_table
            seq_ids.append(seq_id)
            known = held.get(seq_id)
            if known is None or known[0] != seq.block_epoch or len(table) < known[1]:
                updates.append((seq_id, 0, list(table)))  # new to the stages, or a new table
                held[seq_id] = (seq.block_epoch, len(table))
            elif len(table) > known[1]:
                updates.append((seq_id, known[1], table[known[1]:]))
                held[seq_id] = (seq.block_epoch, len(table))
            if item.sample:
                rows.append(len(ids) - 1)
                sampled.append((seq, item.first_sampled - len(seq.prompt_token_ids)))
                if batch.mode is StepMode.VERIFY:
                    draft_lens.append(len(item.draft))
                if seq.params.uses_penalties:
                    self._add_history(seq, histories)
        catchup = [item.draft_catchup for item in batch.seqs]
        continue_rows = []
        if continued is not None:
            row_of = {item.seq.seq_id: r for r, item in enumerate(continued.seqs)}
            continue_rows = [row_of[item.seq.seq_id] for item in batch.seqs]
        batch.step_id = next(self._step_ids)
        return StepInput(
            step_id=batch.step_id,
            input_ids=ids,
            query_start=query_start,
            seq_lens=seq_lens,
            seq_ids=seq_ids,
            sample_rows=rows,
            sampling=sampling_batch(sampled) if sampled else None,
            block_table_updates=updates,
            finished_seq_ids=drops,
            penalty_history_updates=histories,
            mode=batch.mode,
            draft_lens=draft_lens,
            draft_catchup=catchup if any(catchup) else [],
            num_steps=batch.num_steps,
            continues=None if continued is None else continued.step_id,
            continue_rows=continue_rows,
            trace=self.trace,
        )

    def _add_history(self, seq: Sequence,
                     histories: list[tuple[int, list[int] | None, int, list[int]]]) -> None:
        """Queue the penalty-history change of ``seq``, sampled in the step being built."""
        output, held = seq.output_token_ids, self._history.get(seq.seq_id)
        if held is None:
            histories.append((seq.seq_id, list(seq.prompt_token_ids), 0, list(output)))
        elif len(output) > held:
            histories.append((seq.seq_id, None, held, output[held:]))
        self._history[seq.seq_id] = len(output)

    def _drain_drops(self) -> list[int]:
        """Tables the stages may drop: those of sequences freed since the last step that
        the stages hold, and any :meth:`forget` queued."""
        drops, held = self._drops, self._held
        for seq_id in self.scheduler.blocks.drain_freed():
            history = self._history.pop(seq_id, None)
            if held.pop(seq_id, None) is not None or history is not None:
                drops[seq_id] = None
        self._drops = {}
        return list(drops)

    def forget(self, step: StepInput) -> None:
        """``step`` (built here) may have reached only some stages, or none: resend its
        rows' tables whole when next used, and have the stages drop them (and the
        tables it dropped) in the next step, whatever each of them holds now."""
        for seq_id in step.seq_ids:
            self._held.pop(seq_id, None)
            self._history.pop(seq_id, None)
            self._drops[seq_id] = None
        for seq_id in step.finished_seq_ids:
            if seq_id not in self._held:  # else a later step already sent a new table
                self._drops[seq_id] = None

    def reset(self) -> None:
        """The stages hold no tables (new workers): the next steps send them whole."""
        self._held.clear()
        self._history.clear()
        self._drops.clear()
        self.scheduler.blocks.drain_freed()

    @property
    def num_held(self) -> int:
        """Sequences whose tables the stages hold, as far as this builder knows."""
        return len(self._held)


def sampling_batch(rows: list[tuple[Sequence, int]]) -> SamplingBatch:
    """The sampling settings of rows ``(sequence, index in its output of the token
    sampled first)``."""
    seqs = [seq for seq, _ in rows]
    params = [s.params for s in seqs]
    return SamplingBatch(
        temperature=[p.temperature for p in params],
        top_p=[p.top_p for p in params],
        top_k=[p.top_k for p in params],
        min_p=[p.min_p for p in params],
        seeds=[s.seed for s in seqs],
        output_index=[index for _, index in rows],
        num_logprobs=[-1 if p.logprobs is None else p.logprobs for p in params],
        presence_penalty=[p.presence_penalty for p in params],
        frequency_penalty=[p.frequency_penalty for p in params],
        repetition_penalty=[p.repetition_penalty for p in params],
        token_bitmask=structured.token_bitmasks(seqs),
        logit_bias=([(list(p.logit_bias), list(p.logit_bias.values())) if p.logit_bias else None
                     for p in params] if any(p.logit_bias for p in params) else []),
    )
