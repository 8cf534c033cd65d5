"""Penalties' token history travels as changes: the last stage keeps each penalized
sequence's prompt and output tokens and gets only the tokens it gained.

Unit level: the real Scheduler, BlockManager and StepBuilder make the steps, and a
last stage's PenaltyHistoryMirror must fill every penalized row with exactly the
sequence's prompt and output at build time — through growth, preemption, a failed
step and new workers. Engine level: greedy decoding with a repetition penalty equals
transformers' ``generate(repetition_penalty=...)`` at pp 1 and 2, under preemption too.
"""

from __future__ import annotations

import pytest
from hf_reference import corpus_prompts, hf_greedy

from raypp import LLM, SamplingParams
from raypp.config import SchedulerConfig
from raypp.engine.block_manager import BlockManager
from raypp.engine.scheduler import Scheduler
from raypp.engine.sequence import Sequence, SequenceStatus
from raypp.engine.step_builder import StepBuilder
from raypp.worker.penalty_history import PenaltyHistoryMirror

PENALTY = 1.8


class Engine:
    """Scheduler + builder + a last stage's history mirror, driven by hand."""

    def __init__(self, num_blocks: int = 64):
        self.blocks = BlockManager(num_blocks, 4, enable_caching=False)
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                 num_decode_steps=1, max_inflight=1)
        self.sched = Scheduler(config, self.blocks, 10_000)
        self.builder = StepBuilder(self.sched)
        self.mirror = PenaltyHistoryMirror()
        self.token = 100

    def add(self, seq_id: int, prompt: list[int], penalized: bool = True) -> Sequence:
        params = SamplingParams(max_tokens=100, repetition_penalty=PENALTY if penalized else 1.0)
        seq = Sequence(seq_id, str(seq_id), 0, list(prompt), params, seed=0)
        self.sched.add(seq)
        return seq

    def step(self, fail: bool = False):
        batch = self.sched.schedule()
        assert batch is not None
        step = self.builder.build(batch)
        if fail:  # the step never reached the last stage
            self.builder.forget(step)
            self.sched.complete(batch, ok=False)
            return step
        sampling = self.mirror.resolve(step)
        sampled = [s.seq for s in batch.seqs if s.sample]
        for r, seq in enumerate(sampled):
            if seq.params.uses_penalties:
                assert sampling.prompt_tokens[r] == seq.prompt_token_ids
                assert sampling.output_tokens[r] == seq.output_token_ids
            else:
                assert sampling.prompt_tokens[r] == sampling.output_tokens[r] == []
        self.sched.complete(batch)
        for seq in sampled:
            if seq.status is SequenceStatus.RUNNING:
                seq.output_token_ids.append(self.token)
                self.token += 1
        return step


def _history(step) -> dict[int, tuple[list[int] | None, int, list[int]]]:
    return {seq_id: (prompt, start, tokens)
            for seq_id, prompt, start, tokens in step.penalty_history_updates}


def test_history_is_sent_whole_once_then_only_new_tokens():
    e = Engine()
    e.add(0, [5, 6, 7])
    e.add(1, [8, 9], penalized=False)
    first = e.step()
    assert _history(first) == {0: ([5, 6, 7], 0, [])}  # the plain sequence sends none
    second = e.step()
    assert _history(second) == {0: (None, 0, [100])}
    third = e.step()
    assert _history(third) == {0: (None, 1, [102])}
    assert third.sampling.prompt_tokens == [] and third.sampling.output_tokens == []  # wire


def test_preempted_or_failed_sequences_resend_their_history_whole():
    e = Engine()
    seq = e.add(0, [5, 6, 7])
    e.step()
    e.step()
    e.sched.requeue(seq)  # preemption: blocks freed, output kept
    again = e.step()
    assert again.finished_seq_ids == [0]
    assert _history(again) == {0: ([5, 6, 7], 0, [100, 101])}
    e.step(fail=True)
    resent = e.step()
    assert _history(resent)[0][0] == [5, 6, 7]  # whole again: the failed step may have missed it


def test_new_workers_get_every_history_whole():
    e = Engine()
    e.add(0, [5, 6])
    e.step()
    e.step()
    e.builder.reset()
    e.mirror = PenaltyHistoryMirror()
    assert _history(e.step()) == {0: ([5, 6], 0, [100, 101])}


def test_the_mirror_refuses_a_history_it_does_not_hold():
    e = Engine()
    e.add(0, [5, 6])
    e.step()
    e.mirror = PenaltyHistoryMirror()  # a stage that missed the first step
    with pytest.raises(ValueError, match="sequence 0.*holds none"):
        e.step()


# -- a real engine against transformers -------------------------------------------------------
@pytest.mark.parametrize("pp,blocks", [(1, None), (2, None), (2, 14)])
def test_repetition_penalty_equals_transformers(ray_cluster, tiny_llama, pp, blocks):
    extra = {"num_blocks_override": blocks, "block_size": 8} if blocks else {}
    with LLM(str(tiny_llama), pipeline_parallel_size=pp, max_num_seqs=6, max_model_len=64,
             seed=3, **extra) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), [4, 9, 13, 6, 11, 17])
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                repetition_penalty=PENALTY)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if blocks:
            assert llm.engine.scheduler.num_preemptions > 0
    # ignore_eos: EOS is an ordinary token (transformers with no EOS id neither stops at it
    # nor forbids it, as min_new_tokens would)
    reference = hf_greedy(tiny_llama, prompts, 20, eos_token_id=None, repetition_penalty=PENALTY)
    assert [o.outputs[0].token_ids for o in outs] == reference
