"""One mapping of engine options: ``LLM`` keywords, ``AsyncLLMEngine.from_model`` keywords
and command-line flags all become a config through ``EngineConfig.from_kwargs``."""

from __future__ import annotations

import pytest

from raypp.cli import build_parser
from raypp.config import EngineConfig, UnknownOptionError
from raypp.entrypoints.args import engine_config

# Every section gets a value other than its default, so an option sent to the wrong
# config, or dropped, makes the configs differ.
SETTINGS = dict(
    pipeline_parallel_size=2, tensor_parallel_size=1, dtype="float32", max_model_len=64,
    seed=3, device="cpu", control_plane="direct", max_restarts=2, layer_partition=[4, 2],
    max_num_seqs=8, max_num_batched_tokens=256, max_inflight=3, num_decode_steps=1,
    async_scheduling=False, enable_prefix_caching=False, kv_cache_memory_bytes=8 * 2**20,
    gpu_memory_utilization=0.5, enforce_eager=True, workers_per_gpu=1, cpu_threads=1,
    step_timeout_s=30.0,
    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
)
FLAGS = [
    "-pp", "2", "-tp", "1", "--dtype", "float32", "--max-model-len", "64", "--seed", "3",
    "--device", "cpu", "--control-plane", "direct", "--max-restarts", "2",
    "--layer-partition", "4,2", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
    "--max-inflight", "3", "--num-decode-steps", "1", "--no-async-scheduling",
    "--no-enable-prefix-caching", "--kv-cache-memory", str(8 * 2**20),
    "--gpu-memory-utilization", "0.5", "--enforce-eager", "--workers-per-gpu", "1",
    "--cpu-threads", "1", "--step-timeout-s", "30",
    "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                            '"prompt_lookup_min": 1}',
]


def _from_flags(model: str, *flags: str) -> EngineConfig:
    return engine_config(model, build_parser().parse_args(["serve", model, *flags]))


def test_every_flag_means_the_keyword_it_becomes(tiny_llama):
    model = str(tiny_llama)
    config = EngineConfig.from_kwargs(model, **SETTINGS)
    assert _from_flags(model, *FLAGS) == config
    assert config != EngineConfig.from_kwargs(model, device="cpu")
    assert (config.parallel.control_plane, config.cache.enable_prefix_caching,
            config.scheduler.max_inflight, config.runtime.step_timeout_s,
            config.model.seed) == ("direct", False, 3, 30.0, 3)
    # no flag: every option keeps its default, as LLM(model) does
    assert _from_flags(model) == EngineConfig.from_kwargs(model)


def test_llm_and_async_engine_build_the_config_the_flags_give(ray_cluster, tiny_llama):
    from raypp import LLM
    from raypp.engine.async_engine import AsyncLLMEngine

    model = str(tiny_llama)
    settings = {**SETTINGS, "control_plane": "cgraph", "max_inflight": 2}  # cheaper to start
    flags = [*FLAGS, "--control-plane", "cgraph", "--max-inflight", "2"]  # the last one wins
    with LLM(model, **settings) as llm:
        from_llm = llm.engine.config
    engine = AsyncLLMEngine.from_model(model, **settings)
    try:
        from_async = engine.engine.config
    finally:
        engine.shutdown()
    assert from_llm == from_async == _from_flags(model, *flags)


def test_an_unknown_option_is_refused_with_its_close_matches(tiny_llama):
    from raypp import LLM
    from raypp.engine.async_engine import AsyncLLMEngine

    with pytest.raises(ValueError, match=r"unknown engine option: 'max_num_seq' "
                                         r"\(did you mean 'max_num_seqs'"):
        EngineConfig.from_kwargs(str(tiny_llama), max_num_seq=4)
    with pytest.raises(UnknownOptionError, match=r"options: 'kv_cache_memory' \(did you mean "
                                                 r"'kv_cache_memory_bytes' or 'kv_cache_dtype'\?\), "
                                                 r"'zzz'$"):
        AsyncLLMEngine.from_model(str(tiny_llama), zzz=1, kv_cache_memory=2**20)
    # a TypeError too, like any unknown keyword; refused before the model is looked at
    with pytest.raises(TypeError, match="'pipeline_paralel_size' .*'pipeline_parallel_size'"):
        LLM("/no/such/model", pipeline_paralel_size=2)
