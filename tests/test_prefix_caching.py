"""Automatic prefix caching on real pipelines: outputs equal caching off and
transformers, cached prefixes are reported, eviction under memory pressure.

One engine at a time (module-scoped, parametrized): caching off at pp=1 is the
reference for sampled tokens and logprobs; caching on runs at pp=1 (multi-step,
asynchronous rounds), at pp=2 on the compiled graph and on the direct plane, and at tp=2.
"""

from __future__ import annotations

import pytest
from hf_reference import corpus_prompts, hf_greedy

from raypp import LLM, SamplingParams

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=8)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=7, logprobs=3,
                         ignore_eos=True)
ENGINES = {
    "off-pp1": dict(enable_prefix_caching=False),
    "on-pp1-multistep": dict(num_decode_steps=4),
    "on-pp2-cgraph": dict(pipeline_parallel_size=2),
    "on-pp2-direct": dict(pipeline_parallel_size=2, control_plane="direct"),
    "on-tp2": dict(tensor_parallel_size=2),
}


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    """Prompts sharing a 60-token prefix in several ways, a twin, one unrelated."""
    from transformers import AutoTokenizer

    base, s1, s2, s3, other = corpus_prompts(AutoTokenizer.from_pretrained(str(tiny_llama)),
                                             [60, 5, 11, 3, 21])
    return [base + s1, base + s2, base[:40] + s3, base, base[:56], base + s1, other]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    return hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)


@pytest.fixture(scope="module", params=list(ENGINES))
def engine(request, ray_cluster, tiny_llama):
    with LLM(str(tiny_llama), block_size=BLOCK, max_num_seqs=4, seed=1,
             **ENGINES[request.param]) as llm:
        yield request.param, llm


@pytest.fixture(scope="module")
def sampled_off() -> dict[str, list]:
    return {}  # filled by the caching-off engine, which runs first


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_greedy_outputs_match_transformers_cold_and_warm(engine, prompts, reference):
    name, llm = engine
    assert llm.engine.config.cache.enable_prefix_caching == name.startswith("on")
    assert llm.reset_prefix_cache()
    cold = _run(llm, prompts, GREEDY)
    warm = _run(llm, prompts, GREEDY)
    for outs in (cold, warm):
        assert [o.outputs[0].token_ids for o in outs] == reference
    if name.startswith("off"):
        assert all(o.num_cached_tokens == 0 for o in cold + warm)
        return
    # the second time every full block but the one holding the last token is cached
    assert [o.num_cached_tokens for o in warm] == [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
    assert [o.num_cached_tokens for o in warm] == [64, 64, 40, 56, 48, 64, 16]
    blocks = llm.engine.block_manager
    assert blocks.num_free == blocks.num_blocks and blocks.num_cached > 0


def test_seeded_sampling_and_logprobs_equal_caching_off(engine, prompts, sampled_off):
    name, llm = engine
    runs = [_run(llm, prompts, SAMPLED) for _ in range(2)]  # the second one hits
    if name.startswith("off"):
        sampled_off["outs"] = runs[0]
    reference = sampled_off["outs"]
    for outs in runs:
        for got, ref in zip(outs, reference, strict=True):
            got, ref = got.outputs[0], ref.outputs[0]
            assert got.token_ids == ref.token_ids
            for a, b in zip(got.logprobs, ref.logprobs, strict=True):
                assert list(a) == list(b)
                assert [x.logprob for x in a.values()] == pytest.approx(
                    [x.logprob for x in b.values()], abs=1e-4)


def test_shared_prefix_is_reported_and_a_twin_computes_only_its_last_block(engine, prompts):
    name, llm = engine
    if name.startswith("off"):
        pytest.skip("caching off")
    stats = llm.engine.stats
    base = prompts[3]
    fresh = base + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 70 tokens, its tail never seen
    one = SamplingParams(temperature=0, max_tokens=1)
    before = stats.tokens_processed
    assert _run(llm, [fresh], one)[0].num_cached_tokens == 56  # the 7 full blocks of ``base``
    assert stats.tokens_processed - before == 70 - 56
    before = stats.tokens_processed
    assert _run(llm, [fresh], one)[0].num_cached_tokens == 64
    assert stats.tokens_processed - before == 70 - 64  # only the last block's 6 tokens


def test_eviction_under_memory_pressure_keeps_outputs(ray_cluster, tiny_llama):
    """14 blocks of 8 for 8 sequences of up to 56 + 24 tokens: sequences are preempted,
    cached blocks are evicted and hit again, and every output stays exact."""
    from transformers import AutoTokenizer

    base, *tails = corpus_prompts(AutoTokenizer.from_pretrained(str(tiny_llama)),
                                  [40, 3, 9, 14, 2, 5, 16, 1, 7])
    prompts = [base[:24 + 2 * i] + tail for i, tail in enumerate(tails)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = hf_greedy(tiny_llama, prompts, 24)
    with LLM(str(tiny_llama), block_size=BLOCK, num_blocks_override=14, max_model_len=96,
             max_num_seqs=8) as llm:
        for _ in range(2):
            outs = _run(llm, prompts, params)
            for got, ref in zip(outs, expected, strict=True):
                assert got.outputs[0].token_ids[:len(ref)] == ref  # HF stops at EOS
        scheduler, blocks = llm.engine.scheduler, llm.engine.block_manager
        assert scheduler.num_preemptions > 0
        assert scheduler.prefix_cache_hits > 0
        assert blocks.num_free == blocks.num_blocks == 14
