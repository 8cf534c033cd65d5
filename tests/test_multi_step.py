"""Multi-step decode (``num_decode_steps``): several decode steps per round trip to
the stage must give exactly the outputs of one step at a time."""

from __future__ import annotations

import pytest
from hf_reference import corpus_prompts, hf_greedy

from raypp import LLM, SamplingParams

LENGTHS = [1, 3, 5, 8, 11, 2, 17, 23, 29, 31, 4, 6]
GREEDY = SamplingParams(temperature=0, max_tokens=10)  # not a multiple of the 4 steps


def _inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _completions(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


@pytest.fixture(scope="module")
def multi(ray_cluster, tiny_llama):
    with LLM(str(tiny_llama), num_decode_steps=4, max_num_seqs=8, seed=3) as llm:
        yield llm


@pytest.fixture(scope="module")
def single(ray_cluster, tiny_llama):
    with LLM(str(tiny_llama), max_num_seqs=8, seed=3) as llm:
        yield llm


@pytest.fixture(scope="module")
def multi_sync(ray_cluster, tiny_llama):
    """Multi-step rounds, each submitted only after the previous one's result is read."""
    with LLM(str(tiny_llama), num_decode_steps=4, max_num_seqs=8, seed=3,
             async_scheduling=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def single_sync(ray_cluster, tiny_llama):
    """One step per round trip, each submitted only after the previous one's result is read."""
    with LLM(str(tiny_llama), max_num_seqs=8, seed=3, async_scheduling=False) as llm:
        yield llm


def _async_and_sync(request, steps: int):
    """The engines with ``steps`` decode steps per round, asynchronous and not."""
    names = ("multi", "multi_sync") if steps > 1 else ("single", "single_sync")
    return tuple(request.getfixturevalue(name) for name in names)


@pytest.fixture(scope="module")
def prompts(single):
    return corpus_prompts(single.get_tokenizer(), LENGTHS)


def test_greedy_equals_transformers_in_fewer_steps(multi, single, tiny_llama, prompts):
    reference = hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
    steps_before = multi.engine.stats.steps
    outs = multi.generate(_inputs(prompts), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    multi_steps = multi.engine.stats.steps - steps_before
    assert multi.engine.stats.rounds_ahead > 0  # asynchronous scheduling is on by default
    steps_before = single.engine.stats.steps
    single.generate(_inputs(prompts), GREEDY, use_tqdm=False)
    single_steps = single.engine.stats.steps - steps_before
    assert multi_steps < single_steps / 2, (multi_steps, single_steps)
    blocks = multi.engine.block_manager
    assert blocks.num_free == blocks.num_blocks


def test_seeded_sampling_and_logprobs_equal_single_steps(multi, single, prompts):
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=i, max_tokens=9,
                             logprobs=3, n=2) for i in range(len(prompts))]
    a = multi.generate(_inputs(prompts), params, use_tqdm=False)
    b = single.generate(_inputs(prompts), params, use_tqdm=False)
    assert _completions(a) == _completions(b)
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert len(cx.logprobs) == len(cx.token_ids)
            for px, py in zip(cx.logprobs, cy.logprobs):
                assert px.keys() == py.keys()
                for t in px:
                    assert px[t].rank == py[t].rank
                    assert px[t].logprob == pytest.approx(py[t].logprob, abs=1e-4)


def test_stops_mid_way_drop_the_extra_tokens(multi, single, prompts):
    tok = single.get_tokenizer()
    free_run = single.generate(_inputs(prompts[:6]), GREEDY, use_tqdm=False)
    # stop on a token / a string that each greedy run meets part-way through a multi-step
    params = []
    for o in free_run:
        ids = o.outputs[0].token_ids
        params.append(SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[5]]))
        text = tok.decode(ids[:7], skip_special_tokens=True)
        params.append(SamplingParams(temperature=0, max_tokens=10, stop=[text[-3:]]))
        params.append(SamplingParams(temperature=0, max_tokens=10, stop=[text[-3:]],
                                     include_stop_str_in_output=True))
    inputs = [p for p in _inputs(prompts[:6]) for _ in range(3)]
    a = multi.generate(inputs, params, use_tqdm=False)
    b = single.generate(inputs, params, use_tqdm=False)
    assert _completions(a) == _completions(b)
    assert any(len(o.outputs[0].token_ids) < 10 for o in a)
    assert {o.outputs[0].finish_reason for o in a} == {"stop"}
    blocks = multi.engine.block_manager
    assert blocks.num_free == blocks.num_blocks


def test_penalties_fall_back_to_single_steps(multi, single, prompts):
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=8, repetition_penalty=1.3,
                            frequency_penalty=0.4)
    a = multi.generate(_inputs(prompts[:5]), params, use_tqdm=False)
    b = single.generate(_inputs(prompts[:5]), params, use_tqdm=False)
    assert _completions(a) == _completions(b)


def test_streamed_tokens_arrive_in_groups_of_at_most_k(multi, prompts):
    """Per-step outputs of a multi-step engine grow by 1..K tokens (K = 4 here), and
    by more than one once decoding runs several steps per round trip."""
    engine = multi.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"stream-{i}", {"prompt_token_ids": p}, params)
    seen: dict[str, int] = {}
    growth: list[int] = []
    engine.emit_unfinished = True
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                growth.append(n - seen.get(out.request_id, 0))
                seen[out.request_id] = n
    finally:
        engine.emit_unfinished = False
    assert seen == {f"stream-{i}": 10 for i in range(3)}
    assert all(1 <= g <= 4 for g in growth), growth
    assert max(growth) == 4


@pytest.mark.parametrize("steps", [4, 1])
def test_async_scheduling_changes_no_output(request, steps, prompts):
    """Rounds submitted ahead (fed on the stage from the previous round's last tokens)
    give what rounds submitted one at a time give, with one decode step per round as
    with several: greedy, seeded sampling with logprobs, n > 1, stops by id, string
    and length mid-round."""
    multi, multi_sync = _async_and_sync(request, steps)
    free_run = multi_sync.generate(_inputs(prompts[:4]), GREEDY, use_tqdm=False)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=4 * i + 3,
                             logprobs=2, n=2) for i in range(len(prompts))]
    for o in free_run:
        ids = o.outputs[0].token_ids
        params += [SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[6]]),
                   SamplingParams(temperature=0, max_tokens=10, stop=[o.outputs[0].text[-2:]])]
    inputs = _inputs(prompts) + [p for p in _inputs(prompts[:4]) for _ in range(2)]
    ahead_before = multi.engine.stats.rounds_ahead
    a = multi.generate(inputs, params, use_tqdm=False)
    b = multi_sync.generate(inputs, params, use_tqdm=False)
    assert _completions(a) == _completions(b)
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert [lp.keys() for lp in cx.logprobs or []] == [lp.keys() for lp in cy.logprobs or []]
    assert multi.engine.stats.rounds_ahead > ahead_before
    assert multi_sync.engine.stats.rounds_ahead == 0
    for llm in (multi, multi_sync):
        blocks = llm.engine.block_manager
        assert blocks.num_free == blocks.num_blocks


@pytest.mark.parametrize("steps", [4, 1])
def test_requests_arriving_or_aborted_during_rounds_ahead(request, steps, prompts):
    """A request added while a round runs ahead is served once the running rounds
    end; one aborted with a round in flight frees its blocks and loses nobody else's
    tokens."""
    multi, multi_sync = _async_and_sync(request, steps)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in multi_sync.generate(_inputs(prompts[:3]), params, use_tqdm=False)]
    engine = multi.engine
    engine.add_request("first", {"prompt_token_ids": prompts[0]}, params)
    engine.add_request("doomed", {"prompt_token_ids": prompts[1]}, params)
    ahead_before = engine.stats.rounds_ahead
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 3:  # prefill, then rounds chained ahead
            assert engine.stats.rounds_ahead > ahead_before and engine.has_inflight_steps
            engine.abort_request("doomed")
            engine.add_request("late", {"prompt_token_ids": prompts[2]}, params)
    assert done == {"first": expected[0], "late": expected[2]}
    blocks = engine.block_manager
    assert blocks.num_free == blocks.num_blocks


def test_model_length_and_tight_cache_limits(ray_cluster, tiny_llama, prompts):
    """Horizon cut by ``max_model_len`` and by too few free blocks; with preemption."""
    long = [p for p in prompts if len(p) >= 17]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # to the context's end
    outs = {}
    for steps in (1, 6):
        with LLM(str(tiny_llama), num_decode_steps=steps, max_model_len=48, max_num_seqs=8,
                 num_blocks_override=14, seed=3) as llm:
            outs[steps] = llm.generate(_inputs(long * 2), params, use_tqdm=False)
            blocks = llm.engine.block_manager
            assert blocks.num_free == blocks.num_blocks
            preemptions = llm.engine.scheduler.num_preemptions
    assert _completions(outs[6]) == _completions(outs[1])
    assert all(len(p) + len(o.outputs[0].token_ids) == 48 for p, o in zip(long * 2, outs[6]))
    assert {o.outputs[0].finish_reason for o in outs[6]} == {"length"}
    assert preemptions > 0


def test_tensor_parallel_and_direct_plane(ray_cluster, tiny_llama, prompts):
    reference = hf_greedy(tiny_llama, prompts[:6], GREEDY.max_tokens)
    for kwargs in ({"tensor_parallel_size": 2}, {"control_plane": "direct"}):
        with LLM(str(tiny_llama), num_decode_steps=3, seed=3, **kwargs) as llm:
            outs = llm.generate(_inputs(prompts[:6]), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference, kwargs


def test_pipeline_parallel_refuses_multi_step(tiny_llama):
    with pytest.raises(ValueError, match="num_decode_steps=2 needs pipeline_parallel_size=1"):
        LLM(str(tiny_llama), pipeline_parallel_size=2, num_decode_steps=2)
    with pytest.raises(ValueError, match="num_decode_steps must be an integer >= 1"):
        LLM(str(tiny_llama), num_decode_steps=0)


def test_async_scheduling_option():
    import argparse

    from raypp.config import SchedulerConfig
    from raypp.entrypoints.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--no-async-scheduling"]))["async_scheduling"] is False
    assert "async_scheduling" not in engine_kwargs(parser.parse_args([]))  # the default: on
    assert SchedulerConfig().async_scheduling is True
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        SchedulerConfig(async_scheduling="no")


def test_limits_left_unset_are_sized_for_the_device():
    from raypp.config import AUTO_DECODE_STEPS, SchedulerConfig

    cuda = SchedulerConfig().size_for("cuda")
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens, cuda.max_inflight) == (256, 8192, 1)
    assert cuda.adaptive_rounds and cuda.num_decode_steps == AUTO_DECODE_STEPS
    cpu = SchedulerConfig().size_for("cpu")
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.num_decode_steps) == (64, 2048, 1)
    assert not cpu.adaptive_rounds
    pp2 = SchedulerConfig().size_for("cuda", pipeline_parallel_size=2)
    assert (pp2.num_decode_steps, pp2.adaptive_rounds, pp2.max_inflight) == (1, False, 2)
    mine = SchedulerConfig(max_num_seqs=8, num_decode_steps=4, max_inflight=2).size_for("cuda")
    assert (mine.max_num_seqs, mine.num_decode_steps, mine.max_inflight) == (8, 4, 2)
    assert not mine.adaptive_rounds  # a number the user gave is kept as the bound it names


def test_engine_sized_rounds_fill_the_round_time(ray_cluster, tiny_llama, prompts):
    """With rounds sized by the engine (the CUDA default, forced here on CPU), round
    lengths follow the measured step time, within 1..num_decode_steps, and outputs stay
    those of single steps."""
    from raypp.config import ROUND_TARGET_S
    from raypp.engine.rounds import RoundPolicy

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(tiny_llama), max_num_seqs=8, seed=3, num_decode_steps=1) as single:
        expected = _completions(single.generate(_inputs(prompts[:4]), params, use_tqdm=False))
    with LLM(str(tiny_llama), max_num_seqs=8, seed=3, num_decode_steps=16) as llm:
        engine = llm.engine
        engine.config.scheduler.adaptive_rounds = True  # what size_for sets on CUDA
        engine.scheduler.rounds = rounds_policy = RoundPolicy(engine.config.scheduler)
        rounds: list[int] = []
        submit = engine.executor.submit

        def recording_submit(step):
            rounds.append(step.num_steps)
            return submit(step)

        engine.executor.submit = recording_submit
        assert _completions(llm.generate(_inputs(prompts[:4]), params, use_tqdm=False)) == expected
    step_s = rounds_policy.step_s
    assert step_s is not None and rounds[0] == 1  # rounds start at one step, then are sized
    assert rounds_policy.steps == max(1, min(16, int(ROUND_TARGET_S / step_s)))
    assert max(rounds) <= 16
