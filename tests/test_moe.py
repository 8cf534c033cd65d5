"""Qwen3-MoE and Mixtral against transformers on tiny checkpoints built by its own classes
(8 experts top-2 renormalised; 16 experts top-4 without renormalisation and a dense first
layer, in transformers' fused layout; Mixtral with a sliding window): greedy tokens equal
in fp32 and logprobs within tolerance of transformers', at pp 1-3 (explicit and
byte-balanced splits) and tp 2, both control planes; seeded sampling equal across
layouts. Plus the mixture-of-experts block itself (both expert GEMM paths, no host sync on
the grouped one) and the checkpoint layouts, each TP rank reading only its slice.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import corpus_prompts, hf_greedy, hf_logits

from raypp import LLM, SamplingParams

HAS_GROUPED_MM = hasattr(torch.nn.functional, "grouped_mm")  # torch >= 2.10
FAMILIES = ["tiny_qwen3_moe", "tiny_qwen3_moe_dense_first", "tiny_mixtral"]
PROMPT_LENGTHS = [1, 2, 5, 9, 17, 31, 40]  # Mixtral's window is 11
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=77, ignore_eos=True)
LOGPROB_ATOL = 1e-4


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                               use_tqdm=False)]


@pytest.fixture(scope="module")
def one_stage(request, ray_cluster) -> dict:
    """Per family, a one-stage, one-rank engine's prompts, greedy completions (with
    logprobs) and seeded token ids: what every other layout must reproduce."""
    runs = {}
    for family in FAMILIES:
        with LLM(str(request.getfixturevalue(family))) as llm:
            prompts = corpus_prompts(llm.get_tokenizer(), PROMPT_LENGTHS)
            greedy = _generate(llm, prompts, GREEDY)
            seeded = [c.token_ids for c in _generate(llm, prompts, SEEDED)]
        runs[family] = (prompts, greedy, seeded)
    return runs


@pytest.mark.parametrize("family", FAMILIES)
def test_one_stage_matches_transformers(request, one_stage, family):
    model_dir = request.getfixturevalue(family)
    prompts, greedy, _ = one_stage[family]
    assert [c.token_ids for c in greedy] == hf_greedy(model_dir, prompts, MAX_NEW)
    worst = 0.0
    for prompt, completion in zip(prompts, greedy, strict=True):
        ref = hf_logits(model_dir, prompt + completion.token_ids[:-1]).log_softmax(-1)
        for i, top in enumerate(completion.logprobs):
            for token, lp in top.items():
                worst = max(worst, abs(lp.logprob - ref[len(prompt) - 1 + i, token].item()))
    assert worst < LOGPROB_ATOL, worst


@pytest.mark.parametrize(
    ("family", "tp", "pp", "partition", "plane", "chunk"),
    [
        ("tiny_qwen3_moe", 1, 3, "1,3,2", "direct", None),
        ("tiny_qwen3_moe", 2, 2, None, "cgraph", None),
        ("tiny_qwen3_moe_dense_first", 1, 3, None, "cgraph", None),  # by bytes: 1, 3, 2
        ("tiny_qwen3_moe_dense_first", 2, 1, None, "direct", None),
        ("tiny_mixtral", 1, 2, "4,2", "cgraph", 16),
        ("tiny_mixtral", 2, 1, None, "direct", None),
    ],
)
def test_layout_matches_one_stage(request, one_stage, family, tp, pp, partition, plane, chunk):
    """Greedy tokens (hence transformers') and logprobs of one stage, seeded samples equal;
    each stage built only its layers (the byte-balanced ones when no partition is given),
    each TP rank read only its slice of them, and the start-up table reports the stages.
    ``chunk``: prefill in 16-token chunks reaching back across Mixtral's window."""
    from raypp.config import EngineConfig, ModelConfig, ParallelConfig
    from raypp.executor.stage_pool import format_stage_table

    model_dir = request.getfixturevalue(family)
    prompts, greedy_ref, seeded_ref = one_stage[family]
    extra = {} if chunk is None else {"max_num_batched_tokens": chunk}
    with LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             layer_partition=partition, control_plane=plane, **extra) as llm:
        greedy = _generate(llm, prompts, GREEDY)
        seeded = [c.token_ids for c in _generate(llm, prompts, SEEDED)]
        info = llm.engine.executor.load_info
        summary = llm.engine.executor.pool.stage_summary
        blocks = llm.engine.executor.num_kv_blocks
    assert [c.token_ids for c in greedy] == [c.token_ids for c in greedy_ref]
    worst = max(abs(lp.logprob - ref[token].logprob)
                for got, want in zip(greedy, greedy_ref, strict=True)
                for top, ref in zip(got.logprobs, want.logprobs, strict=True)
                for token, lp in top.items())
    assert worst < LOGPROB_ATOL, worst
    assert seeded == seeded_ref
    expected = EngineConfig(ModelConfig(str(model_dir)),
                            ParallelConfig(pipeline_parallel_size=pp,
                                           layer_partition=partition)).stage_layers()
    if family == "tiny_qwen3_moe_dense_first" and pp == 3:
        assert expected == [(0, 1), (1, 4), (4, 6)]
    assert [tuple(s["layers"]) for s in summary] == expected
    assert sorted({tuple(i["layers"]) for i in info}) == expected
    for a, b in expected:  # each TP rank read only its slice (norms and routers replicated)
        read = [i["bytes_read"] for i in info if tuple(i["layers"]) == (a, b)]
        assert len(read) == tp and max(read) < (0.75 if tp > 1 else 1.01) * sum(read)
    assert min(s["kv_blocks"] for s in summary) == blocks
    smallest = min(range(len(summary)), key=lambda i: summary[i]["kv_blocks"])
    assert (f"engine KV capacity = min over stages = {blocks} blocks (stage {smallest})"
            in format_stage_table(summary, smallest))


# -- partitioning by bytes ---------------------------------------------------------------


def _stage_bytes(model_dir, pp: int, partition: str | None = None):
    from raypp.config import EngineConfig, ModelConfig, ParallelConfig
    from raypp.model.partition import weight_layout

    mc = ModelConfig(str(model_dir))
    bounds = EngineConfig(mc, ParallelConfig(pipeline_parallel_size=pp,
                                             layer_partition=partition)).stage_layers()
    layout = weight_layout(mc.hf_config, mc.architecture, mc.torch_dtype)
    return bounds, layout, layout.stage_bytes(bounds)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_dense_and_sparse_layers_are_balanced_by_bytes(tiny_qwen3_moe_dense_first, pp):
    """Stage byte counts (embedding on the first, norm and LM head on the last) within one
    layer's size of each other, and no contiguous split has a smaller largest stage."""
    import itertools

    bounds, layout, sizes = _stage_bytes(tiny_qwen3_moe_dense_first, pp)
    assert len(set(layout.layers)) > 1  # a dense layer among sparse ones
    assert max(sizes) - min(sizes) <= max(layout.layers), (bounds, sizes)
    n = len(layout.layers)
    best = min(max(layout.stage_bytes(list(zip((0, *cuts), (*cuts, n), strict=True))))
               for cuts in itertools.combinations(range(1, n), pp - 1))
    assert max(sizes) == best


def test_explicit_partition_wins_and_uniform_layers_split_evenly(tiny_qwen3_moe_dense_first,
                                                                 tiny_qwen3_moe):
    bounds, _, _ = _stage_bytes(tiny_qwen3_moe_dense_first, 3, "2,2,2")
    assert bounds == [(0, 2), (2, 4), (4, 6)]
    bounds, layout, _ = _stage_bytes(tiny_qwen3_moe, 4)  # every layer sparse: as before
    assert len(set(layout.layers)) == 1
    assert bounds == [(0, 2), (2, 4), (4, 5), (5, 6)]


def test_balance_by_bytes_against_every_split():
    """On random layouts, the chosen split has the smallest largest stage of all
    contiguous splits, and of those, the largest smallest stage."""
    import itertools
    import random

    from raypp.model.partition import WeightLayout, balance_by_bytes

    rng = random.Random(0)
    for _ in range(60):
        n, pp = rng.randint(1, 9), rng.randint(1, 4)
        if pp > n:
            continue
        layout = WeightLayout(rng.randint(0, 50), tuple(rng.randint(1, 100) for _ in range(n)),
                              rng.randint(0, 50))
        sizes = balance_by_bytes(layout, pp)
        assert len(sizes) == pp and min(sizes) >= 1 and sum(sizes) == n
        every = [layout.stage_bytes(list(zip((0, *c), (*c, n), strict=True)))
                 for c in itertools.combinations(range(1, n), pp - 1)]
        ends = list(itertools.accumulate(sizes))
        got = layout.stage_bytes(list(zip([0, *ends[:-1]], ends, strict=True)))
        best_max = min(max(s) for s in every)
        assert max(got) == best_max
        assert min(got) == max(min(s) for s in every if max(s) == best_max)


def test_a_dense_first_30b_shape_is_balanced_on_the_meta_device():
    """A Qwen3-30B-A3B-shaped config (48 layers, 128 experts) with three dense first layers:
    bytes per stage within one layer's size, counted without allocating (meta device)."""
    from raypp.model.partition import stage_partition, weight_layout

    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
           "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
           "vocab_size": 151936, "max_position_embeddings": 40960, "mlp_only_layers": [0, 1, 2],
           "norm_topk_prob": True}
    layout = weight_layout(cfg, "Qwen3MoeForCausalLM", torch.bfloat16)
    assert 1.1e9 < layout.layers[3] < 1.3e9 and layout.layers[0] < layout.layers[3] / 10
    for pp in (2, 4, 8):
        bounds = stage_partition(cfg, "Qwen3MoeForCausalLM", torch.bfloat16, pp)
        sizes = layout.stage_bytes(bounds)
        assert max(sizes) - min(sizes) <= max(layout.layers), (pp, bounds)


# -- the mixture-of-experts block ------------------------------------------------------------


def _block(dtype: torch.dtype, renormalize: bool = True, fp32_weights: bool = False):
    from raypp.model.layers import TPContext
    from raypp.model.moe import MoESpec, SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(64, MoESpec(8, 3, 32, renormalize, fp32_weights), TPContext(), dtype)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    return block


@pytest.mark.parametrize("renormalize,fp32_weights", [(True, False), (False, False), (True, True)])
def test_block_matches_a_per_token_reference_on_both_gemm_paths(renormalize, fp32_weights):
    """The grouped GEMM and the per-expert loop give a float64 per-token computation of
    the same routing (softmax, top-k, optional renormalisation, gated experts, weighted sum)."""
    block = _block(torch.float32, renormalize, fp32_weights)
    x = torch.randn(37, 64)
    w = block.experts
    probs = torch.softmax(x.double() @ block.gate.weight.double().T, dim=-1)
    want = torch.zeros(37, 64, dtype=torch.float64)
    for t in range(37):
        top = probs[t].topk(3)
        weights = top.values / top.values.sum() if renormalize else top.values
        for weight, e in zip(weights, top.indices.tolist(), strict=True):
            gate, up = (w.w13_weight[e].double() @ x[t].double()).chunk(2)
            want[t] += weight * (w.w2_weight[e].double() @ (torch.nn.functional.silu(gate) * up))
    assert block.grouped == HAS_GROUPED_MM  # torch's grouped_mm on CPU where torch has it
    grouped = block(x)
    block.grouped = False
    looped = block(x)
    torch.testing.assert_close(grouped.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(looped, grouped, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no grouped_mm")
def test_grouped_block_traces_as_one_graph_and_the_loop_does_not():
    """The grouped path (bf16, as on CUDA) has no host sync: dynamo traces the whole block
    with ``fullgraph=True``, which a CUDA graph capture needs too; the per-expert loop
    reads the offsets on the host and cannot."""
    block = _block(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    traced = torch.compile(block, fullgraph=True, backend="eager")
    torch.testing.assert_close(traced(x), block(x))
    block.grouped = False
    torch._dynamo.reset()
    with pytest.raises(Exception):  # noqa: B017 - dynamo's error type varies across versions
        torch.compile(block, fullgraph=True, backend="eager")(x)
    torch._dynamo.reset()


def test_which_devices_get_the_grouped_gemm_and_cuda_graphs(tiny_qwen3_moe):
    """CPU: grouped_mm; CUDA: only bfloat16 with 16-byte rows (decided before asking the
    device). A stage whose experts need the loop declares it cannot be graph-captured;
    MoE stages declare no fused decode chain."""
    from raypp.config import ModelConfig
    from raypp.model.base import StageSpec
    from raypp.model.layers import TPContext
    from raypp.model.moe import grouped_mm_supported
    from raypp.model.registry import model_class

    cuda = torch.device("cuda")
    assert grouped_mm_supported(torch.device("cpu"), torch.float32, (64, 12)) == HAS_GROUPED_MM
    assert not grouped_mm_supported(cuda, torch.float32, (64, 32))
    assert not grouped_mm_supported(cuda, torch.bfloat16, (64, 12))
    mc = ModelConfig(str(tiny_qwen3_moe))
    model = model_class(mc.architecture)(mc.hf_config, StageSpec(0, 2, True, False), TPContext(),
                                         torch.float32, "torch")
    assert (model.decode_graphs_unsupported() is None) == HAS_GROUPED_MM
    assert "no fused decode chain" in model.fused_decode_unsupported()
    model.model.layers["1"].mlp.grouped = False
    assert "layer 1" in model.decode_graphs_unsupported()


# -- checkpoints -----------------------------------------------------------------------------


def test_expert_checkpoint_names_of_both_layouts():
    from raypp.model.moe import expert_checkpoint_name

    mlp = "model.layers.3.mlp"
    assert expert_checkpoint_name("model.layers.3.mlp.experts.5.up_proj.weight") == (
        3, f"{mlp}.experts.w13_weight", (5, "up"))
    assert expert_checkpoint_name("model.layers.3.block_sparse_moe.experts.0.w2.weight") == (
        3, f"{mlp}.experts.w2_weight", (0, "down"))
    assert expert_checkpoint_name("model.layers.3.block_sparse_moe.experts.7.w3.weight") == (
        3, f"{mlp}.experts.w13_weight", (7, "up"))
    assert expert_checkpoint_name("model.layers.3.mlp.experts.gate_up_proj") == (
        3, f"{mlp}.experts.w13_weight", (None, "gate_up"))
    assert expert_checkpoint_name("model.layers.3.block_sparse_moe.gate.weight") == (
        3, f"{mlp}.gate.weight", None)
    for other in ("model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate_proj.weight",
                  "model.embed_tokens.weight"):
        assert expert_checkpoint_name(other) is None


def test_both_layouts_load_the_same_slices(tmp_path):
    """One model written per expert (the Hub's layout) and fused (transformers' in-memory
    one): every TP rank of a stage gets the same parameters from either, reading only its
    rows of the experts."""
    from raypp.config import ModelConfig
    from raypp.model.base import StageSpec
    from raypp.model.layers import TPContext
    from raypp.model.loader import load_stage_weights
    from raypp.model.registry import model_class
    from raypp.testing.tiny_model import make_tiny_model

    spec = dict(architecture="qwen3_moe", num_layers=3, seed=9,
                extra_config={"num_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 32, "mlp_only_layers": [0]})
    dirs = [make_tiny_model(tmp_path / "hub", **spec),
            make_tiny_model(tmp_path / "fused", save_original_format=False, **spec)]
    stage = StageSpec(1, 3, False, True)
    params, reads = [], []
    for model_dir in dirs:
        mc = ModelConfig(str(model_dir))
        for rank in (0, 1):
            model = model_class(mc.architecture)(mc.hf_config, stage, TPContext(rank, 2),
                                                 torch.float32, "torch")
            report = load_stage_weights(model, str(model_dir))
            params.append(dict(model.named_parameters()))
            reads.append(report.bytes_read)
    for name in params[0]:
        torch.testing.assert_close(params[0][name], params[2][name], rtol=0, atol=0)
        torch.testing.assert_close(params[1][name], params[3][name], rtol=0, atol=0)
    w13 = "model.layers.1.mlp.experts.w13_weight"
    assert params[0][w13].shape == (4, 32, 64)  # 2 × 16 rows of each expert per rank
    assert not torch.equal(params[0][w13], params[1][w13])
    assert reads[0] == reads[2] and reads[0] < 0.75 * (reads[0] + reads[1])


def test_bench_make_model_writes_moe_checkpoints(tmp_path):
    """``raypp bench make-model`` writes Qwen3-MoE (dense first layers) and Mixtral
    checkpoints that raypp reads."""
    import json

    from raypp.cli import main
    from raypp.config import EngineConfig, ModelConfig, ParallelConfig

    common = ["--hidden", "64", "--layers", "4", "--heads", "4", "--vocab", "300", "--experts", "8"]
    qwen, mixtral = tmp_path / "qwen3_moe", tmp_path / "mixtral"
    assert main(["bench", "make-model", "--out", str(qwen), "--architecture", "qwen3_moe",
                 "--dense-first", "2", *common]) == 0
    assert main(["bench", "make-model", "--out", str(mixtral), "--architecture", "mixtral",
                 "--intermediate", "32", *common]) == 0
    config = json.loads((qwen / "config.json").read_text())
    assert config["mlp_only_layers"] == [0, 1] and config["moe_intermediate_size"] == 48
    assert json.loads((mixtral / "config.json").read_text())["num_local_experts"] == 8
    from raypp.model.partition import weight_layout

    for model_dir, arch in ((qwen, "Qwen3MoeForCausalLM"), (mixtral, "MixtralForCausalLM")):
        mc = ModelConfig(str(model_dir))
        assert mc.architecture == arch
        layers = weight_layout(mc.hf_config, arch, mc.torch_dtype).layers
        assert (layers[0] < layers[3]) == (arch == "Qwen3MoeForCausalLM")  # MLP 192 < 8 × 48
        assert len(EngineConfig(mc, ParallelConfig(pipeline_parallel_size=2)).stage_layers()) == 2
