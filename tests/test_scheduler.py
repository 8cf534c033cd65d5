"""Scheduler, KV-block accounting and the prefix cache, in plain Python, against a
simulated cache.

A fake pipeline plays the stages: it writes each fed token into a simulated
paged cache at the slots the engine chose, as what its KV depends on (its
position and every token up to it), and before "sampling" checks that the cache
holds exactly this sequence's prefix at every position the attention would read
(whoever wrote it: a block shared through the prefix cache was written by
another sequence). It also checks that no write lands in a block that is shared
or registered in the prefix cache. The sampled token is a pure function of the
sequence's tokens so far, so preemption, chunking, pipelining and cache hits must
not change any output. Its attention reads through the block tables a stage's mirror
resolves from the lean steps the real step builder makes.
"""

from __future__ import annotations

from collections import Counter, deque

from hypothesis import given, settings
from hypothesis import strategies as st

from raypp.config import SchedulerConfig
from raypp.engine.block_hash import ROOT_HASH, hash_block
from raypp.engine.block_manager import BlockManager
from raypp.engine.scheduler import MicroBatch, Scheduler
from raypp.engine.sequence import Sequence, SequenceStatus
from raypp.engine.step_builder import StepBuilder
from raypp.sampling_params import SamplingParams
from raypp.speculative_config import SpeculativeConfig
from raypp.step import StepMode
from raypp.worker.block_tables import BlockTableMirror


def _next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97


class FakePipeline:
    """``draft_model``: the first stage also runs a draft model with a cache of its own
    (``draft_cache``, same slots), as :mod:`raypp.worker.draft_runner` does: it feeds each
    row's catch-up and real tokens, checking that its cache held the true prefix before
    them, and drafts the row's placeholders (right for a context-picked count)."""

    def __init__(self, blocks: BlockManager, draft_model: bool = False):
        self.blocks = blocks
        self.cache: dict[int, tuple[int, ...]] = {}  # slot -> the tokens its KV depends on
        self.draft_model = draft_model
        self.draft_cache: dict[int, tuple[int, ...]] = {}  # the same, of the draft's KV

    def run(self, batch: MicroBatch, tables: list[list[int]],
            ahead: dict[int, list[int]] | None = None,
            catchup: list[list[int]] | None = None) -> list[list[int]]:
        """Per sampled row, ``batch.num_steps`` tokens (each step feeds the last one back).

        ``tables``: each row's block table as a stage resolved it from the lean step (it
        writes at the engine's slots, and attention reads through these). ``ahead``: for
        a continuation, the tokens per sequence id that the round it continues samples
        (not yet on the host, as on a real stage). ``catchup``: the step's
        ``draft_catchup``."""
        sampled = []
        size = self.blocks.block_size
        for r, (item, table) in enumerate(zip(batch.seqs, tables, strict=True)):
            seq = item.seq
            extra = ahead[seq.seq_id] if ahead else []
            start = item.start
            if ahead:  # a continuation: its start is after the tokens sampled in flight
                assert len(extra) == start - seq.num_computed_tokens
            else:  # a prompt chunk may start after chunks still in flight, never past
                assert start <= len(seq.all_token_ids)  # the tokens the host knows
            tokens = list(seq.all_token_ids) + extra
            draft = item.draft
            if self.draft_model and batch.mode is not StepMode.DECODE_ROUND:
                draft = self._draft(item, table, tokens, catchup[r] if catchup else [])
            tokens += draft  # drafts: fed, unconfirmed
            end = start + item.num_tokens
            out = []
            for _ in range(batch.num_steps):
                for pos in range(start, end):
                    block = seq.block_table[pos // self.blocks.block_size]
                    assert self.blocks.ref_count(block) == 1, "write into a shared block"
                    assert self.blocks.hash_of(block) is None, "write into a cached block"
                    self.cache[self.blocks.slot(seq, pos)] = tuple(tokens[:pos + 1])
                for pos in range(end):  # what attention reads, through the stage's table
                    slot = table[pos // size] * size + pos % size
                    assert self.cache.get(slot) == tuple(tokens[:pos + 1]), (
                        "cache holds another prefix")
                if not item.sample:
                    break
                if draft:  # verify: the target samples every drafted position
                    first = end - len(draft)
                    samples = [_next_token(tokens[:p]) for p in range(first, end + 1)]
                    accepted = next((j for j, t in enumerate(draft) if samples[j] != t),
                                    len(draft))
                    out.extend(samples[:accepted + 1])
                    break
                out.append(_next_token(tokens[:end]))
                tokens.append(out[-1])
                start, end = end, end + 1
            if item.sample:
                sampled.append(out)
        return sampled

    def _draft(self, item, table: list[int], tokens: list[int], catchup: list[int]) -> list[int]:
        """The draft model's part of ``item`` on the first stage: its drafted tokens."""
        size, start, d = self.blocks.block_size, item.start, len(item.draft)
        first = start - len(catchup)
        assert catchup == tokens[first:start], "catch-up tokens are not the sequence's"
        for pos in range(first):  # what the draft's attention reads before its new tokens
            slot = table[pos // size] * size + pos % size
            assert self.draft_cache.get(slot) == tuple(tokens[:pos + 1]), (
                "the draft's cache holds another prefix")
        real_end = start + item.num_tokens - d
        proposal = TruthfulFor().propose(tokens[:real_end], d) if d else []
        fed = tokens[:real_end] + proposal[:-1]  # the last draft is not fed
        for pos in range(first, len(fed)):
            block = item.seq.block_table[pos // size]
            assert self.blocks.ref_count(block) == 1, "draft write into a shared block"
            assert self.blocks.hash_of(block) is None, "draft write into a cached block"
            self.draft_cache[self.blocks.slot(item.seq, pos)] = tuple(fed[:pos + 1])
        return proposal


def _expected(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(_next_token(tokens))
    return tokens[len(prompt):]


def _sized(**limits) -> SchedulerConfig:
    return SchedulerConfig(**limits).size_for("cpu")


class TruthfulFor:
    """A test proposer: the true continuation for a number of tokens that the context
    picks (0 .. k), then a wrong token."""

    def draft(self, seq: Sequence, k: int) -> list[int]:
        return self.propose(seq.all_token_ids, k)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        good, out = hash(tuple(tokens)) % (k + 1), []
        for _ in range(k):
            out.append(_next_token(tokens + out))
        if good < k:
            out[good] = (out[good] + 1) % 97
        return out


def _simulate(prompts, max_tokens, num_blocks, block_size, inflight, max_seqs, max_tokens_step,
              arrivals, decode_steps=1, rounds_ahead=False, caching=True, aborts=(), speculate=0,
              pp=1, chunk_tokens=None, hidden_size=None, on_schedule=None,
              balanced_decode=True, draft_model=False):
    """Run every request to its end; ``aborts``: (step, request index) pairs;
    ``speculate``: draft up to that many tokens per decode row (a proposer right for
    some of them); ``pp`` > 1: sized for that many stages (prompt chunks pipelined);
    ``chunk_tokens``, ``hidden_size``: the chunk policy's limit and cost model;
    ``on_schedule(batch, queue)``: called with each micro-batch as it is formed;
    ``draft_model``: drafts come from a (fake) draft model on the first stage."""
    blocks = BlockManager(num_blocks, block_size, enable_caching=caching)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens_step,
                             max_inflight=inflight, num_decode_steps=decode_steps,
                             async_scheduling=rounds_ahead,
                             long_prefill_chunk_tokens=chunk_tokens,
                             balanced_decode=balanced_decode).size_for("cpu", pp)
    spec = None
    if speculate:
        spec = SpeculativeConfig(num_speculative_tokens=speculate, model="draft"
                                 if draft_model else None)
    sched = Scheduler(config, blocks, max_model_len=10_000, speculative=spec,
                      hidden_size=hidden_size)
    if spec is not None and not draft_model:
        sched.rounds.speculator.proposer = TruthfulFor()
    pipe = FakePipeline(blocks, draft_model=bool(speculate and draft_model))
    # lean steps: the builder sends block-table changes, a stage's mirror resolves them
    builder, mirror = StepBuilder(sched), BlockTableMirror(block_size)

    def submit(batch: MicroBatch, ahead: dict[int, list[int]] | None = None) -> list[list[int]]:
        step = builder.build(batch)
        tables = mirror.resolve(step).block_tables
        assert tables == [s.seq.block_table for s in batch.seqs]
        return pipe.run(batch, tables, ahead, step.draft_catchup)

    seqs = [Sequence(i, str(i), 0, p, SamplingParams(max_tokens=m), seed=0)
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    pending = deque(zip(arrivals, seqs))
    abort_at = sorted(aborts)
    aborted = set()
    queue: deque[tuple[MicroBatch, list[int]]] = deque()
    step = continuations = 0
    while pending or sched.has_unfinished() or queue:
        while pending and pending[0][0] <= step:
            sched.add(pending.popleft()[1])
        while abort_at and abort_at[0][0] <= step:  # as LLMEngine.abort_request, maybe in flight
            seq = seqs[abort_at.pop(0)[1]]
            if seq in sched.waiting or seq in sched.running:
                seq.status = SequenceStatus.FINISHED
                sched.finish(seq)
                aborted.add(seq.seq_id)
        while (batch := sched.schedule()) is not None:  # the scheduler keeps the count
            assert len(queue) < inflight
            # a sequence in flight joins only with its prompt's next chunk, after its
            # earlier chunks, none of which samples (and no continuation is in flight)
            for item in batch.seqs:
                earlier = [(b, i) for b, _ in queue for i in b.seqs if i.seq is item.seq]
                assert all(not i.sample and b.num_steps == 1 for b, i in earlier), (
                    "seq in two batches")
                if earlier:
                    b, last = earlier[-1]
                    assert item.start == last.start + last.num_tokens
            assert batch.num_steps == 1 or all(s.num_tokens == 1 for s in batch.seqs)
            if on_schedule is not None:
                on_schedule(batch, queue)
            queue.append((batch, submit(batch)))
        _check_blocks(sched, blocks, pipe)
        step += 1
        if not queue:
            assert pending or not sched.has_unfinished(), "nothing scheduled although work remains"
            continue
        batch, tokens = queue.popleft()
        nxt = sched.continue_batch(batch)  # as LLMEngine does: the scheduler decides
        if nxt is not None:
            assert rounds_ahead and not queue and not sched.can_admit()
            by_seq = {s.seq.seq_id: row for s, row in zip(batch.seqs, tokens)}
            queue.append((nxt, submit(nxt, by_seq)))
            continuations += 1
        sched.complete(batch, sampled=tokens)
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
    _check_blocks(sched, blocks, pipe)
    for seq, prompt, m in zip(seqs, prompts, max_tokens):
        if seq.seq_id not in aborted:
            assert seq.output_token_ids == _expected(prompt, m)
    if not caching:
        assert blocks.num_cached == 0 and all(s.num_cached_tokens == 0 for s in seqs)
    return sched, continuations


def _check_blocks(sched: Scheduler, blocks: BlockManager, pipe: FakePipeline) -> None:
    """Reference counts are the owners; a sequence's blocks after its registered ones
    are its own; every cached block holds the tokens its hash names."""
    owners = Counter(b for s in sched.running for b in s.block_table)
    assert all(blocks.ref_count(b) == n for b, n in owners.items())
    assert len(owners) + blocks.num_free == blocks.num_blocks
    for s in sched.running:
        assert len(set(s.block_table)) == len(s.block_table)
        assert all(owners[b] == 1 and blocks.hash_of(b) is None
                   for b in s.block_table[s.num_registered_blocks:])
    for s in sched.waiting:
        assert s.block_table == [] and s.num_computed_tokens == 0
    size = blocks.block_size
    for b in range(blocks.num_blocks):
        if blocks.hash_of(b) is not None:
            prefix = pipe.cache[(b + 1) * size - 1]  # the block's last slot: its whole prefix
            assert len(prefix) % size == 0
            chain = ROOT_HASH
            for i in range(0, len(prefix), size):
                chain = hash_block(chain, prefix[i:i + size])
            assert blocks.hash_of(b) == chain
            if pipe.draft_model:  # a cached block holds the draft's KV too
                base = len(prefix) - size
                assert all(pipe.draft_cache.get(b * size + i) == prefix[:base + i + 1]
                           for i in range(size)), "a cached block lacks the draft's KV"


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
    speculate=st.sampled_from([0, 0, 1, 3]),
    draft_model=st.booleans(),
    pipelined=st.booleans(),
    chunk_tokens=st.sampled_from([None, None, 1, 3, 8]),
    hidden_size=st.sampled_from([None, 1, 4]),
)
def test_scheduler_outputs_are_independent_of_scheduling(data, block_size, inflight, max_seqs,
                                                         step_tokens, spare_blocks, decode_steps,
                                                         rounds_ahead, speculate, draft_model,
                                                         pipelined, chunk_tokens, hidden_size):
    """Any mix of budgets, rounds, drafts (``draft_model``: from a draft model on the
    first stage, whose cache must always hold what it reads), preemption, prefix hits and
    (``pipelined``: sized for ``inflight`` stages) prompt chunks in flight together gives
    the outputs of the sequences run alone."""
    prompts = [[(7 * i + j) % 50 for j in range(n)] for i, (n, _, _) in enumerate(data)]
    max_tokens = [m for _, m, _ in data]
    arrivals = sorted(a for _, _, a in data)
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    num_blocks = -(-longest // block_size) + spare_blocks
    _simulate(prompts, max_tokens, num_blocks, block_size, inflight, max_seqs, step_tokens,
              arrivals, decode_steps, rounds_ahead, speculate=speculate,
              pp=inflight if pipelined else 1, chunk_tokens=chunk_tokens, hidden_size=hidden_size,
              draft_model=draft_model)


def test_tight_budget_preempts_and_still_matches():
    prompts = [[i, i + 1, i + 2, i + 3, i + 4] for i in range(8)]
    sched, _ = _simulate(prompts, [20] * 8, num_blocks=8, block_size=4, inflight=2, max_seqs=8,
                      max_tokens_step=64, arrivals=[0] * 8)
    assert sched.num_preemptions > 0


def test_decode_horizon_respects_wanted_tokens_model_length_and_free_blocks():
    def horizon(max_tokens, prompt_len=6, num_blocks=100, max_model_len=10_000, penalty=0.0):
        blocks = BlockManager(num_blocks, 4)
        sched = Scheduler(_sized(max_num_seqs=8, max_num_batched_tokens=512,
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
    sched = Scheduler(_sized(max_num_seqs=8, max_num_batched_tokens=512,
                                      num_decode_steps=steps), blocks, max_model_len)
    for i, m in enumerate(max_tokens):
        sched.add(Sequence(i, str(i), 0, list(range(prompt_len)), SamplingParams(max_tokens=m),
                           seed=0))
    prefill = sched.schedule()
    sched.complete(prefill)
    for item in prefill.seqs:
        item.seq.output_token_ids.append(1)
    return sched, sched.schedule()


def test_a_waiting_request_that_could_join_gets_single_steps():
    """Multi-step rounds only while no waiting request could join: with one waiting and a
    free sequence slot, the decode batch takes one step (its prefill then joins at once);
    once the slots are full, rounds are multi-step again."""
    sched, batch = _decoding(num_blocks=64, max_tokens=[20, 20])
    assert batch.num_steps == 4  # nothing waits
    sched.complete(batch)
    for item in batch.seqs:
        item.seq.output_token_ids.extend([1] * 4)
    sched.add(Sequence(9, "9", 0, list(range(50, 59)), SamplingParams(max_tokens=20), seed=0))
    mixed = sched.schedule()  # the waiting one joins this batch: prefill, one step
    assert mixed.num_steps == 1 and len(mixed.seqs) == 3
    sched.config.max_num_seqs = 3  # all slots taken now
    sched.complete(mixed)
    for item in mixed.seqs:
        item.seq.output_token_ids.append(1)
    sched.add(Sequence(10, "10", 0, list(range(60, 69)), SamplingParams(max_tokens=20), seed=0))
    assert not sched.can_admit()
    assert sched.schedule().num_steps == 4  # it could not join anyway


def test_a_waiting_request_blocked_by_the_token_budget_is_not_held_back():
    sched, batch = _decoding(num_blocks=64, max_tokens=[20, 20])
    sched.complete(batch)
    for item in batch.seqs:
        item.seq.output_token_ids.extend([1] * 4)
    sched.config.max_num_batched_tokens = 2  # the decodes use the whole step budget
    sched.add(Sequence(9, "9", 0, list(range(50, 59)), SamplingParams(max_tokens=20), seed=0))
    step = sched.schedule()
    assert [len(step.seqs), step.num_steps] == [2, 1] and sched.can_admit()


def test_continue_batch_room_blocks_and_in_flight_counts():
    sched, first = _decoding(num_blocks=100, max_tokens=[100, 6])
    assert first.num_steps == 4 and first.continues is None
    assert [(s.start, s.seq.num_tokens_ahead) for s in first.seqs] == [(6, 4), (6, 4)]
    nxt = sched.continue_batch(first)
    assert nxt is not None and nxt.continues is first
    # the second sequence has 1 + 4 of its 6 tokens once ``first`` ends: room for one more
    assert [s.seq.seq_id for s in nxt.seqs] == [0, 1] and nxt.num_steps == 4
    assert [s.start for s in nxt.seqs] == [10, 10]  # after first's four positions
    assert all(s.seq.num_inflight_tokens == 8 and s.seq.num_tokens_ahead == 8
               for s in nxt.seqs)
    assert sched.num_inflight_batches == 2
    for item in nxt.seqs:  # blocks cover every position the continuation writes
        assert len(item.seq.block_table) * 4 >= item.seq.num_tokens + 4 + 4 - 1
    sched.complete(first)
    assert all(s.seq.num_inflight_tokens == 4 for s in nxt.seqs)
    assert [s.seq.num_computed_tokens for s in nxt.seqs] == [10, 10]
    assert sched.num_inflight_batches == 1

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
    assert first.seqs[0].seq.num_inflight_tokens == 4


def test_long_prompt_is_chunked():
    sched, _ = _simulate([list(range(100))], [3], num_blocks=40, block_size=4, inflight=1,
                      max_seqs=4, max_tokens_step=16, arrivals=[0])
    assert sched.num_preemptions == 0


def _rows_per_batch(pp: int, prompts: list[list[int]], max_tokens: list[int], arrivals,
                    step_tokens: int = 512, balanced_decode: bool = True
                    ) -> list[tuple[int, list[int]]]:
    """Per micro-batch of a ``pp``-stage simulation: its decode rows, and the request
    indices of its prompt rows."""
    rows: list[tuple[int, list[int]]] = []

    def record(batch: MicroBatch, queue) -> None:
        prompt = [i.seq.seq_id for i in batch.seqs if i.start < len(i.seq.prompt_token_ids)]
        rows.append((len(batch.seqs) - len(prompt), prompt))

    _simulate(prompts, max_tokens, num_blocks=400, block_size=4, inflight=pp, max_seqs=64,
              max_tokens_step=step_tokens, arrivals=arrivals, pp=pp, on_schedule=record,
              balanced_decode=balanced_decode)
    return rows


def test_decode_rows_spread_evenly_over_the_micro_batches():
    """pp micro-batches in flight: in steady state (everyone decoding) the decode rows of
    consecutive micro-batches differ by at most one, whatever order requests came in."""
    for pp, n in ((2, 9), (3, 16), (4, 7)):
        prompts = [[(5 * i + j) % 50 for j in range(3 + i % 4)] for i in range(n)]
        rows = _rows_per_batch(pp, prompts, [60] * n, [i // 3 for i in range(n)])
        steady = [d for d, _ in rows[len(rows) // 3:len(rows) * 2 // 3]]  # none finished
        windows = [steady[i:i + pp] for i in range(0, len(steady) - pp + 1)]
        assert steady and all(max(w) - min(w) <= 1 for w in windows), (pp, steady)
        assert sum(steady[:pp]) == n  # every running decode, once per pp micro-batches


def test_without_balanced_decode_the_decodes_bunch_up():
    """``balanced_decode=False`` (the comparison the mixed-workload benchmark makes): the
    next micro-batch takes every ready decode row, so once all decode they travel as one
    micro-batch and the pipeline's other slots stay empty; balanced, no micro-batch holds
    more than ``ceil(decodes / pp)``."""
    n, pp = 9, 3
    prompts = [[(5 * i + j) % 50 for j in range(3 + i % 4)] for i in range(n)]
    for balanced, most in ((False, n), (True, -(-n // pp))):
        rows = _rows_per_batch(pp, prompts, [60] * n, [i // 3 for i in range(n)],
                               balanced_decode=balanced)
        steady = [d for d, _ in rows[len(rows) // 3:len(rows) * 2 // 3]]
        assert steady and max(steady) == most, (balanced, steady)


def test_the_decode_cap_never_holds_back_a_prefill():
    """A request that arrives while 12 sequences decode joins the next micro-batch that
    has token budget, although that micro-batch is at its decode cap."""
    prompts = [[i, i + 1] for i in range(12)] + [list(range(30))]
    rows = _rows_per_batch(2, prompts, [30] * 12 + [2], [0] * 12 + [8])
    joined = [decodes for decodes, prompt in rows if 12 in prompt]
    assert joined == [6]  # the decode cap (ceil(12 / 2)) reached, and the prompt joined


def test_a_long_prompt_has_a_chunk_on_every_stage():
    """pp=3, one 100-token prompt, a 30-token step: three of its chunks are in flight at
    once (one per stage) and it finishes with the same output."""
    chunks_in_flight: list[int] = []

    def record(batch: MicroBatch, queue) -> None:
        chunks_in_flight.append(len(queue) + 1)

    sched, _ = _simulate([list(range(100))], [3], num_blocks=40, block_size=4, inflight=3,
                         max_seqs=4, max_tokens_step=30, arrivals=[0], pp=3, on_schedule=record)
    assert max(chunks_in_flight) == 3


def test_balanced_chunks_shrink_as_the_context_grows():
    """With the cost model on, later chunks of one prompt are smaller, never below the
    minimum; without it every chunk but the last is the limit."""
    for hidden_size, shrinking in ((None, False), (2, True)):
        sizes: list[int] = []

        def record(batch: MicroBatch, queue, sizes=sizes) -> None:
            sizes.extend(i.num_tokens for i in batch.seqs if not i.sample or i.start == 0)

        _simulate([list(range(300))], [1], num_blocks=100, block_size=4, inflight=2,
                  max_seqs=1, max_tokens_step=128, arrivals=[0], pp=2, hidden_size=hidden_size,
                  on_schedule=record)
        assert sizes[0] == 64  # the step's budget over the stages
        if shrinking:
            assert all(a >= b for a, b in zip(sizes, sizes[1:-1])) and sizes[-2] < sizes[0]
            assert min(sizes[:-1]) >= 16
        else:
            assert set(sizes[:-1]) == {64}


# -- the prefix cache --------------------------------------------------------------------------
def _family_prompts(data: list[tuple[int, int, int]]) -> list[list[int]]:
    """Prompts that share long prefixes: (family, shared length, own length) each."""
    families = [[(13 * f + 5 * j + j * j) % 50 for j in range(48)] for f in range(3)]
    return [families[f][:shared] + [(31 * i + 7 * j) % 50 for j in range(own)]
            or [i % 50] for i, (f, shared, own) in enumerate(data)]


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 48), st.sampled_from([0, 0, 1, 3, 9]),
                            st.integers(1, 10), st.integers(0, 30)), min_size=1, max_size=12),
    block_size=st.sampled_from([1, 2, 4, 8]),
    inflight=st.integers(1, 3),
    max_seqs=st.integers(1, 8),
    step_tokens=st.integers(1, 64),
    spare_blocks=st.integers(0, 24),
    decode_steps=st.sampled_from([1, 1, 2, 5]),
    rounds_ahead=st.booleans(),
    aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 11)), max_size=3),
    speculate=st.sampled_from([0, 0, 2]),
    draft_model=st.booleans(),
)
def test_prefix_cache_hits_never_change_outputs(data, block_size, inflight, max_seqs, step_tokens,
                                               spare_blocks, decode_steps, rounds_ahead, aborts,
                                               speculate, draft_model):
    """Shared prefixes, identical prompts, preemption, eviction, aborts in flight,
    multi-step and asynchronous rounds: the cache only ever supplies the right KV."""
    prompts = _family_prompts([(f, shared, own) for f, shared, own, _, _ in data])
    max_tokens = [m for *_, m, _ in data]
    arrivals = sorted(a for *_, a in data)
    aborts = [(step, i) for step, i in aborts if i < len(prompts)]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    num_blocks = -(-longest // block_size) + spare_blocks
    sched, _ = _simulate(prompts, max_tokens, num_blocks, block_size, inflight, max_seqs,
                         step_tokens, arrivals, decode_steps, rounds_ahead, aborts=aborts,
                         speculate=speculate, draft_model=draft_model)
    assert sched.prefix_cache_hits <= sched.prefix_cache_queries


def test_prefix_cache_on_and_off_agree_and_hits_are_counted():
    prompts = _family_prompts([(0, 40, 3), (0, 40, 5), (0, 33, 0), (1, 20, 2), (0, 40, 3)])
    runs = {caching: _simulate(prompts, [6] * 5, num_blocks=200, block_size=4, inflight=1,
                               max_seqs=1, max_tokens_step=64, arrivals=[0] * 5,
                               caching=caching)[0]
            for caching in (False, True)}
    assert runs[False].prefix_cache_queries == runs[False].prefix_cache_hits == 0
    on = runs[True]
    # one at a time: each request finds what the earlier ones computed; the last is the
    # first's twin (43 tokens), which computes only its last block's 3 tokens
    assert on.prefix_cache_queries == sum(map(len, prompts))
    assert on.prefix_cache_hits == 0 + 40 + 32 + 0 + 40


def _admit(sched: Scheduler, seq: Sequence) -> MicroBatch:
    sched.add(seq)
    batch = sched.schedule()
    assert batch is not None and batch.seqs[-1].seq is seq
    return batch


def _seq(i: int, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(i, str(i), 0, list(tokens), SamplingParams(max_tokens=max_tokens), seed=0)


def test_identical_prompt_computes_only_its_last_block():
    for length in (16, 17, 19, 5):
        blocks = BlockManager(64, 4)
        sched = Scheduler(_sized(max_num_seqs=4, max_num_batched_tokens=512), blocks, 1000)
        first = _admit(sched, _seq(0, range(length)))
        sched.complete(first)
        again = _admit(sched, _seq(1, range(length)))
        item = again.seqs[0]
        cached = (length - 1) // 4 * 4  # a whole-block hit, never the last token
        assert item.seq.num_cached_tokens == item.seq.num_computed_tokens == cached
        assert item.num_tokens == length - cached >= 1 and item.sample
        assert item.seq.block_table[:cached // 4] == first.seqs[0].seq.block_table[:cached // 4]
        assert item.seq.block_table[cached // 4:] != first.seqs[0].seq.block_table[cached // 4:]
        assert all(blocks.ref_count(b) == 2 for b in item.seq.block_table[:cached // 4])


def test_blocks_are_cached_only_once_computed():
    """A block's hash is registered when the step that filled it completes: a twin
    scheduled while it is in flight computes everything itself."""
    blocks = BlockManager(64, 4)
    sched = Scheduler(_sized(max_num_seqs=4, max_num_batched_tokens=8, max_inflight=2), blocks,
                      1000)
    first = _admit(sched, _seq(0, range(9)))  # a chunk of 8: blocks 0 and 1
    assert blocks.num_cached == 0
    twin = _admit(sched, _seq(1, range(9)))  # scheduled while ``first`` is in flight
    assert twin.seqs[0].seq.num_cached_tokens == 0
    sched.complete(first)
    assert blocks.num_cached == 2
    sched.complete(twin)  # the same content: the first computed copy stays the cached one
    assert blocks.num_cached == 2
    sched.config.max_inflight = 1  # one batch: room for every running sequence in it
    third = _admit(sched, _seq(2, range(9)))
    assert third.seqs[-1].num_tokens == 1 and third.seqs[-1].seq.num_cached_tokens == 8
    assert third.seqs[-1].seq.block_table[:2] == first.seqs[0].seq.block_table[:2]


def test_failed_step_caches_nothing():
    blocks = BlockManager(64, 4)
    sched = Scheduler(_sized(max_num_seqs=4, max_num_batched_tokens=64), blocks, 1000)
    batch = _admit(sched, _seq(0, range(12)))
    sched.complete(batch, ok=False)
    seq = batch.seqs[0].seq
    assert seq.num_computed_tokens == 0 and seq.num_inflight_tokens == 0
    seq.status = SequenceStatus.FINISHED
    sched.finish(seq)
    assert blocks.num_cached == 0 and blocks.num_free == 64


def test_freed_cached_blocks_are_evicted_least_recently_released_first():
    blocks = BlockManager(6, 2)
    a, b = _seq(0, [1, 2, 3, 4, 5]), _seq(1, [7, 8, 9, 10, 11])
    for seq in (a, b):  # each: 2 full blocks + 1 partial block
        blocks.allocate(seq, 5)
        seq.num_computed_tokens = 5
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_free == 6 and blocks.num_cached == 4
    # the partial blocks hold nothing reusable: reused first; then a's tail, a's head, ...
    c = _seq(2, [20] * 6)
    blocks.allocate(c, 6)
    assert c.block_table == [b_blocks[2], a_blocks[2], a_blocks[1]]
    assert blocks.num_cached == 3
    assert blocks.find_cached(_seq(3, [1, 2, 3, 4, 5])) == [a_blocks[0]]  # a's chain broke
    assert blocks.find_cached(_seq(5, [7, 8, 9, 10, 11])) == b_blocks[:2]
    # a hit takes free cached blocks out of the free queue, so they count against it
    d = _seq(6, [7, 8, 9, 10, 11])
    hit = blocks.find_cached(d)
    assert blocks.num_free == 3
    assert not blocks.can_allocate(d, 7, hit) and blocks.can_allocate(d, 6, hit)
    blocks.allocate(d, 6, hit)
    assert d.block_table == [*b_blocks[:2], a_blocks[0]] and d.num_computed_tokens == 4
    assert blocks.num_free == 0 and blocks.num_cached == 2  # a's head was evicted last
    blocks.free(c)
    assert not blocks.reset_cache()  # d holds blocks
    blocks.free(d)
    assert blocks.reset_cache() and blocks.num_cached == 0
    assert blocks.find_cached(_seq(7, [7, 8, 9, 10, 11])) == []


def test_crafted_colliding_token_runs_are_never_reused():
    """Token runs that naive keys confuse get distinct hashes, and never share blocks."""
    big = 2**61 - 1  # Python's hash(big) == hash(0): tuple hashing collides on these
    assert hash((ROOT_HASH, (big, 1))) == hash((ROOT_HASH, (0, 1)))
    pairs = [
        ([big, 1], [0, 1]),  # equal under Python's hash()
        ([1, 23], [12, 3]),  # equal as joined decimal strings
        ([256, 0], [0, 1]),  # equal as 1-byte little-endian runs (256 -> 0x00 0x01)
        ([1, 2], [2, 1]),  # same multiset
    ]
    for x, y in pairs:
        assert hash_block(ROOT_HASH, x) != hash_block(ROOT_HASH, y)
    # the same tokens after different prefixes are different blocks
    assert hash_block(hash_block(ROOT_HASH, [1, 2]), [5, 6]) != hash_block(
        hash_block(ROOT_HASH, [3, 4]), [5, 6])
    for x, y in pairs + [([1, 2, 5, 6], [3, 4, 5, 6])]:
        blocks = BlockManager(16, 2)
        first = _seq(0, x + [9])
        blocks.allocate(first, len(first.prompt_token_ids))
        first.num_computed_tokens = len(x)
        first_blocks = list(first.block_table)
        blocks.free(first)
        assert blocks.num_cached == len(x) // 2
        assert blocks.find_cached(_seq(1, y + [9])) == []
        assert blocks.find_cached(_seq(2, x + [9])) == first_blocks[:len(x) // 2]


def test_token_slices_cross_the_prompt_output_boundary():
    seq = _seq(0, range(5))
    seq.output_token_ids.extend([10, 11, 12])
    everything = seq.all_token_ids
    for start in range(len(everything) + 1):
        for end in range(start, len(everything) + 1):
            assert seq.token_ids(start, end) == everything[start:end]


def test_round_policy_marks_rounds_only_where_the_stage_can_loop():
    """A decode micro-batch is a DECODE_ROUND (and may be continued) on a one-stage
    pipeline only; with penalties, or on a pipeline of stages, it is a plain FORWARD,
    never continued, and the scheduler forms no more micro-batches than max_inflight."""
    for pp, penalty, mode in ((1, 0.0, StepMode.DECODE_ROUND), (1, 0.5, StepMode.FORWARD),
                              (2, 0.0, StepMode.FORWARD)):
        blocks = BlockManager(64, 4)
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                 max_inflight=1).size_for("cpu", pipeline_parallel_size=pp)
        sched = Scheduler(config, blocks, 1000)
        sched.add(Sequence(0, "0", 0, [1, 2, 3], SamplingParams(presence_penalty=penalty), seed=0))
        prefill = sched.schedule()
        assert prefill.mode is StepMode.FORWARD and sched.schedule() is None  # one in flight
        sched.complete(prefill)
        prefill.seqs[0].seq.output_token_ids.append(1)
        batch = sched.schedule()
        assert batch.mode is mode and batch.seqs[0].start == 3
        nxt = sched.continue_batch(batch)
        assert (nxt is not None) is (mode is StepMode.DECODE_ROUND)


def test_speculation_accepts_and_rejects_without_changing_outputs():
    """Drafts partly right: accepted ones count as computed, rejected ones' KV is
    overwritten in place (the fake pipeline's reads would see it otherwise); with a tight
    cache, drafts are dropped rather than preempting anyone."""
    prompts = [[i, i + 1, i + 2, i + 3] for i in range(6)]
    max_tokens = [30, 7, 19, 25, 11, 30]
    sched, _ = _simulate(prompts, max_tokens, num_blocks=60, block_size=4, inflight=2,
                         max_seqs=6, max_tokens_step=64, arrivals=[0, 0, 0, 2, 4, 6], speculate=3)
    spec = sched.rounds.speculator
    assert spec.drafted > spec.accepted > 0
    tight, _ = _simulate(prompts, max_tokens, num_blocks=30, block_size=4, inflight=1,
                         max_seqs=6, max_tokens_step=64, arrivals=[0] * 6, speculate=3)
    plain, _ = _simulate(prompts, max_tokens, num_blocks=30, block_size=4, inflight=1,
                         max_seqs=6, max_tokens_step=64, arrivals=[0] * 6)
    assert tight.num_preemptions <= plain.num_preemptions


def test_a_draft_model_catches_up_on_what_it_did_not_feed():
    """Drafts from a first-stage draft model: a row whose draft is accepted whole leaves
    the draft one position behind, and a decode round runs no draft at all; the next step
    catches up (the fake pipeline checks the draft's cache before every draft read)."""
    prompts = [[i, i + 1, i + 2, i + 3] for i in range(6)]
    catchups: list[int] = []

    def count(batch, queue):
        catchups.extend(len(item.draft_catchup) for item in batch.seqs)

    for decode_steps in (1, 4):
        sched, _ = _simulate(prompts, [30, 7, 19, 25, 11, 30], num_blocks=60, block_size=4,
                             inflight=1, max_seqs=6, max_tokens_step=64,
                             arrivals=[0, 0, 0, 2, 4, 6], decode_steps=decode_steps,
                             speculate=3, draft_model=True, on_schedule=count)
        spec = sched.rounds.speculator
        assert spec.drafted > spec.accepted > 0
    assert max(catchups) > 1  # after a decode round of several steps


def test_pipelined_prefill_defaults_off_only_where_stages_share_a_gpu():
    """Stages sharing one GPU cannot compute at once: the default leaves chunks unpipelined
    there (measured slower, benchmarks/gpu/README.md run 14); an explicit choice stands."""
    assert SchedulerConfig().size_for("cpu", 2).pipelined_prefill is True
    assert SchedulerConfig().size_for("cuda", 2).pipelined_prefill is True
    assert SchedulerConfig().size_for("cuda", 2, stages_share_device=True).pipelined_prefill is False
    forced = SchedulerConfig(pipelined_prefill=True).size_for("cuda", 2, stages_share_device=True)
    assert forced.pipelined_prefill is True
