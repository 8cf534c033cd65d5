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
