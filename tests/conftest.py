"""Shared fixtures: one local Ray cluster per test session, tiny HF checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAYPP_STEP_TIMEOUT_S", "60")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``RAYPP_FAILURES_FILE`` set, each failure's traceback is appended to that file
    as it happens: a device call whose ``timeout`` stops pytest before its summary still
    keeps the tracebacks (``scripts/gpu_cuda_tests.sh`` sets it)."""
    path = os.environ.get("RAYPP_FAILURES_FILE")
    if path and report.failed:
        with open(path, "a") as out:
            out.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by the whole session (started once)."""
    import ray

    from raypp.executor.stage_pool import ensure_ray

    ensure_ray(None)  # the cluster users get: RAY_ADDRESS's, else a new local one
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-layer GQA Llama, untied embeddings, single safetensors file."""
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), architecture="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_half(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_llama``'s first 3 of 6 layers with its embedding, final norm and LM head (the
    same files, ``num_hidden_layers`` 3): a draft model that agrees with it in part."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("tiny_llama_half") / "model"
    shutil.copytree(tiny_llama, path)
    config = path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_hidden_layers": 3}))
    return path


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-layer Qwen2 (qkv bias), tied embeddings, sharded safetensors with an index."""
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen2"),
        architecture="qwen2",
        seed=1,
        tie_word_embeddings=True,
        max_shard_size="100KB",
    )


@pytest.fixture(scope="session")
def tiny_llama3_rope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """7-layer Llama with llama3 rope scaling and tied embeddings."""
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_llama3"),
        architecture="llama",
        seed=2,
        num_layers=7,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )


# -- the families beyond Llama (tests/test_families.py, tests/test_cuda_families.py) --------

GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
                      "sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-layer Qwen3: per-head q/k norm, head_dim 24 (4 heads × 24 = 96 ≠ hidden 64), GQA,
    untied embeddings, sharded safetensors."""
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), architecture="qwen3",
                           head_dim=24, seed=3, max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-layer Mistral with a 7-token sliding window (shorter than most test prompts, not
    a multiple of the 16-token KV block)."""
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_mistral"), architecture="mistral",
                           sliding_window=7, seed=4)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-layer Gemma 3 (text): sliding (11-token window, rotary base 10k) and global layers
    (base 1M, linear rope scaling ×2) interleaved unevenly, head_dim 24 (96 ≠ hidden 64),
    query_pre_attn_scalar 20 (≠ head_dim), tied embeddings, logits soft-capped at 50 (its
    raw logits reach about 70)."""
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_gemma3"), architecture="gemma3", head_dim=24,
        sliding_window=11, seed=5, tie_word_embeddings=True, rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        extra_config={"query_pre_attn_scalar": 20, "rope_local_base_freq": 10_000.0,
                      "layer_types": GEMMA3_LAYER_TYPES, "final_logit_softcapping": 50.0})


# -- mixture-of-experts families (tests/test_moe.py, tests/test_cuda_moe.py) ---------------


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-layer Qwen3-MoE, every layer sparse: 8 experts of 32, top-2 renormalised
    (``norm_topk_prob``), head_dim 24, one tensor per expert (the Hub's layout), sharded."""
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen3_moe"), architecture="qwen3_moe", head_dim=24, seed=6,
        max_shard_size="100KB",
        extra_config={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "norm_topk_prob": True})


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dense_first(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-layer Qwen3-MoE whose first layer is dense (``mlp_only_layers=[0]``), with 16
    experts of 32 on the others, top-4 without renormalisation; written in transformers'
    fused layout (``experts.gate_up_proj`` / ``experts.down_proj``). The dense layer's MLP
    (intermediate 1024) holds twice a sparse layer's bytes, so layers differ in size and
    three stages split them 1, 3, 2 by bytes (an even split would be 2, 2, 2)."""
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_qwen3_moe_dense"), architecture="qwen3_moe", seed=7,
        save_original_format=False, intermediate_size=1024,
        extra_config={"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                      "norm_topk_prob": False, "mlp_only_layers": [0]})


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-layer Mixtral: 8 experts of 32 on every layer, top-2 (always renormalised), an
    11-token sliding window, the Hub's ``block_sparse_moe.experts.<e>.w1/w2/w3`` names."""
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_mixtral"), architecture="mixtral", intermediate_size=32,
        sliding_window=11, seed=8,
        extra_config={"num_local_experts": 8, "num_experts_per_tok": 2})
