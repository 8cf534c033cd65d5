"""Qwen3, Mistral and Gemma 3 against transformers on the same tiny checkpoints (built by
transformers' own classes): greedy tokens equal in fp32 and every returned logprob within
tolerance of transformers', at pp 1-3 with uneven splits, tp 2, both control planes,
prompts and outputs past the sliding windows (also prefilled in chunks that cross a
window's edge). Plus how a config names its architecture, and Gemma 3's older config style.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_reference import corpus_prompts, hf_greedy, hf_logits

from raypp import LLM, SamplingParams

PROMPT_LENGTHS = [1, 2, 5, 9, 17, 31, 40]  # the windows are 7 (Mistral) and 11 (Gemma 3)
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3)
LOGPROB_ATOL = 1e-4


@pytest.mark.parametrize(
    ("family", "tp", "pp", "partition", "plane", "chunk"),
    [
        ("tiny_qwen3", 1, 1, None, "cgraph", None),
        ("tiny_qwen3", 1, 3, "1,3,2", "direct", None),
        ("tiny_qwen3", 2, 2, "4,2", "cgraph", None),
        ("tiny_mistral", 1, 1, None, "cgraph", 16),
        ("tiny_mistral", 1, 3, "2,1,3", "cgraph", None),
        ("tiny_mistral", 2, 1, None, "direct", None),
        ("tiny_gemma3", 1, 1, None, "cgraph", None),
        ("tiny_gemma3", 1, 3, "3,1,2", "cgraph", 16),
        ("tiny_gemma3", 2, 2, "1,5", "direct", None),
    ],
)
def test_family_matches_transformers(request, ray_cluster, family, tp, pp, partition, plane,
                                     chunk):
    """``chunk``: max_num_batched_tokens, so the 31- and 40-token prompts are prefilled in
    16-token chunks whose later ones reach back across the window's edge into the cache."""
    model_dir = request.getfixturevalue(family)
    extra = {} if chunk is None else {"max_num_batched_tokens": chunk}
    with LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             layer_partition=partition, control_plane=plane, **extra) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), PROMPT_LENGTHS)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        info = llm.engine.executor.load_info
        steps = llm.engine.stats.steps
    got = [o.outputs[0].token_ids for o in outs]
    assert got == hf_greedy(model_dir, prompts, MAX_NEW)
    worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        ref = hf_logits(model_dir, prompt + completion.token_ids[:-1]).log_softmax(-1)
        for i, top in enumerate(completion.logprobs):
            for token, lp in top.items():
                worst = max(worst, abs(lp.logprob - ref[len(prompt) - 1 + i, token].item()))
    assert worst < LOGPROB_ATOL, worst
    assert len(info) == tp * pp
    layers = sorted({tuple(i["layers"]) for i in info})
    sizes = [int(n) for n in (partition or "6").split(",")]
    assert [b - a for a, b in layers] == sizes  # each stage built only its layers
    for stage in layers:  # and each TP rank read only its slice of them (norms replicated)
        read = [i["bytes_read"] for i in info if tuple(i["layers"]) == stage]
        assert len(read) == tp and max(read) < (0.75 if tp > 1 else 1.01) * sum(read)
    if chunk:
        assert steps > MAX_NEW + 2  # the long prompts took several prefill steps


def test_config_without_architectures_falls_back_to_model_type(tiny_qwen3, tmp_path):
    """As transformers' Auto classes do: ``model_type`` "qwen3" → Qwen3ForCausalLM."""
    from raypp.config import ModelConfig

    model_dir = shutil.copytree(tiny_qwen3, tmp_path / "no-architectures")
    config = json.loads((model_dir / "config.json").read_text())
    del config["architectures"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert ModelConfig(str(model_dir)).architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize("change", [{"architectures": ["GPT2LMHeadModel"]},
                                    {"architectures": None, "model_type": "gpt2"},
                                    {"architectures": [], "model_type": "gemma3"}])
def test_unsupported_architecture_names_the_supported_ones(tiny_llama, tmp_path, change):
    model_dir = shutil.copytree(tiny_llama, tmp_path / "other")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(change)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not supported") as err:
        LLM(str(model_dir))
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "MistralForCausalLM", "Gemma3ForCausalLM"):
        assert name in str(err.value)


def test_gemma3_older_config_style_reads_as_transformers_does():
    """A Gemma 3 config.json written before transformers 5 (``rope_theta``,
    ``rope_local_base_freq``, ``rope_scaling``, ``sliding_window_pattern``, no
    ``layer_types``) gives the layer types and per-type rotary settings transformers'
    own config class derives from it."""
    import transformers

    from raypp.model.gemma3 import gemma3_layer_types, gemma3_rope

    old = {"model_type": "gemma3_text", "num_hidden_layers": 8, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0},
           "sliding_window_pattern": 3, "sliding_window": 512}
    ref = transformers.Gemma3TextConfig(**old)
    assert gemma3_layer_types(old) == list(ref.layer_types)
    for kind in ("sliding_attention", "full_attention"):
        theta, scaling = gemma3_rope(old, kind)
        params = dict(ref.rope_parameters[kind])
        assert theta == params.pop("rope_theta")
        assert (scaling or {"rope_type": "default"}) == params
    new = ref.to_dict()  # what transformers >= 5 writes: read the same
    assert gemma3_layer_types(new) == gemma3_layer_types(old)
    assert [gemma3_rope(new, k) for k in ("sliding_attention", "full_attention")] == \
        [gemma3_rope(old, k) for k in ("sliding_attention", "full_attention")]


def test_sliding_window_attention_on_cpu_matches_a_float64_reference():
    """The torch backend's prefill (a chunk reaching back into the cache) and decode with a
    window, against dense float64 attention masked to the window."""
    from raypp.model.attention import AttentionMetadata, PagedAttention
    from raypp.model.layers import RotaryEmbedding

    torch.manual_seed(0)
    heads, kv_heads, dim, window, block = 4, 2, 8, 5, 4
    attn = PagedAttention(heads, kv_heads, dim, RotaryEmbedding(dim, 64, 10000.0, None), "torch",
                          sliding_window=window)
    total = 23
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim)
    positions = torch.arange(total)
    cache = torch.zeros(2, 8, block, kv_heads, dim)
    table = torch.tensor([[3, 1, 7, 0, 2, 5]])
    outs = []
    for start, end in ((0, 9), (9, 20), (20, 21), (21, 22), (22, 23)):
        meta = AttentionMetadata(
            slot_mapping=table[0][torch.arange(start, end) // block] * block
            + torch.arange(start, end) % block,
            query_start=[0, end - start], seq_lens=[end], block_tables=table,
            decode_only=end - start == 1, seq_lens_tensor=torch.tensor([end]))
        outs.append(attn(qkv[start:end], positions[start:end], cache, meta))
    got = torch.cat(outs).view(total, heads, dim)
    q, k, v = attn.split_heads(qkv.double())
    q, k = attn.rotary(positions, q, k)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
    qp, kp = positions[:, None], positions[None, :]
    scores = scores.masked_fill(~((kp <= qp) & (kp > qp - window)), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
