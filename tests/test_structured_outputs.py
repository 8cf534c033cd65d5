"""Structured outputs on a real pipeline: the grammar compiled and advanced on the driver,
its bitmask applied on the last stage; with pp 1 and 2, decode rounds beside it,
preemption, prefix caching, a failed step, and compiles that keep the engine stepping.

The tiny Llama has random weights, so a schema keeps every value bounded (enums,
integer ranges, short strings, short arrays): the grammar, not the model, ends it.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch
from hf_reference import corpus_prompts

from raypp import LLM, RequestFailedError, SamplingParams, StructuredOutputsParams
from raypp.engine.async_engine import AsyncLLMEngine
from raypp.engine.micro_batch import ScheduledSeq
from raypp.engine.rounds import RoundPolicy
from raypp.engine.sequence import Sequence
from raypp.engine.structured import GrammarError, StructuredOutputs
from raypp.step import SamplingBatch
from raypp.worker.logits_processors import shape_logits, unpack_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"vip": {"type": "boolean"}},
                  "required": ["vip"]},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
}
JSON = StructuredOutputsParams(json=SCHEMA)


def _params(temperature: float, seed: int = 0, spec: StructuredOutputsParams = JSON,
            max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=spec)


def _valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


# -- the last stage's logits shaping (plain torch) -------------------------------------------
def _packed(allowed: list[list[bool]]) -> list[bytes]:
    """The driver's format: little-endian int32 words, token t at bit t % 32 of word t // 32."""
    out = []
    for row in allowed:
        words = [0] * ((len(row) + 31) // 32)
        for t, ok in enumerate(row):
            if ok:
                words[t // 32] |= 1 << (t % 32)
        out.append(b"".join(w.to_bytes(4, "little") for w in words))
    return out


def _batch(rows: int, **fields) -> SamplingBatch:
    z = [0.0] * rows
    return SamplingBatch(temperature=z, top_p=[1.0] * rows, top_k=[0] * rows, min_p=z,
                         seeds=[0] * rows, output_index=[0] * rows, num_logprobs=[-1] * rows,
                         presence_penalty=z, frequency_penalty=z, repetition_penalty=[1.0] * rows,
                         **fields)


def _check_shaping(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(3, vocab, generator=gen).to(device)
    allowed = (torch.rand(2, vocab, generator=gen) > 0.7).tolist()
    masks = _packed(allowed)
    batch = _batch(3, token_bitmask=[masks[0], None, masks[1]],
                   logit_bias=[None, ([5, 7], [2.5, -1.0]), ([3], [100.0])])
    out = shape_logits(logits, batch).cpu()
    ref = logits.float().cpu().clone()
    ref[1, 5] += 2.5
    ref[1, 7] -= 1.0
    ref[2, 3] += 100.0
    for row, mask in ((0, allowed[0]), (2, allowed[1])):
        ref[row, ~torch.tensor(mask)] = float("-inf")
    assert torch.equal(out, ref)
    assert shape_logits(logits, _batch(3)) is logits  # nothing to apply: untouched
    # a mask shorter than the vocabulary allows nothing past its last bit
    short = unpack_bitmask(torch.frombuffer(bytearray(_packed([[True] * 8])[0]), dtype=torch.uint8)
                           .view(1, -1).to(device), 40)
    assert short[0, :8].all() and not short[0, 8:].any()


def test_logit_bias_and_bitmask_applied_on_cpu():
    _check_shaping("cpu")


@pytest.mark.cuda
def test_logit_bias_and_bitmask_applied_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    _check_shaping("cuda")


# -- the driver's grammar state ---------------------------------------------------------------
def test_compiles_once_per_spec_off_the_calling_thread_and_reports_rejections(tiny_llama):
    from raypp.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_llama))
    structured = StructuredOutputs(tok, len(tok), [tok.eos_token_id])
    try:
        first = structured.submit(JSON)
        same = StructuredOutputsParams(json=json.dumps(SCHEMA))  # same schema, as text
        assert structured.submit(same) is first
        assert first.result(timeout=60) is not None
        for spec, words in [(StructuredOutputsParams(json={"type": "objectx"}), "objectx"),
                            (StructuredOutputsParams(regex="(?<=a)b"), "Lookbehind"),
                            (StructuredOutputsParams(grammar='root ::= "a" |'), "EBNF")]:
            with pytest.raises(GrammarError, match=words):
                structured.compile(spec)
    finally:
        structured.close()


def test_a_constrained_row_never_loops_on_the_device(tiny_llama):
    def item(params: SamplingParams) -> ScheduledSeq:
        return ScheduledSeq(Sequence(0, "r", 0, [1, 2], params, 0), 2, 1, True)

    assert RoundPolicy.loops_on_device(item(SamplingParams()))
    assert not RoundPolicy.loops_on_device(item(_params(0)))
    assert not RoundPolicy.loops_on_device(item(SamplingParams(logit_bias={3: 1.0})))


@pytest.mark.parametrize("bad", [{"json": SCHEMA, "regex": "a"}, {}, {"choice": []},
                                 {"json": "{not json"}])
def test_structured_outputs_params_need_exactly_one_valid_spec(bad):
    with pytest.raises(ValueError, match="StructuredOutputsParams|structured_outputs"):
        StructuredOutputsParams(**bad)


# -- on the pipeline ---------------------------------------------------------------------------
@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (1, 2)])
def test_json_choice_and_regex_outputs_follow_their_grammar(ray_cluster, tiny_llama, pp, tp):
    with LLM(str(tiny_llama), pipeline_parallel_size=pp, tensor_parallel_size=tp,
             kv_cache_memory_bytes=8 * 2**20) as llm:
        prompts = [{"prompt_token_ids": p} for p in corpus_prompts(llm.get_tokenizer(), [5, 9, 3, 12])]
        params = [_params(0), _params(1.0, seed=1), _params(0.8, seed=2),
                  _params(0, spec=StructuredOutputsParams(choice=["yes please", "no", "maybe"]))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out in outs[:3]:
            assert out.outputs[0].finish_reason == "stop"
            _valid(out.outputs[0].text)
        assert outs[3].outputs[0].text in ("yes please", "no", "maybe")
        regex = r"[a-z]{2,6}-\d{3}"
        outs = llm.generate(prompts[:2], [_params(t, seed=4, spec=StructuredOutputsParams(regex=regex))
                                          for t in (0, 1.0)], use_tqdm=False)
        assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs)
        with pytest.raises(ValueError, match="objectx"):  # refused before anything runs
            llm.generate(prompts, _params(0, spec=StructuredOutputsParams(json={"type": "objectx"})),
                         use_tqdm=False)
        assert not llm.engine.requests


def test_constrained_and_unconstrained_rows_share_a_batch_without_effect(ray_cluster, tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(str(tiny_llama), kv_cache_memory_bytes=8 * 2**20, num_decode_steps=4) as llm:
        prompts = [{"prompt_token_ids": p}
                   for p in corpus_prompts(llm.get_tokenizer(), [4, 7, 11, 6, 9, 13])]
        alone = llm.generate(prompts[:3], greedy, use_tqdm=False)
        constrained_alone = llm.generate(prompts[3:], _params(0), use_tqdm=False)
        mixed = llm.generate(prompts, [greedy] * 3 + [_params(0)] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert ([o.outputs[0].token_ids for o in mixed[3:]]
            == [o.outputs[0].token_ids for o in constrained_alone])
    for out in mixed[3:]:
        _valid(out.outputs[0].text)


def test_preemption_and_prefix_caching_keep_the_grammar_with_the_tokens(ray_cluster, tiny_llama):
    with LLM(str(tiny_llama), kv_cache_memory_bytes=8 * 2**20) as roomy:
        tok = roomy.get_tokenizer()
        shared = corpus_prompts(tok, [40])[0]
        prompts = [{"prompt_token_ids": shared + p} for p in corpus_prompts(tok, [3, 5, 2, 7, 4, 6])]
        reference = roomy.generate(prompts, _params(0), use_tqdm=False)
    with LLM(str(tiny_llama), pipeline_parallel_size=2, max_model_len=256, block_size=8,
             num_blocks_override=40, max_num_seqs=6, enable_prefix_caching=True) as tight:
        first = tight.generate(prompts[:1], _params(0), use_tqdm=False)  # caches the prefix
        outs = tight.generate(prompts, _params(0), use_tqdm=False)
        assert first[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
        assert tight.engine.scheduler.num_preemptions > 0
        assert tight.engine.scheduler.prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    for out in outs:
        _valid(out.outputs[0].text)


def test_a_failed_step_fails_only_its_requests_and_the_others_follow_their_grammar(
        ray_cluster, tiny_llama):
    with LLM(str(tiny_llama), kv_cache_memory_bytes=8 * 2**20) as clean:
        prompts = [{"prompt_token_ids": p} for p in corpus_prompts(clean.get_tokenizer(), [5, 8, 3])]
        reference = clean.generate(prompts, _params(0), use_tqdm=False)
    with (LLM(str(tiny_llama), pipeline_parallel_size=2, kv_cache_memory_bytes=8 * 2**20,
              max_num_seqs=2, fault_inject="raise:1:4") as llm,
          pytest.raises(RequestFailedError) as err):
        llm.generate(prompts, _params(0), use_tqdm=False)
    outputs = err.value.outputs
    ok = [i for i, o in enumerate(outputs) if o is not None and not o.error]
    assert ok and len(ok) < len(prompts)
    for i in ok:
        assert outputs[i].outputs[0].token_ids == reference[i].outputs[0].token_ids


def test_a_compiling_grammar_holds_only_its_own_request(ray_cluster, tiny_llama):
    """A request whose grammar is still compiling waits; the engine keeps stepping others."""
    spec = StructuredOutputsParams(regex="[a-f]{3}")
    engine = AsyncLLMEngine.from_model(str(tiny_llama), kv_cache_memory_bytes=8 * 2**20)
    structured = engine.engine.structured
    compiled = structured.compile(spec)
    slow: Future = Future()  # a compile that has not finished yet
    with structured._lock:
        structured._cache[spec.key()] = slow

    async def run() -> tuple[str, str]:
        async def last(params: SamplingParams, request_id: str) -> str:
            outs = [out async for out in engine.generate("The list type", params, request_id)]
            return outs[-1].outputs[0].text

        waiting = asyncio.ensure_future(last(_params(0, spec=spec, max_tokens=10), "constrained"))
        free = await last(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), "free")
        assert not waiting.done()  # the unconstrained one finished while this one waited
        slow.set_result(compiled)
        return free, await waiting

    try:
        free, constrained = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(free) > 0 and re.fullmatch("[a-f]{3}", constrained)


def test_logit_bias_and_its_vocabulary_check(ray_cluster, tiny_llama):
    with LLM(str(tiny_llama), kv_cache_memory_bytes=8 * 2**20) as llm:
        out = llm.generate("The list type", SamplingParams(temperature=0, max_tokens=6,
                                                           ignore_eos=True, logit_bias={42: 100}),
                           use_tqdm=False)
        assert out[0].outputs[0].token_ids == [42] * 6
        with pytest.raises(ValueError, match="logit_bias"):
            llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 150})
