"""The offline API's contract: bad input is refused clearly and loses nothing;
shutdown leaves nothing behind."""

from __future__ import annotations

import time

import psutil
import pytest
import ray

from raypp import LLM, SamplingParams
from raypp.errors import ContextLengthError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("max_tokens", 0),
        ("n", 0),
        ("seed", "x"),
        ("logprobs", 50),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_valid_sampling_params_normalize():
    p = SamplingParams(top_k=-1, stop="###", temperature=0)
    assert p.top_k == 0 and p.stop_strings == ["###"] and p.greedy


def test_missing_model_dir_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(missing))


def test_dir_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_more_stages_than_layers(tiny_llama):
    with pytest.raises(ValueError, match="exceeds the model's 6 layers"):
        LLM(str(tiny_llama), pipeline_parallel_size=7)


def test_bad_partition(tiny_llama):
    with pytest.raises(ValueError, match="partition"):
        LLM(str(tiny_llama), pipeline_parallel_size=3, layer_partition="3,2")
    with pytest.raises(ValueError, match='layer partition must look like "3,2,2"'):
        LLM(str(tiny_llama), pipeline_parallel_size=3, layer_partition="3;2;1")


def test_unknown_option_is_rejected(tiny_llama):
    with pytest.raises(TypeError, match="pipeline_paralel_size"):
        LLM(str(tiny_llama), pipeline_paralel_size=2)


def test_max_model_len_bounds(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_llama), max_model_len=10_000)


@pytest.fixture(scope="module")
def llm(ray_cluster, tiny_llama):
    with LLM(str(tiny_llama), pipeline_parallel_size=2, max_model_len=64) as llm:
        yield llm


def test_too_long_prompt_is_refused_and_engine_keeps_serving(llm):
    good = SamplingParams(temperature=0, max_tokens=5)
    before = llm.generate(["The list type"], good, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate(["The list type", {"prompt_token_ids": [5] * 64}], good, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing of the batch was queued
    after = llm.generate(["The list type"], good, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before


def test_max_tokens_beyond_the_context_is_refused_and_none_runs_to_its_end(llm):
    """A prompt plus max_tokens over max_model_len is an error naming the numbers (nothing
    queued), not a silent early stop; max_tokens=None runs to the context's end."""
    prompt = {"prompt_token_ids": [7] * 60}
    with pytest.raises(ContextLengthError, match="max_tokens=50 is more than the context leaves: "
                       "the prompt has 60 tokens and max_model_len is 64, so at most 4") as err:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                     use_tqdm=False)
    assert err.value.field == "max_tokens" and isinstance(err.value, ValueError)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert out.outputs[0].finish_reason == "length"


def test_empty_and_out_of_vocab_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate({"prompt_token_ids": [10**6]}, use_tqdm=False)


def test_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_per_prompt_params_and_stop_token(llm):
    outs = llm.generate(
        ["The list type", "The list type"],
        [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0, max_tokens=6)],
        use_tqdm=False,
    )
    assert len(outs[0].outputs[0].token_ids) == 3 and len(outs[1].outputs[0].token_ids) == 6
    assert outs[1].outputs[0].token_ids[:3] == outs[0].outputs[0].token_ids
    stop_at = outs[1].outputs[0].token_ids[1]
    stopped = llm.generate("The list type", SamplingParams(temperature=0, max_tokens=6,
                                                          stop_token_ids=[stop_at]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == outs[1].outputs[0].token_ids[:2]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at


def _alive(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False


def test_shutdown_leaves_no_actors_and_a_second_llm_works(ray_cluster, tiny_llama):
    first = LLM(str(tiny_llama), pipeline_parallel_size=2)
    executor = first.engine.executor
    namespace = executor.namespace
    pids = ray.get([w.ping.remote() for w in executor.all_workers])
    assert _alive("raypp_worker_0_0", namespace) and _alive("raypp_worker_1_0", namespace)
    text = first.generate("A", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    first.shutdown()
    first.shutdown()  # idempotent
    assert not _alive("raypp_worker_0_0", namespace)
    assert not _alive("raypp_worker_1_0", namespace)
    deadline = time.time() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    with LLM(str(tiny_llama), pipeline_parallel_size=2) as second:
        again = second.generate("A", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert again[0].outputs[0].token_ids == text[0].outputs[0].token_ids


def test_stages_the_cluster_cannot_hold_are_named_with_what_is_free_and_keep_nothing(
        ray_cluster, tiny_llama, monkeypatch, caplog):
    """Stage workers asking for more CPU than the cluster has (as when another engine or
    job holds what they need): a WARNING naming what is free once the wait is long, then a
    RuntimeError at the start-up timeout; the failed start keeps no reservation."""
    from raypp.executor import stage_pool

    monkeypatch.setattr(stage_pool, "STARTUP_TIMEOUT_S", 4)
    monkeypatch.setattr(stage_pool, "RESERVE_WARN_AFTER_S", 1.0)
    monkeypatch.setattr(stage_pool, "WORKER_CPUS", ray.cluster_resources()["CPU"] + 1)
    before = ray.available_resources().get("CPU", 0)
    with caplog.at_level("WARNING", logger=stage_pool.__name__), \
            pytest.raises(RuntimeError, match="could not hold 2 stage workers"):
        LLM(str(tiny_llama), pipeline_parallel_size=2)
    assert "another engine or job may hold them" in caplog.text
    deadline = time.time() + 10
    while ray.available_resources().get("CPU", 0) < before and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) >= before


_NEW_CLUSTER = """
import json, os, ray
from raypp.executor.stage_pool import ensure_ray
ensure_ray(None)
seen = ray.get(ray.remote(lambda: os.environ.get("RAY_AUTH_MODE")).remote())
print("RESULT " + json.dumps([os.environ.get("RAY_AUTH_MODE"), seen]))
ray.shutdown()
"""


def test_a_new_local_cluster_leaves_the_callers_environment_as_it_was(tmp_path):
    """With RAY_AUTH_MODE unset, the local cluster raypp starts runs without token
    authentication (its processes see ``disabled``), no token lands in ``~/.ray``, and the
    caller's environment has no RAY_AUTH_MODE afterwards (a fresh process: the session's
    cluster is already up)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-c", _NEW_CLUSTER], capture_output=True, text=True,
                          timeout=300, env={**env, "HOME": str(tmp_path)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-8000:]
    assert json.loads(lines[-1][len("RESULT "):]) == [None, "disabled"]
    assert not (tmp_path / ".ray" / "auth_token").exists()
