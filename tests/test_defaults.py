"""Defaults a new user meets: sampling defaults from the model's generation config (in
``LLM`` and the server, overridable, and off with ``generation_config="none"``),
``max_tokens`` against the context (an error, a 400 naming both numbers), ``max_model_len``
fitted to the KV cache with one warning, and the CPU KV budget sized from the host's
memory. Real engines on a tiny checkpoint, real HTTP on loopback."""

from __future__ import annotations

import json
import logging
import shutil

import httpx
import numpy as np
import pytest
import torch

from raypp import LLM, SamplingParams
from raypp.config import EngineConfig
from raypp.engine.async_engine import AsyncLLMEngine
from raypp.entrypoints.openai.app import ServerConfig, build_app
from raypp.testing.server import ServerThread
from raypp.worker.kv_memory import CPU_FRACTION, cpu_budget, zeros

GENERATION_CONFIG = {"temperature": 0.0, "top_k": 3, "do_sample": True, "max_new_tokens": 5}
PROMPTS = ["The list type", "A function definition", "The import statement"]


@pytest.fixture(scope="module")
def tuned_model(tmp_path_factory, tiny_llama):
    """The tiny Llama with sampling defaults in its generation_config.json."""
    model = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **GENERATION_CONFIG}))
    return model


# -- the generation config --------------------------------------------------------------------
def test_generation_config_sets_the_sampling_defaults(tuned_model, tmp_path):
    """The sampling fields are taken (do_sample and max_new_tokens are not, as in vLLM);
    'none' ignores the file; a directory reads its own."""
    assert EngineConfig.from_kwargs(str(tuned_model)).model.sampling_defaults == {
        "temperature": 0.0, "top_k": 3}
    none = EngineConfig.from_kwargs(str(tuned_model), generation_config="none")
    assert none.model.sampling_defaults == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    other = EngineConfig.from_kwargs(str(tuned_model), generation_config=str(tmp_path))
    assert other.model.sampling_defaults == {"top_p": 0.5}
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'none' or a directory"):
        EngineConfig.from_kwargs(str(tuned_model), generation_config="/no/such/dir")


def test_the_demo_ships_greedy_defaults():
    from raypp.demo import GENERATION_CONFIG as DEMO

    config = EngineConfig.from_kwargs("demo")  # fetched once (make setup does it)
    assert config.model.sampling_defaults == DEMO == {"temperature": 0.0}


@pytest.fixture(scope="module")
def tuned(ray_cluster, tuned_model):
    """One engine on the tuned model: greedy references first, then served over HTTP."""
    llm = LLM(str(tuned_model), max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    refs = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    yield llm, refs
    llm.shutdown()


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_llm_applies_the_defaults_and_an_explicit_params_wins(tuned):
    llm, refs = tuned
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 3, 16)
    greedy = _ids(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16),
                               use_tqdm=False))
    assert _ids(llm.generate(PROMPTS, use_tqdm=False)) == greedy  # no params: the model's
    assert _ids(llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)) == _ids(
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=16),
                 use_tqdm=False))
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, seed=5,
                                                   ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].text for o in sampled] != refs  # given params are used as they are


@pytest.fixture(scope="module")
def server(tuned):
    llm, refs = tuned
    engine = AsyncLLMEngine(llm.engine)
    thread = ServerThread(build_app(engine, ServerConfig(["tuned"]))).start()
    yield thread.url, refs
    thread.stop()
    engine.shutdown()


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tuned", **body}, timeout=60)


def test_server_applies_the_defaults_to_fields_a_request_leaves_out(server):
    url, refs = server
    base = {"max_tokens": 8, "ignore_eos": True}
    texts = [_complete(url, prompt=p, seed=i, **base).json()["choices"][0]["text"]
             for i, p in enumerate(PROMPTS)]
    assert texts == refs  # greedy, from the generation config
    hot = [_complete(url, prompt=p, temperature=1.0, top_k=0, seed=5, **base).json()
           ["choices"][0]["text"] for p in PROMPTS]
    assert hot != refs  # a field the request sends wins


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_server_refuses_max_tokens_beyond_the_context_naming_both_numbers(server, endpoint):
    url, _ = server
    body = ({"prompt": "The list type"} if endpoint == "completions"
            else {"messages": [{"role": "user", "content": "The list type"}]})
    r = httpx.post(f"{url}/v1/{endpoint}", json={"model": "tuned", "max_tokens": 100_000, **body},
                   timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert "max_tokens=100000" in error["message"] and "max_model_len is 64" in error["message"]
    ok = httpx.post(f"{url}/v1/{endpoint}", json={"model": "tuned", "max_tokens": 2, **body},
                    timeout=60)
    assert ok.status_code == 200  # the server keeps serving


def test_server_refuses_what_it_does_not_support_naming_the_field(server):
    """The README's table of what the server does not support: refused, not ignored."""
    url, _ = server
    for field, value in (("suffix", "x"), ("echo", True)):
        body = {field: value, "logprobs": 1} if field == "echo" else {field: value}
        r = _complete(url, prompt="The list type", max_tokens=2, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    messages = [{"role": "user", "content": "The list type"}]
    for field, value in (("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["audio"]),
                         ("web_search_options", {})):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tuned", "max_tokens": 2,
                                                          "messages": messages, field: value},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    assert httpx.post(f"{url}/v1/embeddings", json={"model": "tuned", "input": "x"},
                      timeout=60).status_code == 404


# -- max_model_len and the KV cache -----------------------------------------------------------
@pytest.fixture(scope="module")
def long_model(tmp_path_factory, tiny_llama):
    """The tiny Llama claiming 32,768 positions (as Gemma 3 270M does)."""
    model = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    return model


def test_max_model_len_is_fitted_to_the_kv_cache_with_one_warning(ray_cluster, long_model, caplog):
    """The cache holds 100 blocks of 16 tokens, not one 32,768-token sequence: the engine
    runs at 1,600 tokens and says so once, naming both numbers and the flags."""
    mc = EngineConfig.from_kwargs(str(long_model)).model
    block = 2 * 16 * mc.num_kv_heads * mc.head_dim * mc.num_layers * mc.torch_dtype.itemsize
    with caplog.at_level(logging.WARNING), \
            LLM(str(long_model), kv_cache_memory_bytes=100 * block) as llm:
        assert llm.engine.config.model.max_model_len == 1600
        assert llm.engine.scheduler.max_model_len == 1600
        out = llm.generate("The list type", SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) <= 4
    warnings = [r.getMessage() for r in caplog.records if "max_model_len lowered" in r.getMessage()]
    assert len(warnings) == 1
    for text in ("from 32768", "to 1600 tokens", "--max-model-len", "--kv-cache-memory"):
        assert text in warnings[0]


def test_a_max_model_len_given_is_never_lowered(ray_cluster, long_model):
    with pytest.raises(ValueError, match=r"holds \d+ blocks but one max_model_len \(32768\)"):
        LLM(str(long_model), max_model_len=32768, kv_cache_memory_bytes=2**20)


def test_the_cpu_kv_budget_is_a_share_of_the_hosts_memory():
    gib, block = 2**30, 2**20
    budget = cpu_budget(8 * gib, workers_on_host=2, block_bytes=block, max_blocks_used=10**6)
    assert budget.budget_bytes == int(CPU_FRACTION * 8 * gib / 2)
    assert budget.blocks == budget.budget_bytes // block and "shared by 2" in budget.source
    capped = cpu_budget(8 * gib, workers_on_host=1, block_bytes=block, max_blocks_used=10)
    assert capped.blocks == 10 and "capped at max_num_seqs" in capped.source


def test_the_cpu_kv_cache_is_zeroed_and_aligned():
    t = zeros((2, 5, 16, 3, 8), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (2, 5, 16, 3, 8) and t.dtype == torch.bfloat16
    assert t.data_ptr() % 64 == 0 and not t.any()
    t[1, 4] = 1.5
    assert float(t.sum()) == 1.5 * 16 * 3 * 8
    assert np.asarray(zeros((4,), torch.float32, torch.device("cpu"))).tolist() == [0.0] * 4
