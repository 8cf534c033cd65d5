"""Lean step messages: the engine sends block-table changes, every stage mirrors the tables.

Unit level (plain Python): the real Scheduler, BlockManager and StepBuilder make the
steps, a stage's BlockTableMirror resolves them, and every resolved table must equal
the engine's table at build time — through growth, preemption (a new table under the
same sequence id), finishing, multi-step and continuation rounds, a failed step that
some stages missed, and new workers. Engine level (a real pipeline on CPU): outputs
under preemption equal a run without memory pressure at pp=1 and pp=2, and the steps
an engine submits are lean.
"""

from __future__ import annotations

import pytest
from hf_reference import corpus_prompts

from raypp import LLM, SamplingParams
from raypp.config import SchedulerConfig
from raypp.engine.block_manager import BlockManager
from raypp.engine.scheduler import MicroBatch, Scheduler
from raypp.engine.sequence import Sequence, SequenceStatus
from raypp.engine.step_builder import StepBuilder
from raypp.step import ResolvedStep, StepInput, StepMode
from raypp.worker.block_tables import BlockTableMirror

BLOCK = 4


class Engine:
    """Scheduler + builder + one stage's mirror, driven by hand (tokens are all 1)."""

    def __init__(self, num_blocks: int = 64, steps: int = 1, inflight: int = 1):
        self.blocks = BlockManager(num_blocks, BLOCK, enable_caching=False)
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                 num_decode_steps=steps, max_inflight=inflight)
        self.sched = Scheduler(config, self.blocks, 10_000)
        self.builder = StepBuilder(self.sched)
        self.mirror = BlockTableMirror(BLOCK)

    def add(self, seq_id: int, prompt_len: int, max_tokens: int = 100) -> Sequence:
        seq = Sequence(seq_id, str(seq_id), 0, [1] * prompt_len,
                       SamplingParams(max_tokens=max_tokens), seed=0)
        self.sched.add(seq)
        return seq

    def build(self, batch: MicroBatch, resolve: bool = True) -> StepInput:
        """Build ``batch``'s step; with ``resolve``, this engine's stage runs it, and its
        resolved tables must be the engine's."""
        step = self.builder.build(batch)
        if resolve:
            resolved = self.mirror.resolve(step)
            assert resolved.block_tables == [s.seq.block_table for s in batch.seqs]
            # the stage derives each fed token's position and slot as the engine places it
            fed = [(s.seq, p) for s in batch.seqs for p in range(s.start, s.start + s.num_tokens)]
            assert resolved.positions == [p for _, p in fed]
            assert resolved.slot_mapping == [self.blocks.slot(seq, p) for seq, p in fed]
        return step

    def step(self) -> tuple[MicroBatch, StepInput]:
        batch = self.sched.schedule()
        assert batch is not None
        step = self.build(batch)
        self.finish(batch)
        return batch, step

    def finish(self, batch: MicroBatch) -> None:
        """The batch's result: one token per step per sampled row."""
        self.sched.complete(batch)
        for item in batch.seqs:
            if item.sample and item.seq.status is SequenceStatus.RUNNING:
                item.seq.output_token_ids.extend([1] * batch.num_steps)

    def end(self, seq: Sequence) -> None:
        seq.finish("length")
        self.sched.finish(seq)


def _updates(step: StepInput) -> dict[int, tuple[int, list[int]]]:
    return {seq_id: (start, entries) for seq_id, start, entries in step.block_table_updates}


# -- the builder and one stage's mirror --------------------------------------------------------
def test_tables_are_sent_whole_once_then_only_as_growth():
    e = Engine()
    a, b = e.add(0, 5), e.add(1, 3)
    _, prefill = e.step()
    assert _updates(prefill) == {0: (0, a.block_table), 1: (0, b.block_table)}
    assert prefill.seq_ids == [0, 1] and prefill.finished_seq_ids == []
    grown = []
    for _ in range(12):  # decode: 6 -> 17 tokens in context for a, 4 -> 15 for b
        before = {0: len(a.block_table), 1: len(b.block_table)}
        _, step = e.step()
        ups = _updates(step)
        for seq in (a, b):  # an entry only when the table grew, and only the new blocks
            if len(seq.block_table) > before[seq.seq_id]:
                assert ups[seq.seq_id] == (before[seq.seq_id], seq.block_table[before[seq.seq_id]:])
                grown.append(seq.seq_id)
            else:
                assert seq.seq_id not in ups
    assert sorted(grown) == [0, 0, 0, 1, 1, 1]
    assert e.builder.num_held == len(e.mirror) == 2


def test_preempted_sequence_gets_a_new_table_under_its_id():
    e = Engine(num_blocks=5)
    a, b = e.add(0, 8), e.add(1, 8)
    e.step()  # prefill: 2 blocks each, 1 free
    while b.status is SequenceStatus.RUNNING:  # a's growth preempts b (the later arrival)
        _, step = e.step()
    assert e.sched.num_preemptions == 1 and b.block_epoch == 1 and b.block_table == []
    # the step scheduled with the preemption drops b's table on the stages
    assert step.seq_ids == [0] and step.finished_seq_ids == [1] and 1 not in e.mirror
    e.end(a)
    _, step = e.step()  # b comes back, recomputing from token 0 in a new table
    assert step.seq_ids == [1] and step.finished_seq_ids == [0]
    assert _updates(step) == {1: (0, b.block_table)} and len(b.block_table) == 3
    assert len(e.mirror) == e.builder.num_held == 1


def test_a_step_may_drop_and_restart_the_same_sequence():
    """Freed and allocated again before the next step is built: the step drops the old
    table and sends the new one; drops apply first."""
    e = Engine()
    a = e.add(0, 9)
    e.step()
    e.sched.requeue(a)  # as a preemption does
    _, step = e.step()
    assert step.finished_seq_ids == [0] and _updates(step) == {0: (0, a.block_table)}
    assert e.mirror.table(0) == a.block_table


def test_finished_sequences_are_dropped_by_the_next_step():
    e = Engine()
    a, _ = e.add(0, 3, max_tokens=2), e.add(1, 3)
    e.step()
    e.step()
    e.end(a)
    e.sched.finish(a)  # freeing again (an abort after the finish) drops nothing new
    _, step = e.step()
    assert step.seq_ids == [1] and step.finished_seq_ids == [0]
    assert e.builder.num_held == len(e.mirror) == 1
    _, step = e.step()
    assert step.finished_seq_ids == []


def test_multi_step_and_continuation_rounds_carry_their_look_ahead_blocks():
    e = Engine(steps=4)
    seqs = [e.add(i, 6) for i in range(3)]
    e.step()  # prefill
    batch = e.sched.schedule()
    assert batch.num_steps == 4
    first = e.build(batch)
    nxt = e.sched.continue_batch(batch)  # submitted before `batch`'s result is read
    assert nxt is not None and nxt.continues is batch
    assert [i.start for i in nxt.seqs] == [i.start + 4 for i in batch.seqs]
    before = {s.seq_id: len(s.block_table) for s in seqs}
    cont = e.build(nxt)  # the stage checks its tables cover every look-ahead position
    assert (first.mode, cont.mode) == (StepMode.DECODE_ROUND, StepMode.DECODE_ROUND)
    assert (cont.continues, cont.continue_rows) == (first.step_id, [0, 1, 2])
    assert cont.sampling.output_index == [i + 4 for i in first.sampling.output_index]
    for s in seqs:
        assert len(s.block_table) * BLOCK >= s.num_tokens + 4 + nxt.num_steps - 1
        if len(s.block_table) > before[s.seq_id]:
            assert _updates(cont)[s.seq_id] == (before[s.seq_id],
                                                s.block_table[before[s.seq_id]:])
    assert first.block_table_updates and cont.block_table_updates
    e.finish(batch)
    e.finish(nxt)


def test_a_failed_step_is_resent_to_the_stages_that_missed_it():
    """Stage 0 ran the failed step, stage 1 did not: the builder forgets the step, and the
    next step is right on both (the failed rows dropped and sent whole, its drops sent
    again)."""
    e = Engine()
    later = BlockTableMirror(BLOCK)  # a second stage
    a, b, c = e.add(0, 4), e.add(1, 4), e.add(2, 4)
    batch = e.sched.schedule()
    later.resolve(e.build(batch))
    e.finish(batch)
    e.end(c)  # the next step drops c
    batch = e.sched.schedule()
    failed = e.build(batch)  # grows a and b to 2 blocks; reaches stage 0 only
    assert failed.finished_seq_ids == [2] and sorted(_updates(failed)) == [0, 1]
    e.builder.forget(failed)
    e.sched.complete(batch, ok=False)  # (the engine would also fail a and b)
    batch = e.sched.schedule()
    step = e.build(batch)
    assert sorted(step.finished_seq_ids) == [0, 1, 2]
    assert _updates(step) == {0: (0, a.block_table), 1: (0, b.block_table)}
    assert later.resolve(step).block_tables == [a.block_table, b.block_table]
    assert 2 not in later and 2 not in e.mirror


def test_a_resent_drop_never_hits_a_newer_table():
    """A failed step X dropped a's old table; a later step Y, built before X's failure was
    known, started a's new table: forgetting X must not drop a's new table again."""
    e = Engine(inflight=2)
    a = e.add(0, 4)
    batches = [e.sched.schedule()]  # [a]
    e.add(1, 4)
    batches.append(e.sched.schedule())  # [b]: both in flight
    for batch in batches:
        e.build(batch)
    for batch in batches:
        e.finish(batch)
    e.sched.requeue(a)  # a preemption: a's table is freed
    e.sched.waiting.remove(a)  # a is not readmitted into X (as if its blocks were short)
    x_batch = e.sched.schedule()
    x = e.build(x_batch)
    e.sched.waiting.appendleft(a)
    y_batch = e.sched.schedule()
    y = e.build(y_batch)
    assert x.seq_ids == [1] and x.finished_seq_ids == [0]
    assert y.seq_ids == [0] and _updates(y) == {0: (0, a.block_table)}
    e.builder.forget(x)  # X failed after stage 0
    e.sched.complete(x_batch, ok=False)
    e.finish(y_batch)
    step = e.build(e.sched.schedule())
    assert step.finished_seq_ids == [1] and 0 in e.mirror


def test_new_workers_get_every_table_whole():
    e = Engine()
    seqs = [e.add(i, 5) for i in range(3)]
    e.step()
    e.step()
    e.builder.reset()
    e.mirror = BlockTableMirror(BLOCK)  # the new workers' empty mirrors
    _, step = e.step()
    assert _updates(step) == {s.seq_id: (0, s.block_table) for s in seqs}
    assert step.finished_seq_ids == []


def test_the_mirror_refuses_a_table_it_does_not_hold():
    e = Engine()
    e.add(0, 5)
    step = e.build(e.sched.schedule(), resolve=False)

    def changed(**fields) -> StepInput:
        return StepInput(**{**vars(step), **fields})

    stage = BlockTableMirror(BLOCK)
    with pytest.raises(ValueError, match=rf"step {step.step_id}: this stage holds no block table "
                                         "for sequence 0"):
        stage.resolve(changed(block_table_updates=[]))
    with pytest.raises(ValueError, match="grows the block table of sequence 0 from entry 1, "
                                         "but this stage holds no table"):
        stage.resolve(changed(block_table_updates=[(0, 1, [9])]))
    stage.resolve(step)
    with pytest.raises(ValueError, match="this stage's copy has 2 entries"):
        stage.resolve(changed(block_table_updates=[(0, 3, [9])]))
    with pytest.raises(ValueError, match="has 2 blocks of 4, too few for 9 tokens"):
        stage.resolve(changed(seq_lens=[9]))


def test_resolved_steps_stay_on_the_stage():
    e = Engine()
    e.add(0, 5)
    batch = e.sched.schedule()
    step = e.build(batch, resolve=False)
    resolved = BlockTableMirror(BLOCK).resolve(step)
    assert isinstance(resolved, ResolvedStep) and not isinstance(step, ResolvedStep)
    assert not hasattr(step, "block_tables")
    assert resolved.block_table_updates == step.block_table_updates
    assert resolved.seq_ids == step.seq_ids and resolved.step_id == step.step_id


# -- a real engine ----------------------------------------------------------------------------
PRESSURE = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def relaxed(ray_cluster, tiny_llama):
    """Prompts, and their greedy outputs with cache blocks to spare (no preemption)."""
    with LLM(str(tiny_llama), max_model_len=64, block_size=8, max_num_seqs=8) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), [8, 9, 11, 13, 15, 17, 19, 23])
        outs = _ids(llm.generate(_inputs(prompts), PRESSURE, use_tqdm=False))
        assert llm.engine.scheduler.num_preemptions == 0
    return prompts, outs


@pytest.mark.parametrize("pp", [1, 2])
def test_preemption_keeps_greedy_outputs(ray_cluster, tiny_llama, relaxed, pp):
    """12 blocks of 8 tokens for 8 sequences of up to 47: sequences are preempted and come
    back under the same id with new tables; every stage's tables follow."""
    prompts, expected = relaxed
    with LLM(str(tiny_llama), pipeline_parallel_size=pp, max_model_len=64, block_size=8,
             num_blocks_override=12, max_num_seqs=8) as llm:
        outs = _ids(llm.generate(_inputs(prompts), PRESSURE, use_tqdm=False))
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_free == engine.block_manager.num_blocks
    assert outs == expected


def test_engine_steps_carry_only_what_changed(ray_cluster, tiny_llama):
    """A decode step carries a sequence's table only when it grew, and only the new block;
    every finished sequence's table is dropped by a later step, and only those (the sizes
    are benchmarks/step_messages.py's)."""
    with LLM(str(tiny_llama), pipeline_parallel_size=2, max_num_seqs=8) as llm:
        engine = llm.engine
        steps: list[StepInput] = []
        submit = engine.executor.submit

        def record(step: StepInput):
            steps.append(step)
            return submit(step)

        engine.executor.submit = record
        try:
            prompts = corpus_prompts(llm.get_tokenizer(), [3, 5, 14, 15, 16, 17, 30, 33])
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            llm.generate(_inputs(prompts), params, use_tqdm=False)
            first_run = len(steps)
            llm.generate(_inputs(prompts[:1]), params, use_tqdm=False)  # drops the last ones
        finally:
            del engine.executor.submit
        block = engine.config.cache.block_size
        assert engine.scheduler.num_preemptions == 0
    held: dict[int, list[int]] = {}
    decode_rows = grown = 0
    for step in steps:
        for seq_id in step.finished_seq_ids:
            held.pop(seq_id)
        updates = _updates(step)
        decode = step.num_tokens == step.num_seqs
        for seq_id, seq_len in zip(step.seq_ids, step.seq_lens):
            if seq_id not in held:  # new: its whole table
                assert updates[seq_id][0] == 0
                held[seq_id] = list(updates[seq_id][1])
            elif decode:
                decode_rows += 1
                if (seq_len - 1) % block == 0:  # the new token starts a block
                    assert updates[seq_id] == ((seq_len - 1) // block, updates[seq_id][1])
                    assert len(updates[seq_id][1]) == 1
                    held[seq_id] += updates[seq_id][1]
                    grown += 1
                else:
                    assert seq_id not in updates
    assert decode_rows > 200 and 0 < grown < decode_rows / 8
    first_ids = {s for step in steps[:first_run] for s in step.seq_ids}
    dropped = {s for step in steps for s in step.finished_seq_ids}
    assert dropped == first_ids and list(held) == steps[-1].seq_ids
