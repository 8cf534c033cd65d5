"""Speculative decoding with a draft model on the GPU: the first stage's draft model
(its own decode CUDA graphs for one-token forwards, eager otherwise; or all eager with
``enforce_eager``) proposes, the target (decode CUDA graphs for plain decode steps, the
eager forward for verification steps) verifies; greedy outputs equal
transformers' fp32 greedy tokens and the engine's own without speculation, at pp 1 and
2 (stages sharing the GPU), both planes. Skipped cleanly without a GPU (CI)."""

from __future__ import annotations

import pytest
import torch
from cuda_reference import hf_greedy_cuda

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

PROMPTS = [[5, 17, 33, 2, 90], list(range(3, 60)), [11] * 20]
MAX_NEW = 20


def _llm(model_dir, pp: int, **kwargs):
    from raypp import LLM

    return LLM(str(model_dir), device="cuda", dtype="float32", pipeline_parallel_size=pp,
               workers_per_gpu=pp, gpu_memory_utilization=0.5, max_num_seqs=4,
               max_model_len=256, **kwargs)


def _greedy(llm) -> tuple[list[list[int]], list[dict]]:
    from raypp import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.metrics for o in outs]


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_llama):
    """Transformers' fp32 greedy tokens, which raypp without speculation also gives."""
    want = hf_greedy_cuda(tiny_llama, PROMPTS, MAX_NEW, torch.float32)
    with _llm(tiny_llama, 1) as llm:
        assert _greedy(llm)[0] == want
    return want


@pytest.mark.parametrize("pp, plane, k, draft, eager", [
    (1, "cgraph", 3, "self", False),
    (2, "cgraph", 3, "half", False),
    (2, "direct", 5, "self", False),
    (1, "cgraph", 4, "half", True),
], ids=lambda v: str(v))
def test_greedy_with_a_draft_model_on_cuda_equals_transformers(reference, tiny_llama,
                                                               tiny_llama_half, pp, plane, k,
                                                               draft, eager):
    import ray

    path = str(tiny_llama if draft == "self" else tiny_llama_half)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": k}
    with _llm(tiny_llama, pp, control_plane=plane, speculative_config=spec,
              enforce_eager=eager) as llm:
        tokens, metrics = _greedy(llm)
        stats = llm.engine.stats
        target_graphs, draft_replays = ray.get(
            llm.engine.executor.all_workers[0].__ray_call__.remote(
                lambda w: (w.decode_graphs is not None,
                           w.runner.draft.graphs and w.runner.draft.graphs.replays)))
    assert tokens == reference
    # the target's and the draft's decode graphs are captured unless eager; the draft's
    # replay for its one-token forwards
    assert target_graphs is not eager
    assert (draft_replays > 0) if not eager else draft_replays is None
    assert stats.spec_drafted_tokens > 0
    if draft == "self":  # the target drafting for itself: (nearly) all accepted
        assert all(m["spec_acceptance_rate"] > 0.9 for m in metrics), metrics
    else:
        assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens
