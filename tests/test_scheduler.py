"""Scheduler and KV-block accounting, in plain Python, against a simulated cache.

A fake pipeline plays the stages: it writes each fed token into a simulated
paged cache at the slots the engine chose, and before "sampling" checks that the
cache holds exactly this sequence's tokens at every position the attention would
read. The sampled token is a pure function of the sequence's tokens so far, so
preemption, chunking and pipelining must not change any output.
"""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from raypp.config import SchedulerConfig
from raypp.engine.block_manager import BlockManager
from raypp.engine.scheduler import MicroBatch, Scheduler
from raypp.engine.sequence import Sequence, SequenceStatus
from raypp.sampling_params import SamplingParams


def _next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97


class FakePipeline:
    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.cache: dict[int, tuple[int, int, int]] = {}  # slot -> (seq_id, position, token)

    def run(self, batch: MicroBatch, ahead: dict[int, list[int]] | None = None
            ) -> list[list[int]]:
        """Per sampled row, ``batch.num_steps`` tokens (each step feeds the last one back).

        ``ahead``: for a continuation, the tokens per sequence id that the round it
        continues samples (not yet on the host, as on a real stage)."""
        sampled = []
        for item in batch.seqs:
            seq = item.seq
            extra = ahead[seq.seq_id] if ahead else []
            assert len(extra) == batch.ahead
            tokens = list(seq.all_token_ids) + extra
            start = seq.num_computed_tokens + batch.ahead
            end = start + item.num_tokens
            out = []
            for _ in range(batch.num_steps):
                for pos in range(start, end):
                    self.cache[self.blocks.slot(seq, pos)] = (seq.seq_id, pos, tokens[pos])
                for pos in range(end):  # what attention reads
                    assert self.cache[self.blocks.slot(seq, pos)] == (
                        seq.seq_id, pos, tokens[pos]), "cache holds another token"
                if not item.sample:
                    break
                out.append(_next_token(tokens[:end]))
                tokens.append(out[-1])
                start, end = end, end + 1
            if item.sample:
                sampled.append(out)
        return sampled


def _expected(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(_next_token(tokens))
    return tokens[len(prompt):]


def _simulate(prompts, max_tokens, num_blocks, block_size, inflight, max_seqs, max_tokens_step,
              arrivals, decode_steps=1, rounds_ahead=False):
    blocks = BlockManager(num_blocks, block_size)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens_step,
                             max_inflight=inflight, num_decode_steps=decode_steps)
    sched = Scheduler(config, blocks, max_model_len=10_000)
    pipe = FakePipeline(blocks)
    seqs = [Sequence(i, str(i), 0, p, SamplingParams(max_tokens=m), seed=0)
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    pending = deque(zip(arrivals, seqs))
    queue: deque[tuple[MicroBatch, list[int]]] = deque()
    step = continuations = 0
    while pending or sched.has_unfinished() or queue:
        while pending and pending[0][0] <= step:
            sched.add(pending.popleft()[1])
        while len(queue) < inflight:
            batch = sched.schedule()
            if batch is None:
                break
            in_flight = [s.seq.seq_id for b, _ in queue for s in b.seqs]
            assert not set(in_flight) & {s.seq.seq_id for s in batch.seqs}, "seq in two batches"
            assert batch.num_steps == 1 or all(s.num_tokens == 1 for s in batch.seqs)
            queue.append((batch, pipe.run(batch)))
        _check_blocks(sched, blocks)
        step += 1
        if not queue:
            assert pending, "nothing scheduled although work remains"
            continue
        batch, tokens = queue.popleft()
        if rounds_ahead and not queue and not sched.can_admit():  # as LLMEngine does
            nxt = sched.continue_batch(batch)
            if nxt is not None:
                by_seq = {s.seq.seq_id: row for s, row in zip(batch.seqs, tokens)}
                queue.append((nxt, pipe.run(nxt, by_seq)))
                continuations += 1
        sched.complete(batch)
        for seq, row in zip([s.seq for s in batch.seqs if s.sample], tokens):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished while a continuation was in flight
            for token in row:
                seq.output_token_ids.append(token)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    seq.status = SequenceStatus.FINISHED
                    sched.finish(seq)
                    break
        assert step < 20_000, "no progress"
    assert blocks.num_free == num_blocks, "blocks leaked"
    for seq, prompt, m in zip(seqs, prompts, max_tokens):
        assert seq.output_token_ids == _expected(prompt, m)
    return sched, continuations


def _check_blocks(sched: Scheduler, blocks: BlockManager) -> None:
    owned = [b for s in sched.running for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert len(owned) + blocks.num_free == blocks.num_blocks
    for s in sched.waiting:
        assert s.block_table == [] or s.status is SequenceStatus.RUNNING


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 30)),
                  min_size=1, max_size=12),
    block_size=st.sampled_from([1, 2, 4, 16]),
    inflight=st.integers(1, 3),
    max_seqs=st.integers(1, 8),
    step_tokens=st.integers(1, 64),
    spare_blocks=st.integers(0, 20),
    decode_steps=st.sampled_from([1, 1, 2, 5, 8]),
    rounds_ahead=st.booleans(),
)
def test_scheduler_outputs_are_independent_of_scheduling(data, block_size, inflight, max_seqs,
                                                         step_tokens, spare_blocks, decode_steps,
                                                         rounds_ahead):
    prompts = [[(7 * i + j) % 50 for j in range(n)] for i, (n, _, _) in enumerate(data)]
    max_tokens = [m for _, m, _ in data]
    arrivals = sorted(a for _, _, a in data)
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    num_blocks = -(-longest // block_size) + spare_blocks
    _simulate(prompts, max_tokens, num_blocks, block_size, inflight, max_seqs, step_tokens,
              arrivals, decode_steps, rounds_ahead)


def test_tight_budget_preempts_and_still_matches():
    prompts = [[i, i + 1, i + 2, i + 3, i + 4] for i in range(8)]
    sched, _ = _simulate(prompts, [20] * 8, num_blocks=8, block_size=4, inflight=2, max_seqs=8,
                      max_tokens_step=64, arrivals=[0] * 8)
    assert sched.num_preemptions > 0


def test_decode_horizon_respects_wanted_tokens_model_length_and_free_blocks():
    def horizon(max_tokens, prompt_len=6, num_blocks=100, max_model_len=10_000, penalty=0.0):
        blocks = BlockManager(num_blocks, 4)
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                          num_decode_steps=8), blocks, max_model_len)
        params = [SamplingParams(max_tokens=m, presence_penalty=penalty) for m in max_tokens]
        for i, p in enumerate(params):
            sched.add(Sequence(i, str(i), 0, list(range(prompt_len)), p, seed=0))
        prefill = sched.schedule()
        assert prefill.num_steps == 1  # prompts are not decode
        sched.complete(prefill)
        for item in prefill.seqs:
            item.seq.output_token_ids.append(1)
        batch = sched.schedule()
        for item in batch.seqs:  # blocks cover every step's position
            assert len(item.seq.block_table) * 4 >= item.seq.num_tokens + batch.num_steps - 1
        return batch.num_steps

    assert horizon([100, 100]) == 8
    assert horizon([3, 5]) == 4  # no step past what the longest-running sequence wants
    assert horizon([100], prompt_len=6, max_model_len=10) == 3  # 7 tokens now; stops at 10
    assert horizon([100], penalty=0.5) == 1  # penalties need the host between steps
    # 2 blocks hold the 7 tokens; one spare block makes room for tokens 8..12 only
    assert horizon([100], num_blocks=3) == 6


def test_rounds_ahead_continue_decode_batches_without_changing_outputs():
    prompts = [[i, i + 1, i + 2] for i in range(6)]
    max_tokens = [40, 3, 17, 25, 8, 40]
    runs = {ahead: _simulate(prompts, max_tokens, num_blocks=40, block_size=4, inflight=1,
                             max_seqs=6, max_tokens_step=64, arrivals=[0] * 6, decode_steps=4,
                             rounds_ahead=ahead) for ahead in (False, True)}
    assert runs[True][1] >= 5  # after the prefill, every decode round but the last ones
    # one round ahead at a time: each continuation followed a round read from the host
    assert runs[True][0].num_preemptions == 0


def _decoding(num_blocks: int, max_tokens: list[int], prompt_len: int = 6, steps: int = 4,
              max_model_len: int = 10_000) -> tuple[Scheduler, MicroBatch]:
    """A scheduler whose sequences have one sampled token, and their first decode round."""
    blocks = BlockManager(num_blocks, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                      num_decode_steps=steps), blocks, max_model_len)
    for i, m in enumerate(max_tokens):
        sched.add(Sequence(i, str(i), 0, list(range(prompt_len)), SamplingParams(max_tokens=m),
                           seed=0))
    prefill = sched.schedule()
    sched.complete(prefill)
    for item in prefill.seqs:
        item.seq.output_token_ids.append(1)
    return sched, sched.schedule()


def test_continue_batch_room_blocks_and_in_flight_counts():
    sched, first = _decoding(num_blocks=100, max_tokens=[100, 6])
    assert first.num_steps == 4 and first.ahead == 0
    nxt = sched.continue_batch(first)
    assert nxt is not None and nxt.ahead == 4
    # the second sequence has 1 + 4 of its 6 tokens once ``first`` ends: room for one more
    assert [s.seq.seq_id for s in nxt.seqs] == [0, 1] and nxt.num_steps == 4
    assert all(s.seq.in_flight == 2 for s in nxt.seqs)
    for item in nxt.seqs:  # blocks cover every position the continuation writes
        assert len(item.seq.block_table) * 4 >= item.seq.num_tokens + 4 + 4 - 1
    sched.complete(first)
    assert all(s.seq.in_flight == 1 for s in nxt.seqs)
    assert [s.seq.num_computed_tokens for s in nxt.seqs] == [10, 10]

    sched, first = _decoding(num_blocks=100, max_tokens=[5])
    assert sched.continue_batch(first) is None  # 1 + 4 tokens: nothing left to sample

    # 7 tokens: the first round writes positions 6..9, leaving 10 and 11 of 3 blocks
    sched, first = _decoding(num_blocks=3, max_tokens=[100])
    assert first.num_steps == 4
    assert sched.continue_batch(first).num_steps == 2
    # 9 tokens: the first round writes positions 8..11 and fills the 3 blocks
    sched, first = _decoding(num_blocks=3, max_tokens=[100], prompt_len=8)
    assert first.num_steps == 4
    assert sched.continue_batch(first) is None  # a continuation never preempts
    assert sched.num_preemptions == 0
    assert first.seqs[0].seq.in_flight == 1


def test_long_prompt_is_chunked():
    sched, _ = _simulate([list(range(100))], [3], num_blocks=40, block_size=4, inflight=1,
                      max_seqs=4, max_tokens_step=16, arrivals=[0])
    assert sched.num_preemptions == 0


def test_micro_batches_split_the_running_set_evenly():
    blocks = BlockManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_inflight=2),
                      blocks, 10_000)
    for i in range(8):
        sched.add(Sequence(i, str(i), 0, [1, 2, 3], SamplingParams(), seed=0))
    first, second = sched.schedule(), sched.schedule()
    assert len(first.seqs) == len(second.seqs) == 4
    assert sched.schedule() is None  # everything is in flight


def test_block_manager_refcounts():
    blocks = BlockManager(4, 2)
    seq = Sequence(0, "a", 0, [1, 2, 3], SamplingParams(), seed=0)
    blocks.allocate(seq, 3)
    assert len(seq.block_table) == 2 and blocks.num_free == 2
    blocks.share(seq.block_table[0])
    shared = seq.block_table[0]
    blocks.free(seq)
    assert blocks.num_free == 3  # the shared block is still referenced
    other = Sequence(1, "b", 0, [1], SamplingParams(), seed=0)
    other.block_table = [shared]
    blocks.free(other)
    assert blocks.num_free == 4
