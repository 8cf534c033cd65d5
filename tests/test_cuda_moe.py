"""The CUDA path of the mixture-of-experts families (Qwen3-MoE, Mixtral): the block's
grouped GEMM captured in a CUDA graph against its eager forward, and the engine on a GPU
against transformers (fp32 greedy equal, the stage running eagerly as fp32 experts loop
on the host; bf16 with decode graphs, logprobs as close to transformers fp32 as
transformers' own bf16).

Skipped cleanly without a GPU (CI), like tests/test_cuda_families.py. Written without a GPU
to run them on: not yet run on one.
"""

from __future__ import annotations

import pytest
import torch
from cuda_reference import DEVICE, assert_logprobs_within_transformers_error, hf_greedy_cuda

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

FAMILIES = ["tiny_qwen3_moe", "tiny_qwen3_moe_dense_first", "tiny_mixtral"]
PROMPTS = [[5, 17, 33, 2, 90], list(range(3, 60)), [11] * 20]


def test_grouped_block_in_a_cuda_graph_matches_eager():
    """bf16 experts on the grouped GEMM: a captured graph replayed on new tokens (other
    experts chosen) gives the eager forward's output."""
    from raypp.model.layers import TPContext
    from raypp.model.moe import MoESpec, SparseMoeBlock

    torch.manual_seed(0)
    with torch.device(DEVICE):
        block = SparseMoeBlock(64, MoESpec(16, 4, 32, False, False), TPContext(), torch.bfloat16)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    assert block.graph_capturable()
    x = torch.randn(8, 64, device=DEVICE, dtype=torch.bfloat16)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            block(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(x)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.testing.assert_close(out, block(x), rtol=2e-2, atol=2e-2)


def _replays(ray_cluster, llm) -> int:
    worker = llm.engine.executor.workers[0][0]
    return ray_cluster.get(worker.__ray_call__.remote(
        lambda w: -1 if w.decode_graphs is None else w.decode_graphs.replays))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pp", [1, 2])
def test_moe_fp32_on_cuda_matches_transformers(request, ray_cluster, family, pp):
    """fp32 greedy equals transformers'; fp32 experts need the per-expert loop, so the
    stages run eagerly (no decode graphs) instead of failing to capture. pp=2 runs both
    stages on one GPU (``workers_per_gpu``) when the machine has one."""
    from raypp import LLM, SamplingParams

    model_dir = str(request.getfixturevalue(family))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.3,
             pipeline_parallel_size=pp, max_num_seqs=4,
             workers_per_gpu=pp if torch.cuda.device_count() < pp else 1) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        replays = _replays(ray_cluster, llm)
    want = hf_greedy_cuda(model_dir, PROMPTS, 24, torch.float32)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert replays == -1


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_bf16_matches_transformers(request, ray_cluster, family):
    """bf16 end to end with decode graphs (the grouped GEMM captured), teacher-forced on
    raypp's tokens: top-5 logprobs' relative error to transformers fp32 at most 1.5x
    transformers bf16's own, plus 1e-3; every greedy token transformers' bf16 choice or
    within 0.15 nats of it."""
    from raypp import LLM, SamplingParams
    from raypp.model.moe import grouped_mm_supported

    model_dir = str(request.getfixturevalue(family))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    with LLM(model_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
             max_num_seqs=4) as llm:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                   params, use_tqdm=False)]
        replays = _replays(ray_cluster, llm)
    grouped = grouped_mm_supported(torch.device(DEVICE), torch.bfloat16, (64, 32))
    assert (replays > 0) if grouped else replays == -1

    assert_logprobs_within_transformers_error(model_dir, PROMPTS, outs, torch.bfloat16, 0.15,
                                              f"{family} bf16")
