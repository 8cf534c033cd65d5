"""The last stage's copy of each penalized sequence's tokens: the penalties' history.

Repetition penalties read a sequence's prompt and output tokens, presence and
frequency penalties its output tokens. Steps carry them as changes (the wire
contract in :mod:`raypp.step`); the last stage keeps each penalized sequence's
history here and fills a step's :class:`~raypp.step.SamplingBatch` rows from it. A
step that samples a penalized sequence this mirror holds no history for, or grows a
history from the wrong length, is refused with a ``ValueError`` naming the step and
the sequence.
"""

from __future__ import annotations

import dataclasses

from raypp.step import SamplingBatch, StepInput


class PenaltyHistoryMirror:
    """Prompt and output tokens of each penalized sequence (one per last-stage worker)."""

    def __init__(self) -> None:
        self._prompts: dict[int, list[int]] = {}
        self._outputs: dict[int, list[int]] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._prompts

    def history(self, seq_id: int) -> tuple[list[int], list[int]]:
        """Copies of the (prompt, output) held for ``seq_id`` (``KeyError`` if none)."""
        return list(self._prompts[seq_id]), list(self._outputs[seq_id])

    def resolve(self, step: StepInput) -> SamplingBatch | None:
        """Apply ``step``'s drops, then its history updates; return its sampling settings
        with every penalized row's history filled in (the lists are this mirror's own:
        valid until the next step is resolved, only to be read)."""
        prompts, outputs = self._prompts, self._outputs
        for seq_id in step.finished_seq_ids:
            prompts.pop(seq_id, None)
            outputs.pop(seq_id, None)
        for seq_id, prompt, start, tokens in step.penalty_history_updates:
            if prompt is not None:
                prompts[seq_id], outputs[seq_id] = list(prompt), []
            output = outputs.get(seq_id)
            if output is None:
                raise ValueError(f"step {step.step_id}: grows the token history of sequence "
                                 f"{seq_id}, but this stage holds none for it")
            if len(output) != start:
                raise ValueError(f"step {step.step_id}: grows the token history of sequence "
                                 f"{seq_id} from token {start}, but this stage's copy has "
                                 f"{len(output)}")
            output.extend(tokens)
        sampling = step.sampling
        if sampling is None or not sampling.any_penalties:
            return sampling
        seq_ending_at = {end - 1: seq_id for seq_id, end in zip(step.seq_ids, step.query_start[1:])}
        row_prompts, row_outputs = [], []
        for r, token_index in enumerate(step.sample_rows):
            if not sampling.penalized(r):
                row_prompts.append([])
                row_outputs.append([])
                continue
            seq_id = seq_ending_at[token_index]
            if seq_id not in prompts:
                raise ValueError(f"step {step.step_id}: sequence {seq_id} samples with "
                                 "penalties, but this stage holds no token history for it")
            row_prompts.append(prompts[seq_id])
            row_outputs.append(outputs[seq_id])
        return dataclasses.replace(sampling, prompt_tokens=row_prompts, output_tokens=row_outputs)

