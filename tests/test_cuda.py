"""The CUDA path end to end: decode CUDA graphs (one stage, and a pipeline of stages
handing off on one GPU), and the engine on a GPU against transformers. The kernels
alone are tests/test_cuda_kernels.py.

Skipped cleanly without a GPU (CI); the GPU benchmark call runs it.
"""

from __future__ import annotations

import pytest
import torch
from cuda_reference import (
    BLOCK_SIZE,
    assert_graph_replays_match_eager,
    assert_logprobs_within_transformers_error,
    hf_greedy_cuda,
    rel,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.mark.parametrize("compile_forward,fused_max_rows", [(True, 64), (True, 1), (False, 0)])
def test_decode_graphs_match_eager(tiny_llama, compile_forward, fused_max_rows):
    """Graph replays (with padding rows) give the eager unfused forward's logits, whether
    a size holds the fused kernel chain, the compiled forward or the eager one."""
    from raypp.config import ModelConfig
    from raypp.model.base import StageSpec
    from raypp.model.layers import TPContext
    from raypp.model.llama import LlamaStageModel
    from raypp.model.loader import load_stage_weights
    from raypp.worker.cuda_graphs import DecodeGraphs, capture_sizes

    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    mc = ModelConfig(str(tiny_llama), dtype="float32")
    stage = StageSpec(0, mc.num_layers, True, True)
    with torch.device("cuda"):
        model = LlamaStageModel(mc.hf_config, stage, TPContext(), torch.float32, "triton")
    load_stage_weights(model, mc.model)
    model.eval()
    caches = [torch.randn(2, 64, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim, device="cuda")
              for _ in range(mc.num_layers)]
    graphs = DecodeGraphs(model, caches, is_first=True, is_last=True, max_num_seqs=8,
                          max_blocks_per_seq=8,
                          hidden_size=mc.hidden_size, dtype=torch.float32,
                          device=torch.device("cuda"), compile_forward=compile_forward,
                          fused_max_rows=fused_max_rows).capture()
    assert graphs.compile_error is None
    fused = [g for g in [8, 4, 2, 1] if g <= fused_max_rows]  # model.fused_decode's chain
    assert graphs.fused_sizes == fused
    assert graphs.compiled_sizes == ([g for g in [8, 4, 2] if g not in fused]
                                     if compile_forward else [])
    assert_graph_replays_match_eager(model, graphs, caches)
    assert graphs.replays == 3


def _stage_runner(model_dir, start: int, end: int, num_layers: int, max_num_seqs: int = 8):
    """A stage of layers ``[start, end)`` on the GPU, its KV cache and captured decode
    graphs behind a :class:`ModelRunner`, as a worker builds it (no Ray)."""
    from raypp.config import ModelConfig
    from raypp.model.base import StageSpec
    from raypp.model.layers import TPContext
    from raypp.model.llama import LlamaStageModel
    from raypp.model.loader import load_stage_weights
    from raypp.worker.cuda_graphs import DecodeGraphs
    from raypp.worker.model_runner import ModelRunner

    mc = ModelConfig(str(model_dir), dtype="float32")
    stage = StageSpec(start, end, start == 0, end == num_layers)
    with torch.device("cuda"):
        model = LlamaStageModel(mc.hf_config, stage, TPContext(), torch.float32, "triton")
    load_stage_weights(model, mc.model)
    model.eval()
    torch.manual_seed(0)
    caches = [torch.randn(2, 64, 16, mc.num_kv_heads, mc.head_dim, device="cuda")
              for _ in range(end - start)]
    graphs = DecodeGraphs(model, caches, is_first=stage.is_first, is_last=stage.is_last,
                          max_num_seqs=max_num_seqs, max_blocks_per_seq=8,
                          hidden_size=mc.hidden_size, dtype=torch.float32,
                          device=torch.device("cuda")).capture()
    return ModelRunner(model, caches, graphs, torch.device("cuda"), 16)


def test_non_first_stage_replays_its_graph_on_a_real_handoff(tiny_llama):
    """Two stages on one GPU: the first stage's graph replay makes the typed hand-off,
    the second stage's decode graph loads it (hidden states and residual) and replays;
    the sampled tokens and logits equal one stage holding every layer. Each stage's
    caches start as the same random context."""
    from raypp.config import ModelConfig
    from raypp.step import ResolvedStep, SamplingBatch, StageHandoff, StepInput, StepOutput

    layers = ModelConfig(str(tiny_llama)).num_layers
    whole = _stage_runner(tiny_llama, 0, layers, layers)
    first, last = _stage_runner(tiny_llama, 0, 2, layers), _stage_runner(tiny_llama, 2, layers, layers)
    for mine, theirs in zip(first.kv_caches + last.kv_caches, whole.kv_caches, strict=True):
        mine.copy_(theirs)  # the split stages see the same cached context
    n, block_size = 3, 16
    context = [5, 40, 17]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(n)]
    greedy = SamplingBatch([0.0] * n, [1.0] * n, [0] * n, [0.0] * n, [0] * n, [0] * n, [-1] * n,
                           [0.0] * n, [0.0] * n, [1.0] * n, [[]] * n, [[]] * n)
    step = StepInput(
        step_id=7, input_ids=[7, 8, 9], query_start=list(range(n + 1)), seq_lens=context,
        seq_ids=list(range(n)), block_table_updates=[(i, 0, t) for i, t in enumerate(tables)],
        sample_rows=list(range(n)), sampling=greedy)
    resolved = ResolvedStep.of(step, tables, block_size)  # what the runners hand their graphs
    assert resolved.slot_mapping == [t[(c - 1) // block_size] * block_size + (c - 1) % block_size
                                     for t, c in zip(tables, context, strict=True)]
    with torch.inference_mode():
        handoff = first.execute(step, None)
        assert isinstance(handoff, StageHandoff) and handoff.step is step
        assert handoff.packed.shape == (2, n, whole.model.cfg["hidden_size"])
        replays = last.graphs.replays
        got = last.execute(step, handoff)
        assert last.graphs.replays == replays + 1  # the non-first stage replayed its graph
        want = whole.execute(step, None)
        assert isinstance(got, StepOutput) and got.token_ids == want.token_ids
        logits = last.graphs.run(resolved, handoff).clone()
        assert rel(logits, whole.graphs.run(resolved, None)) < 1e-4
    with pytest.raises(ValueError, match="needs the previous stage's hand-off"):
        last.graphs.load(resolved, None)


@pytest.mark.parametrize("eager,decode_steps,max_num_seqs",
                         [(False, 1, 4), (True, 1, 4), (False, 8, 4), (True, 5, 4), (False, 1, 1),
                          (False, 8, 1)])
def test_llm_on_cuda_matches_transformers(ray_cluster, tiny_llama, eager, decode_steps,
                                          max_num_seqs):
    """Greedy fp32 generation on the GPU equals transformers', with and without graphs,
    one decode step per round trip or several; the graphs hold the fused kernel chain."""
    from raypp import LLM, SamplingParams
    from raypp.worker.cuda_graphs import capture_sizes

    prompts = [[5, 17, 33, 2, 90], list(range(3, 60)), [11] * 20]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(tiny_llama), device="cuda", dtype="float32", gpu_memory_utilization=0.3,
              max_num_seqs=max_num_seqs, num_decode_steps=decode_steps, enforce_eager=eager)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        worker = llm.engine.executor.workers[0][0]
        replays, fused = ray_cluster.get(worker.__ray_call__.remote(
            lambda w: (-1, None) if w.decode_graphs is None else
            (w.decode_graphs.replays, sorted(w.decode_graphs.fused_sizes))))
    finally:
        llm.shutdown()
    got = [o.outputs[0].token_ids for o in outs]
    assert got == hf_greedy_cuda(tiny_llama, prompts, 24, torch.float32)
    assert (replays == -1) if eager else (replays > 0 and fused == capture_sizes(max_num_seqs))


@pytest.mark.parametrize("max_num_seqs", [4, 1])  # 1: the GEMV chain, 4: GEMMs
@pytest.mark.parametrize("dtype,tie", [("bfloat16", 0.15), ("float16", 0.05)])
def test_half_precision_matches_transformers(ray_cluster, tiny_llama, dtype, tie, max_num_seqs):
    """bf16/fp16 weights end to end (graphs, 4 decode steps per call), teacher-forced on
    raypp's tokens: raypp's top-5 logprobs are as close to transformers' fp32 as
    transformers' own half-precision logprobs are (relative error at most 1.5x theirs,
    plus 1e-3), and every greedy token is transformers' choice in the same dtype or
    within ``tie`` nats of it (bf16 keeps 8 significant bits: logits near 8 round to 1/32)."""
    from raypp import LLM, SamplingParams

    prompts = [[5, 17, 33, 2, 90], list(range(3, 60)), [11] * 20]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    with LLM(str(tiny_llama), device="cuda", dtype=dtype, gpu_memory_utilization=0.3,
             max_num_seqs=max_num_seqs, num_decode_steps=4) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    assert_logprobs_within_transformers_error(tiny_llama, prompts, outs, getattr(torch, dtype),
                                              tie, dtype)


def test_multi_step_sampling_on_cuda_equals_single_steps(ray_cluster, tiny_llama):
    """Seeded sampling and logprobs through graph replays: rounds of 1 and 8 steps with
    rounds submitted ahead (fed on the GPU from the previous round's last tokens, also
    after a sequence left the batch mid-chain), and of 8 without, == single synchronous
    steps."""
    from raypp import LLM, SamplingParams

    prompts = [[5, 17, 33, 2, 90], list(range(3, 60)), [11] * 20]
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i, max_tokens=m,
                             logprobs=2, ignore_eos=True) for i, m in enumerate((30, 9, 20))]
    outs, ahead = {}, {}
    for steps, async_scheduling in ((1, False), (1, True), (8, True), (8, False)):
        with LLM(str(tiny_llama), device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                 max_num_seqs=4, num_decode_steps=steps,
                 async_scheduling=async_scheduling) as llm:
            key = (steps, async_scheduling)
            outs[key] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            ahead[key] = llm.engine.stats.rounds_ahead
    assert ahead[1, False] == ahead[8, False] == 0 and ahead[1, True] >= 2 and ahead[8, True] >= 2
    for key in ((1, True), (8, True), (8, False)):
        for a, b in zip(outs[key], outs[1, False], strict=True):
            assert a.token_ids == b.token_ids
            for la, lb in zip(a.logprobs, b.logprobs, strict=True):
                assert la.keys() == lb.keys()
                assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)




def test_speculative_decoding_on_cuda_equals_transformers(ray_cluster, tiny_llama):
    """n-gram drafts verified on the GPU (eager VERIFY steps between graph-replayed plain
    decode steps): fp32 greedy equals transformers', and seeded sampling equals the same
    engine without speculation."""
    from raypp import LLM, SamplingParams

    prompts = [[3] * 8, [100] * 12, [11] * 20, [5, 17, 33, 2, 90]]  # loops the n-grams predict
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)
               for i in range(4)]
    outs = {}
    for spec in (None, {"num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        with LLM(str(tiny_llama), device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                 max_num_seqs=4, speculative_config=spec) as llm:
            inputs = [{"prompt_token_ids": p} for p in prompts]
            outs[spec is None] = [[o.outputs[0].token_ids for o in llm.generate(inputs, ps,
                                                                              use_tqdm=False)]
                                  for ps in (greedy, sampled)]
            if spec:
                assert llm.engine.stats.spec_accepted_tokens > 0
    assert outs[False] == outs[True]
    assert outs[False][0] == hf_greedy_cuda(tiny_llama, prompts, 24, torch.float32)
