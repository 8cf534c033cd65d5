"""Shared fixtures: one local Ray cluster per test session, tiny HF checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAYPP_STEP_TIMEOUT_S", "60")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by the whole session (started once)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, object_store_memory=256 * 2**20, include_dashboard=False,
                 log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-layer GQA Llama, untied embeddings, single safetensors file."""
    from raypp.testing.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), architecture="llama", seed=0)


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
