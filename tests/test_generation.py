"""Pipeline-parallel greedy generation equals transformers, through the wrapped
communicator and through Ray's own transport."""

from __future__ import annotations

import pytest
from hf_reference import corpus_prompts, hf_greedy

from raypp import LLM, SamplingParams

PROMPT_LENGTHS = [1, 2, 5, 9, 17, 31, 40]
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def _prompts(llm: LLM) -> list[list[int]]:
    return corpus_prompts(llm.get_tokenizer(), PROMPT_LENGTHS)


def _generate_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    ("model", "pp", "partition", "plane"),
    [
        ("tiny_llama", 1, None, "cgraph"),
        ("tiny_llama", 2, None, "cgraph"),
        ("tiny_llama", 3, None, "cgraph"),
        ("tiny_llama", 3, "1,3,2", "cgraph"),
        ("tiny_qwen2", 2, None, "cgraph"),
        ("tiny_llama3_rope", 3, None, "cgraph"),
        ("tiny_qwen2", 2, None, "direct"),
        ("tiny_llama", 3, "1,3,2", "direct"),
    ],
)
def test_greedy_matches_transformers(request, ray_cluster, model, pp, partition, plane):
    model_dir = request.getfixturevalue(model)
    with LLM(str(model_dir), pipeline_parallel_size=pp, control_plane=plane,
             layer_partition=partition) as llm:
        assert llm.engine.executor.control_plane == plane
        prompts = _prompts(llm)
        assert [len(p) for p in prompts] == PROMPT_LENGTHS
        got = _generate_ids(llm, prompts)
        layers = [info["layers"] for info in llm.engine.executor.load_info]
    assert got == hf_greedy(model_dir, prompts, MAX_NEW)
    expected = {None: None, "1,3,2": [[0, 1], [1, 4], [4, 6]]}[partition]
    if expected:
        assert layers == expected
    assert layers[0][0] == 0 and layers[-1][1] == (7 if model == "tiny_llama3_rope" else 6)


def test_generate_returns_text_in_prompt_order(ray_cluster, tiny_llama):
    prompts = ["The list type", "A", "Assert statements are a convenient way to insert"]
    with LLM(str(tiny_llama), pipeline_parallel_size=2) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        tok = llm.get_tokenizer()
    assert [o.prompt for o in outs] == prompts
    for out, prompt in zip(outs, prompts):
        assert out.prompt_token_ids == tok.encode(prompt)
        completion = out.outputs[0]
        assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.finish_reason in ("stop", "length")
        assert out.finished


@pytest.fixture(scope="module")
def wrapped_llm(ray_cluster, tiny_llama):
    with LLM(str(tiny_llama), pipeline_parallel_size=2) as llm:
        yield llm


def test_wrapped_communicator_carries_the_stage_tensors(wrapped_llm, tiny_llama):
    llm = wrapped_llm
    before = llm.engine.executor.comm_stats()
    tokens_before = llm.engine.stats.tokens_processed
    steps_before = llm.engine.stats.steps
    _generate_ids(llm, _prompts(llm))
    after = llm.engine.executor.comm_stats()
    steps = llm.engine.stats.steps - steps_before
    tokens = llm.engine.stats.tokens_processed - tokens_before
    hidden = llm.engine.config.model.hidden_size
    # Each step sends hidden_states and residual stacked: one [2, tokens, hidden] fp32 tensor.
    sent = after[0]["sends"] - before[0]["sends"]
    received = after[1]["recvs"] - before[1]["recvs"]
    assert sent == received == steps
    assert after[0]["bytes_sent"] - before[0]["bytes_sent"] == 2 * tokens * hidden * 4
    assert after[1]["bytes_received"] - before[1]["bytes_received"] == 2 * tokens * hidden * 4


def test_ray_created_no_other_communicator(wrapped_llm):
    executor = wrapped_llm.engine.executor
    comms = executor.graph_communicators()
    assert comms["custom"] == ["RayPPCommunicator"]
    assert comms["ray_created"] == []
    import ray

    per_actor = ray.get([lane[0].channel_communicators.remote() for lane in executor.workers])
    assert per_actor == [["RayPPCommunicator"], ["RayPPCommunicator"]]


def test_ray_native_transport_gives_same_tokens(ray_cluster, tiny_llama, wrapped_llm):
    prompts = _prompts(wrapped_llm)
    wrapped = _generate_ids(wrapped_llm, prompts)
    with LLM(str(tiny_llama), pipeline_parallel_size=2, use_ray_wrapped_pp_comm=False) as llm:
        native = _generate_ids(llm, prompts)
        executor = llm.engine.executor
        assert executor.graph_communicators()["custom"] == []
        stats = executor.comm_stats()
    assert native == wrapped
    assert stats[0]["sends"] == 0  # the PP group carried nothing: Ray's shm did


def test_pipelined_reads_survive_a_slow_writer(ray_cluster, tiny_llama):
    """Ray's accelerator-channel read is not retry-safe (probe F1): a writer that
    pauses between its tensor send and its CPU-data write made stock Ray pair one
    execution's data with the next one's tensors. With several micro-batches in
    flight and a 0.25 s pause after every send, every result must still be right."""
    with LLM(str(tiny_llama), pipeline_parallel_size=2, max_inflight=2, max_num_seqs=4,
             fault_inject="delay_send:0:0.25") as llm:
        prompts = corpus_prompts(llm.get_tokenizer(), [3, 8, 13, 21])
        params = SamplingParams(temperature=0, max_tokens=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.stats.steps >= 6
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 4)


def test_config_defaults_come_from_the_environment(tiny_llama, monkeypatch):
    """A ``RAYPP_*`` variable only supplies a config field's default; an explicit field wins,
    and what the stages read is the config (it travels to them with the actors)."""
    from raypp.config import ParallelConfig, RuntimeConfig

    monkeypatch.delenv("RAYPP_USE_RAY_WRAPPED_PP_COMM", raising=False)
    assert ParallelConfig().use_ray_wrapped_pp_comm is True
    monkeypatch.setenv("RAYPP_USE_RAY_WRAPPED_PP_COMM", "0")
    assert ParallelConfig().use_ray_wrapped_pp_comm is False
    assert ParallelConfig(use_ray_wrapped_pp_comm=True).use_ray_wrapped_pp_comm is True
    monkeypatch.setenv("RAYPP_PP_LAYER_PARTITION", "1,3,2")
    assert ParallelConfig(3).layer_partition == [1, 3, 2]
    assert ParallelConfig(3, layer_partition="2,2,2").layer_partition == [2, 2, 2]
    monkeypatch.setenv("RAYPP_STEP_TIMEOUT_S", "7")
    assert RuntimeConfig().step_timeout_s == 7
    assert RuntimeConfig(step_timeout_s=2).step_timeout_s == 2
    with pytest.raises(ValueError, match="fault_inject='raise:x'"):
        RuntimeConfig(fault_inject="raise:x")
    with pytest.raises(ValueError, match="driver_wait"):
        RuntimeConfig(driver_wait="sometimes")


def test_integer_env_reads_and_names_a_bad_value(monkeypatch):
    from raypp import envs

    monkeypatch.delenv("RAYPP_FUSED_DECODE", raising=False)
    assert envs.RAYPP_FUSED_DECODE == 64
    monkeypatch.setenv("RAYPP_FUSED_DECODE", "8")
    assert envs.RAYPP_FUSED_DECODE == 8
    monkeypatch.setenv("RAYPP_FUSED_DECODE", "on")
    with pytest.raises(ValueError, match="RAYPP_FUSED_DECODE='on': expected an integer"):
        _ = envs.RAYPP_FUSED_DECODE
