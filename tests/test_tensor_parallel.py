"""Tensor parallelism inside each stage (TP × PP) on real gloo groups."""

from __future__ import annotations

import pytest
import ray
from hf_reference import corpus_prompts, hf_greedy

from raypp import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=77, ignore_eos=True)


def _run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tp1_runs(ray_cluster, tiny_llama, tiny_qwen2):
    """raypp's own tp=1 outputs (greedy and seeded) for each model."""
    runs = {}
    for name, model in (("llama", tiny_llama), ("qwen2", tiny_qwen2)):
        with LLM(str(model)) as llm:
            prompts = corpus_prompts(llm.get_tokenizer(), [1, 4, 9, 16, 27])
            runs[name] = (prompts, _run(llm, prompts, GREEDY), _run(llm, prompts, SEEDED),
                          sum(i["bytes_read"] for i in llm.engine.executor.load_info))
    return runs


@pytest.mark.parametrize(("model", "tp", "pp"), [
    ("llama", 2, 1), ("llama", 2, 2), ("qwen2", 2, 1), ("qwen2", 2, 2), ("llama", 4, 1),
])
def test_tp_matches_transformers_and_tp1(request, tp1_runs, model, tp, pp):
    model_dir = request.getfixturevalue(f"tiny_{model}")
    prompts, greedy_tp1, seeded_tp1, full_bytes = tp1_runs[model]
    with LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        greedy = _run(llm, prompts, GREEDY)
        seeded = _run(llm, prompts, SEEDED)
        info = llm.engine.executor.load_info
    assert greedy == hf_greedy(model_dir, prompts, GREEDY.max_tokens) == greedy_tp1
    assert seeded == seeded_tp1
    # each worker read only its slice of its stage's weights
    assert len(info) == tp * pp
    per_worker = [i["bytes_read"] for i in info]
    assert max(per_worker) < 0.75 * full_bytes / pp
    assert sum(per_worker) >= full_bytes  # together they read everything (norms replicated)


def test_shapes_are_sharded(ray_cluster, tiny_llama):
    with LLM(str(tiny_llama), tensor_parallel_size=4) as llm:
        shapes = [i["param_shapes"] for i in llm.engine.executor.load_info]
    # 4 q heads / 4 ranks, 2 kv heads replicated to 1 per rank, head_dim 16
    assert {tuple(s["model.layers.0.self_attn.qkv_proj.weight"]) for s in shapes} == {(48, 64)}
    assert {tuple(s["model.layers.0.mlp.down_proj.weight"]) for s in shapes} == {(64, 32)}
    assert {tuple(s["model.embed_tokens.weight"]) for s in shapes} == {(96, 64)}


def test_each_lane_carries_its_pp_tensors(ray_cluster, tiny_llama):
    with LLM(str(tiny_llama), tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), [3, 6])
        _run(llm, prompts, GREEDY)
        executor = llm.engine.executor
        stats = executor.comm_stats()
        steps = llm.engine.stats.steps
        tokens = llm.engine.stats.tokens_processed
        comms = executor.graph_communicators()
        per_actor = ray.get([w.channel_communicators.remote() for w in executor.all_workers])
    hidden = 64
    senders = [s for s in stats if s["pp_rank"] == 0]
    receivers = [s for s in stats if s["pp_rank"] == 1]
    assert sorted(s["tp_rank"] for s in senders) == [0, 1]
    for s in senders:
        assert s["sends"] == steps and s["bytes_sent"] == 2 * tokens * hidden * 4
    for r in receivers:
        assert r["recvs"] == steps and r["bytes_received"] == 2 * tokens * hidden * 4
    assert comms["custom"] == ["RayPPCommunicator", "RayPPCommunicator"]  # one per lane
    assert comms["ray_created"] == []
    assert all(c == ["RayPPCommunicator"] for c in per_actor)


def test_indivisible_heads_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible"):
        LLM(str(tiny_llama), tensor_parallel_size=3)
