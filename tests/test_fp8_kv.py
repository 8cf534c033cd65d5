"""``kv_cache_dtype="fp8"`` on CPU: keys and values stored in e4m3 with per-layer scales,
read back upcast.

Tolerance basis: the reference is transformers in fp32 whose KV cache rounds every key
and value it stores through e4m3 with the same per-layer scales (``k / k_scale``
rounded, times ``k_scale``): the same function raypp computes, so greedy tokens must be
equal. Logprobs: the two compute keys in fp32 in different orders (rotary tables,
GEMMs), and a key within that noise of an e4m3 rounding boundary rounds to the
neighbouring value in one and not the other (one element moves by a 1/16 step), which
then moves a logprob by up to ~1e-2. Such flips are rare, so the bound is: the median
position within fp32 noise (1e-4), and the worst under a tenth of the mean effect the
rounding itself has (raypp against the unrounded reference, ~0.2 here); an engine
storing 16/32-bit keys fails both.
The engine's KV capacity grows by the model dtype's bytes per element (fp32 here: 4x).
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import _hf_model, corpus_prompts, e4m3_kv_cache, hf_logits

from raypp import LLM, SamplingParams
from raypp.testing.fp8_checkpoint import quantize_checkpoint

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=2)
KV_BUDGET = 4 * 2**20


def _reference(model_dir, prompt: list[int], scales) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens with an e4m3 KV cache, and its log-probabilities at
    every position of ``prompt + tokens`` (one forward, the keys through the same cache)."""
    model = _hf_model(str(model_dir))
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                             do_sample=False, pad_token_id=model.config.pad_token_id,
                             past_key_values=e4m3_kv_cache(model, scales))
        tokens = out[0, len(prompt):].tolist()
        ids = torch.tensor([prompt + tokens[:-1]])
        logits = model(ids, past_key_values=e4m3_kv_cache(model, scales), use_cache=True).logits
    return tokens, logits[0].float().log_softmax(-1)


@pytest.mark.parametrize(("family", "scales", "tp", "pp"), [
    ("tiny_llama", None, 1, 1),
    ("tiny_llama", {0: (0.5, 0.25), 3: (2.0, 0.125), 5: (0.05, 0.5)}, 1, 2),
    ("tiny_mistral", None, 2, 1),  # a sliding window over the FP8 cache
])
def test_fp8_kv_matches_transformers_with_an_e4m3_cache(request, ray_cluster, tmp_path, family,
                                                        scales, tp, pp):
    model_dir = request.getfixturevalue(family)
    if scales is not None:  # the checkpoint's per-layer scales (compressed-tensors kv scheme)
        model_dir = quantize_checkpoint(model_dir, tmp_path / "q", "ct-channel", kv_scales=scales)
    with LLM(str(model_dir), kv_cache_dtype="fp8", tensor_parallel_size=tp,
             pipeline_parallel_size=pp, kv_cache_memory_bytes=KV_BUDGET) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), [2, 9, 30])
        outs = [o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    errors, effects = [], []
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, ref = _reference(model_dir, prompt, scales or {})
        assert out.token_ids == tokens
        plain = hf_logits(model_dir, prompt + tokens[:-1]).log_softmax(-1)
        for i, top in enumerate(out.logprobs):
            for token, lp in top.items():
                row = len(prompt) - 1 + i
                errors.append(abs(lp.logprob - ref[row, token].item()))
                effects.append(abs(lp.logprob - plain[row, token].item()))
    errors_t, effect = torch.tensor(errors), torch.tensor(effects).mean().item()
    assert errors_t.median() < 1e-4, errors
    assert errors_t.max() < 0.1 * effect, (errors_t.max(), effect)
    assert effect > 1e-2, effect


def test_fp8_kv_holds_itemsize_times_the_blocks(ray_cluster, tiny_llama):
    blocks = {}
    for kv in ("auto", "fp8"):
        with LLM(str(tiny_llama), kv_cache_dtype=kv, kv_cache_memory_bytes=KV_BUDGET) as llm:
            blocks[kv] = llm.engine.executor.num_kv_blocks
    # tiny_llama: fp32, 6 layers × 2 × 16 tokens × 2 kv heads × 16 dims per block
    per_block = 6 * 2 * 16 * 2 * 16
    assert blocks == {"auto": KV_BUDGET // (4 * per_block), "fp8": KV_BUDGET // per_block}


@pytest.mark.slow
def test_fp8_kv_agrees_with_16_bit_kv_on_smollm2(ray_cluster):
    """A real-weights model (SmolLM2-135M, the demo model; bf16): 256 greedy steps with the
    16-bit cache give each prompt's text; at every 8th of those positions, each cache's
    greedy choice given the same prefix (teacher-forced: both caches write fluent text
    that parts after a few dozen tokens at some near-tie, and a prefill rounds unlike a
    decode step, so only the same prefix through the same path isolates the cache) — the
    FP8 cache picks the 16-bit cache's token at >= 95 % of positions (the issue's bar),
    and holds twice the blocks."""
    from raypp.config import cache_dir
    from raypp.demo import demo_model_path

    try:
        model = str(demo_model_path(cache_dir(), fetch=False))
    except FileNotFoundError:
        pytest.skip("the demo model is not fetched (make setup fetches it)")
    texts = ["The history of the printing press", "def fibonacci(n):",
             "Photosynthesis is the process by which"]
    options = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=64 * 2**20)
    picks, blocks = {}, {}
    for kv in ("auto", "fp8"):
        with LLM(model, kv_cache_dtype=kv, **options) as llm:
            if kv == "auto":
                prompts = [llm.get_tokenizer().encode(t) for t in texts]
                text = [o.outputs[0].token_ids for o in llm.generate(
                    [{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=256, ignore_eos=True),
                    use_tqdm=False)]
                prefixes = [p + r[:t] for p, r in zip(prompts, text, strict=True)
                            for t in range(0, 256, 8)]
            picks[kv] = [o.outputs[0].token_ids[0] for o in llm.generate(
                [{"prompt_token_ids": ids} for ids in prefixes],
                SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)]
            blocks[kv] = llm.engine.executor.num_kv_blocks
    same = sum(a == b for a, b in zip(picks["auto"], picks["fp8"], strict=True))
    print(f"fp8 KV chose the 16-bit KV's token at {same}/{len(prefixes)} positions")
    assert same >= 0.95 * len(prefixes)
    assert abs(blocks["fp8"] - 2 * blocks["auto"]) <= 1
