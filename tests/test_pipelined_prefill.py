"""Long prompts in chunks, with chunks of one prompt in flight on several stages at once
(chunked pipeline prefill): greedy outputs equal transformers' on the same checkpoint at
every layout, both control planes, pipelined prefill on and off, with a cached prefix,
with requests arriving mid-prefill, and when a stage fails with chunks in flight.

Real Ray, real stages, a real (tiny, random) Llama checkpoint with 2,048 positions; the
step's token budget is small (96) so a 700-token prompt takes many chunks.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hf_reference import hf_greedy

from raypp import LLM, RequestFailedError, SamplingParams
from raypp.testing import kill_stage_later

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BUDGET = 96  # tokens per step: a 700-token prompt is 8 chunks (15 pipelined at pp=2)
LAYOUTS = [  # (pp, plane, pipelined prefill)
    (1, "cgraph", True), (2, "cgraph", True), (2, "cgraph", False), (2, "direct", True),
    (3, "direct", True), (3, "cgraph", False),
]


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("long_llama"), architecture="llama", seed=3,
                           max_position_embeddings=2048)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in lengths]


def _llm(model_dir: Path, pp: int, plane: str = "cgraph", pipelined: bool = True,
         **kwargs) -> LLM:
    return LLM(str(model_dir), pipeline_parallel_size=pp, control_plane=plane,
               pipelined_prefill=pipelined, max_num_batched_tokens=BUDGET, max_model_len=1024,
               kv_cache_memory_bytes=16 * 2**20, **kwargs)


def _hf(model_dir: Path, prompts: list[list[int]], n: int = 6) -> list[list[int]]:
    """transformers' greedy continuations, exactly ``n`` tokens: EOS does not stop them
    (no token id is -1), as ``ignore_eos`` here."""
    return hf_greedy(model_dir, prompts, n, eos_token_id=-1)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                use_tqdm=False))


@pytest.mark.parametrize("pp,plane,pipelined", LAYOUTS,
                         ids=[f"pp{pp}-{plane}-{'on' if on else 'off'}" for pp, plane, on in LAYOUTS])
def test_long_prompts_match_transformers(ray_cluster, long_llama, pp, plane, pipelined):
    """Prompts of several chunks, one under a chunk, and one of 3 tokens, batched: greedy
    equal to transformers; chunks of one prompt overlapped only where pipelined."""
    prompts = _prompts([700, 250, 40, 3])
    with _llm(long_llama, pp, plane, pipelined) as llm:
        got = _generate(llm, prompts)
        overlapped = llm.engine.scheduler.num_overlapped_chunks
        if pp > 1 and pipelined:
            # a prefix shared with the first prompt: its cached blocks are skipped, the
            # rest chunked (and pipelined) after them
            twin = prompts[0][:520] + _prompts([180], seed=1)[0]
            [out] = llm.generate([{"prompt_token_ids": twin}], GREEDY, use_tqdm=False)
            assert out.num_cached_tokens >= 512
            assert out.outputs[0].token_ids == _hf(long_llama, [twin])[0]
            assert llm.engine.scheduler.num_overlapped_chunks > overlapped
    assert got == _hf(long_llama, prompts)
    assert (overlapped > 0) == (pp > 1 and pipelined)


def test_requests_arriving_mid_prefill_keep_decoding_and_match(ray_cluster, long_llama):
    """pp=2: a short request decodes; a long prompt arrives and prefills over many steps,
    during which the short one keeps getting tokens (decode rows ride along), and another
    short request arrives and is served; all three equal transformers."""
    short_a, long_, short_b = _prompts([5, 900, 7], seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with _llm(long_llama, 2, "direct") as llm:
        engine = llm.engine
        engine.add_request("a", {"prompt_token_ids": short_a}, params)
        outputs: dict[str, list[int]] = {}

        def step() -> None:
            for out in engine.step():
                outputs[out.request_id] = list(out.outputs[0].token_ids)

        while len(outputs.get("a", [])) < 3:
            step()
        engine.add_request("long", {"prompt_token_ids": long_}, params)
        for _ in range(3):
            step()
        engine.add_request("b", {"prompt_token_ids": short_b}, params)
        a_before_long = None
        while engine.has_unfinished_requests():
            step()
            if a_before_long is None and outputs.get("long"):
                a_before_long = len(outputs["a"])
    assert a_before_long is not None and a_before_long > 3 + 4  # a decoded during the prefill
    want = _hf(long_llama, [short_a, long_, short_b], 40)
    assert [outputs["a"], outputs["long"], outputs["b"]] == want


def test_failed_chunk_fails_its_request_and_the_engine_goes_on(ray_cluster, long_llama):
    """pp=2: stage 1 raises on a step that carries a chunk while the prompt's next chunk
    is already in flight: that request fails with the stage's error, the chunk behind it
    is dropped, and the next requests are correct."""
    with _llm(long_llama, 2, fault_inject="raise:1:3") as llm:
        long_ = _prompts([700], seed=4)[0]
        with pytest.raises(RequestFailedError, match="stage 1"):
            llm.generate([{"prompt_token_ids": long_}], GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_overlapped_chunks > 0
        prompts = _prompts([300, 9], seed=5)
        assert _generate(llm, prompts) == _hf(long_llama, prompts)


@pytest.mark.parametrize("plane", ["cgraph", "direct"])
def test_stage_killed_with_chunks_in_flight(ray_cluster, long_llama, plane):
    """pp=2: stage 0 stalls on the prompt's second chunk (so chunks are in flight) and
    stage 1 is killed meanwhile: the request is re-queued (zero-loss recovery) and
    completes with the right output, and the replaced stages serve the next prompt
    correctly."""
    long_ = _prompts([700], seed=6)[0]
    with _llm(long_llama, 2, plane, fault_inject="sleep:0:2:4", max_restarts=5) as llm:
        killer = kill_stage_later(llm, 1, 1.5)
        assert _generate(llm, [long_]) == _hf(long_llama, [long_])  # re-queued, exact
        killer.join()
        prompts = _prompts([400, 4], seed=7)
        assert _generate(llm, prompts) == _hf(long_llama, prompts)
        assert llm.engine.restarts == 1
