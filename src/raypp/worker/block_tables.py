"""A stage's mirror of the engine's block tables: lean steps in, whole row tables out.

Steps carry block tables as changes (the wire contract in :mod:`raypp.step`); each
stage worker keeps every running sequence's table here and resolves each step, in
submission order, into a :class:`~raypp.step.ResolvedStep` whose rows have their whole
tables (and its tokens their positions and cache slots). A step that names a sequence
the mirror holds no table for, grows a table from the wrong length, or leaves a row's
table too short for its tokens is refused with a ``ValueError`` naming the step and
the sequence: the stage never guesses a table.
"""

from __future__ import annotations

from raypp.step import ResolvedStep, StepInput


class BlockTableMirror:
    """Per-sequence block tables as one stage holds them (one per worker)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._tables: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def table(self, seq_id: int) -> list[int]:
        """A copy of the table held for ``seq_id`` (``KeyError`` if none)."""
        return list(self._tables[seq_id])

    def resolve(self, step: StepInput) -> ResolvedStep:
        """Apply ``step``'s drops, then its updates, and return it with each row's table
        and each token's position and slot.

        The rows' tables are this mirror's own lists (no copy): valid until the next
        step is resolved, and only to be read.
        """
        tables = self._tables
        for seq_id in step.finished_seq_ids:
            tables.pop(seq_id, None)
        for seq_id, start, entries in step.block_table_updates:
            if start == 0:
                tables[seq_id] = list(entries)
                continue
            table = tables.get(seq_id)
            if table is None:
                raise ValueError(f"step {step.step_id}: grows the block table of sequence "
                                 f"{seq_id} from entry {start}, but this stage holds no table "
                                 "for it")
            if len(table) != start:
                raise ValueError(f"step {step.step_id}: grows the block table of sequence "
                                 f"{seq_id} from entry {start}, but this stage's copy has "
                                 f"{len(table)} entries")
            table.extend(entries)
        rows = []
        block_size, extra = self.block_size, step.num_steps - 1
        for seq_id, seq_len in zip(step.seq_ids, step.seq_lens):
            table = tables.get(seq_id)
            if table is None:
                raise ValueError(f"step {step.step_id}: this stage holds no block table for "
                                 f"sequence {seq_id}")
            if len(table) * block_size < seq_len + extra:
                raise ValueError(f"step {step.step_id}: the block table of sequence {seq_id} "
                                 f"has {len(table)} blocks of {block_size}, too few for "
                                 f"{seq_len + extra} tokens")
            rows.append(table)
        if len(rows) != len(step.seq_lens):
            raise ValueError(f"step {step.step_id}: {len(step.seq_ids)} sequence ids for "
                             f"{len(step.seq_lens)} rows")
        return ResolvedStep.of(step, rows, block_size)
