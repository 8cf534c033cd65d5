"""FP8 checkpoints on CPU against transformers: tiny checkpoints of every family quantized
by each format's rule (:mod:`raypp.testing.fp8_checkpoint`: block FP8 with
``weight_scale_inv``, compressed-tensors per channel, per tensor and per block), and a
16/32-bit checkpoint quantized as it loads (``quantization="fp8"``).

The reference nobody here wrote: transformers loading the same FP8 checkpoint, which
dequantizes it by the format's own rule (block FP8 by its CPU fallback, compressed-tensors
through the package with ``run_compressed=False``), in fp32. raypp dequantizes once at
load on CPU, so greedy tokens must be equal and logprobs within fp32 noise (1e-4), at
pp 1-3 and tp 2 (scales split with their slices), MoE included. Each case also checks
that the quantization mattered (its logits leave the 16/32-bit model's by far more than
the tolerance), so an engine that ignored the scales, or read the original weights,
would fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_reference import corpus_prompts, hf_greedy, hf_logits

from raypp import LLM, SamplingParams
from raypp.testing.fp8_checkpoint import quantize_checkpoint

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3)
PROMPT_LENGTHS = [1, 6, 17, 33]
LOGPROB_ATOL = 1e-4
QUANT_EFFECT = 1e-3  # FP8 rounding moves the tiny models' logprobs by more than this


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """``(family fixture, format, **options) -> FP8 checkpoint``, each written once."""
    made: dict[tuple, Path] = {}

    def make(request, family: str, fmt: str, **options) -> Path:
        key = (family, fmt, tuple(sorted(options.items())))
        if key not in made:
            src = request.getfixturevalue(family)
            made[key] = quantize_checkpoint(src, tmp_path_factory.mktemp(f"{family}-{fmt}"),
                                            fmt, **options)
        return made[key]

    return make


def _generate(llm: LLM, prompts: list[list[int]]):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                               GREEDY, use_tqdm=False)]


def _worst_logprob_error(model_dir, prompts, completions) -> float:
    worst = 0.0
    for prompt, c in zip(prompts, completions, strict=True):
        ref = hf_logits(model_dir, prompt + c.token_ids[:-1]).log_softmax(-1)
        for i, top in enumerate(c.logprobs):
            for token, lp in top.items():
                worst = max(worst, abs(lp.logprob - ref[len(prompt) - 1 + i, token].item()))
    return worst


def _check_against_transformers(fp8_model: Path, original: Path, prompts, completions) -> None:
    assert [c.token_ids for c in completions] == hf_greedy(fp8_model, prompts, MAX_NEW)
    assert _worst_logprob_error(fp8_model, prompts, completions) < LOGPROB_ATOL
    # the FP8 checkpoint is not the original model: its reference moved
    assert _worst_logprob_error(original, prompts, completions) > QUANT_EFFECT


CASES = [  # (family, format, checkpoint options)
    ("tiny_llama", "block", {}),
    ("tiny_llama", "ct-channel", {}),
    ("tiny_llama", "ct-tensor", {}),
    ("tiny_llama", "ct-block", {"block": (32, 16)}),
    ("tiny_qwen2", "ct-channel", {"max_shard_bytes": 60_000}),  # scales in other files
    ("tiny_qwen3", "block", {"block": (8, 8)}),  # head_dim 24: blocks across head edges
    ("tiny_mistral", "ct-tensor", {}),
    ("tiny_gemma3", "block", {}),
    ("tiny_qwen3_moe", "block", {}),  # per-expert scales
    ("tiny_mixtral", "ct-channel", {}),
]


@pytest.mark.parametrize(("family", "fmt", "options"), CASES,
                         ids=[f"{f}-{m}" for f, m, _ in CASES])
def test_fp8_checkpoint_matches_transformers(request, ray_cluster, fp8_dir, family, fmt, options):
    model = fp8_dir(request, family, fmt, **options)
    with LLM(str(model)) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), PROMPT_LENGTHS)
        completions = _generate(llm, prompts)
        info = llm.engine.executor.load_info[0]
    _check_against_transformers(model, request.getfixturevalue(family), prompts, completions)
    assert info["weight_format"].startswith("fp8 e4m3 weights")
    assert info["bytes_read"] < info["weight_bytes"]  # FP8 read, fp32 held


LAYOUTS = [  # (family, format, options, tp, pp, partition)
    ("tiny_llama", "block", {}, 2, 1, None),
    ("tiny_llama", "block", {}, 1, 3, "1,3,2"),
    ("tiny_llama", "ct-channel", {}, 2, 2, None),
    ("tiny_qwen3", "ct-tensor", {}, 2, 1, None),  # per-tensor q/k/v scales in one slice
    ("tiny_qwen3_moe", "block", {}, 2, 2, None),
    ("tiny_mixtral", "ct-channel", {}, 2, 1, None),
    ("tiny_llama", "ct-block", {"block": (16, 16)}, 2, 1, None),
]


@pytest.mark.parametrize(("family", "fmt", "options", "tp", "pp", "partition"), LAYOUTS,
                         ids=[f"{f}-{m}-tp{t}-pp{p}" for f, m, _, t, p, _ in LAYOUTS])
def test_fp8_layouts_match_transformers(request, ray_cluster, fp8_dir, family, fmt, options,
                                        tp, pp, partition):
    """Each stage reads only its layers' weights and scales, each TP rank only its slice
    of them (its share of the bytes), and the tokens and logprobs stay transformers'."""
    model = fp8_dir(request, family, fmt, **options)
    with LLM(str(model), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             layer_partition=partition) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), PROMPT_LENGTHS)
        completions = _generate(llm, prompts)
        info = llm.engine.executor.load_info
        table = llm.engine.executor.pool.stage_summary
    _check_against_transformers(model, request.getfixturevalue(family), prompts, completions)
    total = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    for stage in {tuple(i["layers"]) for i in info}:
        read = [i["bytes_read"] for i in info if tuple(i["layers"]) == stage]
        assert len(read) == tp
        if tp > 1:  # every rank read well under the stage's whole (norms are replicated)
            assert max(read) < 0.75 * sum(read)
    assert sum(i["bytes_read"] for i in info) < (1.2 if tp > 1 else 1.01) * total
    assert [row["checkpoint_bytes"] for row in table] == [
        max(i["bytes_read"] for i in info if tuple(i["layers"]) == row["layers"])
        for row in table]


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])
def test_online_fp8_matches_transformers_on_the_per_channel_rule(
        request, ray_cluster, fp8_dir, tiny_llama, tp, pp):
    """``quantization="fp8"`` of a 16/32-bit checkpoint equals that checkpoint quantized
    per channel (one scale per output row, over the whole row, at any TP size) and read by
    transformers through compressed-tensors."""
    reference = fp8_dir(request, "tiny_llama", "ct-channel")
    with LLM(str(tiny_llama), quantization="fp8", tensor_parallel_size=tp,
             pipeline_parallel_size=pp) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), PROMPT_LENGTHS)
        completions = _generate(llm, prompts)
        fmt = llm.engine.executor.load_info[0]["weight_format"]
    assert "quantized at load" in fmt
    _check_against_transformers(reference, tiny_llama, prompts, completions)
