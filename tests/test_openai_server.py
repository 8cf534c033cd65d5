"""The OpenAI-compatible server: real uvicorn on loopback, real pp=2 engine, real clients.

One server (tiny Llama, pp=2, API key on) serves the whole module. References
are computed with ``LLM.generate`` / ``LLM.chat`` on the same engine before the
async loop takes it over. The last two tests kill stages, so they must stay last.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from raypp import LLM, EngineDeadError, ErrorKind, RequestOutput, SamplingParams
from raypp.bench.serve import ServeBenchConfig, serve_bench
from raypp.cli import build_parser
from raypp.engine.async_engine import AsyncLLMEngine, GenerationError
from raypp.entrypoints.args import UsageError
from raypp.entrypoints.openai.app import ServerConfig, build_app
from raypp.entrypoints.openai.errors import generation_failure
from raypp.entrypoints.openai.server import run_server
from raypp.testing.server import ServerThread

KEY = "test-key"
MODEL = "tiny"
MAX_BODY = 64 * 1024
PROMPTS = ["The list type", "A function definition", "The import statement", "x = [1, 2"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class Served:
    url: str
    engine: AsyncLLMEngine
    llm: LLM
    refs: list[str]
    chat_ref: str

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, timeout=60, max_retries=0,
                             **kw)

    def post(self, path: str, body: dict | str | bytes, key: str | None = KEY,
             **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60, **kw)


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_llama):
    llm = LLM(str(tiny_llama), pipeline_parallel_size=2, kv_cache_memory_bytes=8 * 2**20,
              stats_interval_s=0.1)
    refs = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    chat_ref = llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].text
    engine = AsyncLLMEngine(llm.engine, collect_stage_times=True)
    config = ServerConfig([MODEL], str(tiny_llama), api_key=KEY, max_request_bytes=MAX_BODY)
    server = ServerThread(build_app(engine, config)).start()
    yield Served(server.url, engine, llm, refs, chat_ref)
    server.stop()
    engine.shutdown()


def _greedy(**extra) -> dict:
    return dict(temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}, **extra)


def _wait_idle(engine: AsyncLLMEngine, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"requests still hold blocks: {engine.stats()}")


def _metrics(served: Served) -> dict[str, float]:
    text = httpx.get(served.url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


# -- the openai client, unchanged ------------------------------------------------------------
def test_models_list(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 256


def test_greedy_completions_equal_llm_generate(served):
    client = served.client()
    for prompt, ref in zip(PROMPTS, served.refs, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, **_greedy())
        assert r.choices[0].text == ref
        assert r.choices[0].finish_reason == "length"
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, **_greedy())
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in batch.choices] == served.refs


def test_usage_counts_tokens(served):
    tok = served.engine.tokenizer
    r = served.client().completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, **_greedy())
    prompt_tokens = sum(len(tok.encode(p)) for p in PROMPTS[:2])
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == 4 * MAX_TOKENS
    assert r.usage.total_tokens == prompt_tokens + 4 * MAX_TOKENS
    ids = tok.encode(PROMPTS[0])
    r = served.client().completions.create(model=MODEL, prompt=ids, **_greedy())
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].text == served.refs[0]


def test_streaming_completion_with_usage(served):
    stream = served.client().completions.create(
        model=MODEL, prompt=PROMPTS[1], stream=True, stream_options={"include_usage": True},
        **_greedy())
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == served.refs[1]
    assert len(texts) > 1  # really streamed
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    raw = served.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                          "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_chat_completion_and_stream(served):
    client = served.client()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, **_greedy())
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == served.chat_ref
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True},
        **_greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == served.chat_ref
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_n2_and_seeded_sampling_reproducible(served):
    client = served.client()
    kw = dict(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=MAX_TOKENS, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    c = client.completions.create(seed=99, **kw)
    texts = lambda r: [ch.text for ch in r.choices]  # noqa: E731
    assert [ch.index for ch in a.choices] == [0, 1]
    assert texts(a) == texts(b)
    assert texts(a)[0] != texts(a)[1]  # the n completions are distinct samples
    assert texts(a) != texts(c)
    chat = [client.chat.completions.create(model=MODEL, messages=CHAT, n=2, seed=5,
                                           max_tokens=8) for _ in range(2)]
    assert [ch.message.content for ch in chat[0].choices] == \
        [ch.message.content for ch in chat[1].choices]


def test_logprobs(served):
    client = served.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], logprobs=3, **_greedy())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    assert r.choices[0].text == served.refs[2]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(MAX_TOKENS)]
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert top[chosen] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the top token
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True,
                                          top_logprobs=2, **_greedy())
    content = chat.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert bytes(t.bytes).decode() == t.token
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], logprobs=3,
                                              stream=True, **_greedy()))
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_stop_string_and_echo(served):
    client = served.client()
    ref = served.refs[3]
    stop = ref[len(ref) // 2: len(ref) // 2 + 2]
    expect = ref[: ref.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], stop=[stop], **_greedy())
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], stop=stop,
                                            stream=True, **_greedy()))
    assert "".join(c.choices[0].text for c in chunks) == expect  # held-back text never leaks
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], echo=True, **_greedy())
    assert r.choices[0].text == PROMPTS[3] + ref


def test_32_concurrent_streams_equal_single_client_results(served):
    client = served.client()
    cases = [(PROMPTS[i % 4] + " " * (i // 4), i) for i in range(32)]

    def params(i: int) -> dict:
        if i % 2:
            return dict(temperature=0.9, seed=i, max_tokens=MAX_TOKENS,
                        extra_body={"ignore_eos": True})
        return _greedy()

    single = [client.completions.create(model=MODEL, prompt=p, **params(i)).choices[0].text
              for p, i in cases]

    async def stream_one(aclient: openai.AsyncOpenAI, prompt: str, i: int) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, stream=True,
                                                  **params(i))
        parts = [c.choices[0].text async for c in stream]
        return "".join(parts)

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, timeout=120,
                                      max_retries=0) as aclient:
            return await asyncio.gather(*[stream_one(aclient, p, i) for p, i in cases])

    assert asyncio.run(run()) == single
    _wait_idle(served.engine)


# -- errors -----------------------------------------------------------------------------------
BAD = [
    ("malformed JSON", "/v1/completions", '{"model": "tiny", "prompt": ', KEY, 400, None),
    ("wrong type", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"},
     KEY, 400, "max_tokens"),
    ("best_of below n", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2, "best_of": 1},
     KEY, 400, "best_of"),
    ("unknown model", "/v1/completions", {"model": "gpt-5", "prompt": "x"}, KEY, 404, "model"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": list(range(300))},
     KEY, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 99999]},
     KEY, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": []}, KEY, 400, "prompt"),
    ("temperature < 0", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1},
     KEY, 400, "temperature"),
    ("top_p 0", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, KEY, 400,
     "top_p"),
    ("n 0", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, KEY, 400, "n"),
    ("n 1000", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 1000}, KEY, 400, "n"),
    ("logprobs 50", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50},
     KEY, 400, "logprobs"),
    ("max_tokens 0", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0},
     KEY, 400, "max_tokens"),
    ("echo + logprobs", "/v1/completions",
     {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, KEY, 400, "echo"),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, KEY, 400,
     "messages"),
    ("message without role", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"content": "hi"}]}, KEY, 400, "messages"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "top_logprobs": 2}, KEY, 400, "top_logprobs"),
    ("missing API key", "/v1/completions", {"model": MODEL, "prompt": "x"}, None, 401, None),
    ("wrong API key", "/v1/chat/completions", {"model": MODEL, "messages": CHAT}, "nope", 401,
     None),
    ("body too large", "/v1/completions", {"model": MODEL, "prompt": "x" * MAX_BODY}, KEY, 413,
     None),
]


@pytest.mark.parametrize(("case", "path", "body", "key", "status", "param"), BAD,
                         ids=[b[0] for b in BAD])
def test_bad_input_gets_4xx_and_server_keeps_serving(served, case, path, body, key, status,
                                                     param):
    r = served.post(path, body, key=key)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    ok = served.post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_chunked_body_over_limit_and_unknown_route(served):
    def chunks():
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024

    r = httpx.post(served.url + "/v1/completions", content=chunks(),
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 413
    r = httpx.get(served.url + "/v2/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# -- disconnects, metrics, health ---------------------------------------------------------------
def _finished(served: Served, reason: str) -> float:
    return _metrics(served).get(f"raypp_completions_finished_total{{finish_reason={reason}}}", 0)


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(served):
    _wait_idle(served.engine)
    aborted = _finished(served, "abort")
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 240, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        deadline = time.monotonic() + 10  # stats are published just after each step
        while served.engine.stats().kv_blocks_used == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.engine.stats().kv_blocks_used > 0
    _wait_idle(served.engine)  # closed mid-stream: aborted, blocks freed
    assert _finished(served, "abort") == aborted + 1

    # Non-streaming: the client gives up (timeout) while the request runs.
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {KEY}"})
    _wait_idle(served.engine)
    assert _finished(served, "abort") == aborted + 2


def test_metrics_parse_and_move_with_traffic(served):
    before = _metrics(served)
    r = served.client().completions.create(model=MODEL, prompt=PROMPTS[0], **_greedy())
    served.post("/v1/completions", {"model": "nope", "prompt": "x"})
    time.sleep(1.2)  # stage step times are collected about once a second
    after = _metrics(served)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("raypp_prompt_tokens_total{}") == r.usage.prompt_tokens
    assert delta("raypp_generation_tokens_total{}") == MAX_TOKENS
    assert delta("raypp_http_requests_total{endpoint=/v1/completions,status=200}") == 1
    assert delta("raypp_http_requests_total{endpoint=/v1/completions,status=404}") == 1
    assert delta("raypp_time_to_first_token_seconds_count{}") == 1
    assert delta("raypp_inter_token_latency_seconds_count{}") == MAX_TOKENS - 1
    assert delta("raypp_e2e_request_latency_seconds_count{}") == 1
    assert delta("raypp_completions_finished_total{finish_reason=length}") == 1
    assert delta("raypp_stage_step_seconds_count{stage=0}") >= MAX_TOKENS
    assert delta("raypp_stage_step_seconds_count{stage=1}") >= MAX_TOKENS
    assert after["raypp_kv_blocks_total{}"] > 0
    for gauge in ("raypp_num_requests_running{}", "raypp_num_requests_waiting{}",
                  "raypp_kv_blocks_used{}"):
        assert after[gauge] == 0


def test_metrics_report_each_stages_occupancy(served):
    """A 200-token completion spans windows of the engine's occupancy monitor (0.1 s
    here): /metrics then reports each stage's busy, bubble and idle shares."""
    served.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=200,
                                       temperature=0, extra_body={"ignore_eos": True})
    metrics = _metrics(served)
    for stage in (0, 1):
        busy = metrics[f"raypp_stage_busy_fraction{{stage={stage}}}"]
        idle = metrics[f"raypp_stage_idle_fraction{{stage={stage}}}"]
        bubble = metrics[f"raypp_stage_bubble_fraction{{stage={stage}}}"]
        assert 0 < busy <= 1 and busy + idle == pytest.approx(1, abs=1e-3)
        assert 0 <= bubble <= idle + 1e-3
        assert metrics[f"raypp_stage_tokens_per_step{{stage={stage}}}"] >= 1


def test_usage_and_metrics_report_cached_prompt_tokens(served):
    """Prefix caching is on by default: a prompt sharing 4 full blocks (of 16) with an
    earlier one has those 64 tokens cached, in usage and in the Prometheus counters."""
    ids = [(7 * j + 3) % 300 + 50 for j in range(70)]
    other = ids[:64] + [11, 12, 13]
    client = served.client()
    before = _metrics(served)
    cached = []
    for prompt in (ids, other, ids):
        r = client.completions.create(model=MODEL, prompt=prompt, **_greedy())
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, 64, 64]
    stream = client.completions.create(model=MODEL, prompt=other, stream=True,
                                       stream_options={"include_usage": True}, **_greedy())
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens == 64
    after = _metrics(served)
    assert (after["raypp_prefix_cache_queries_total{}"] - before["raypp_prefix_cache_queries_total{}"]
            == 2 * len(ids) + 2 * len(other))
    assert after["raypp_prefix_cache_hits_total{}"] - before["raypp_prefix_cache_hits_total{}"] == 192


def test_serve_bench_load_generator(served, tmp_path):
    cfg = ServeBenchConfig(url=served.url, api_key=KEY, concurrency=4, num_requests=8,
                           max_tokens=4, warmup=1)
    result = serve_bench(cfg)
    assert result["failed"] == 0 and result["requests"] == 8
    assert result["config"]["model"] == MODEL and result["config"]["api_key"] is None
    assert result["ttft_ms"]["n"] == 8 and result["ttft_ms"]["p99"] >= result["ttft_ms"]["p50"]
    assert result["requests_per_s"] > 0 and result["output_tokens_per_s"] > 0
    out = tmp_path / "serve.json"
    args = build_parser().parse_args(["bench", "serve", "--url", served.url, "--api-key", KEY,
                                      "-c", "2", "-n", "2", "--max-tokens", "2",
                                      "--endpoint", "chat", "--json", str(out)])
    assert args.func(args) == 0
    assert json.loads(out.read_text())["requests"] == 2


def test_serve_command_line():
    args = build_parser().parse_args(["serve", "/m", "-pp", "2", "--port", "9", "--api-key", "k",
                                      "--served-model-name", "a", "b", "--max-model-len", "64"])
    assert (args.model, args.pipeline_parallel_size, args.port, args.host) == ("/m", 2, 9,
                                                                               "127.0.0.1")
    assert args.served_model_name == ["a", "b"] and args.func is run_server
    with pytest.raises(UsageError, match="give a model"):  # the CLI: one line, exit 2
        run_server(build_parser().parse_args(["serve"]))


@pytest.mark.parametrize("kind, message, status", [
    (ErrorKind.STAGE_DIED, "boom", 503),
    (ErrorKind.STEP_TIMEOUT, "boom", 503),
    (ErrorKind.STAGE_ERROR, "stage_died: reads like a death, is not one", 500),
    (ErrorKind.ENGINE_DEAD, "engine stopped: 3 restarts within 600 s", 503),
    (ErrorKind.POISON_REQUEST, "poison_request: request 'r' was in flight at 2", 500),
    (None, "step_timeout: reads like a timeout, has no kind", 500),
])
def test_generation_errors_map_by_error_kind_not_message(kind, message, status):
    out = RequestOutput("r", "p", [1], finished=True, error=message, error_kind=kind)
    error = generation_failure(GenerationError(out))
    assert error.status == status
    assert ("retry" in error.message) == (kind is not None and kind.retryable)
    assert error.type == ("service_unavailable" if status == 503 else "internal_server_error")


def test_other_engine_failures_map_by_type():
    assert (generation_failure(EngineDeadError("stopped")).status,
            generation_failure(ValueError("prompt too long")).status,
            generation_failure(RuntimeError("stage_died: text only")).status) == (503, 400, 500)


def test_zy_16_streams_survive_two_stage_kills(served):
    """Kills stages of the shared engine twice (keep it just before the last test): 16
    greedy streams each see a pause, never an error; every streamed text equals the one
    the same server streamed without a fault (no token twice, none missing)."""
    import random

    rng = random.Random(31)
    prompts = [PROMPTS[i % 4] + " " * (i // 4) for i in range(16)]
    engine = served.engine.engine
    chunks: list[list[str]] = []

    async def stream_one(aclient: openai.AsyncOpenAI, i: int) -> str:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompts[i], stream=True, temperature=0, max_tokens=160,
            extra_body={"ignore_eos": True})
        async for c in stream:
            chunks[i].append(c.choices[0].text)
        return "".join(chunks[i])

    async def kill_twice() -> None:
        # at random moments: once every stream is going, again once every stream got text
        # after the first recovery
        for kill in range(2):
            marks = [len(c) for c in chunks]
            wait_for = rng.randint(2, 30)
            while not all(len(c) >= min(m + wait_for, 150) for c, m in zip(chunks, marks)):
                await asyncio.sleep(0.01)
            namespace = engine.executor.namespace
            stage = rng.randrange(2)
            ray.kill(ray.get_actor(f"raypp_worker_{stage}_0", namespace=namespace),
                     no_restart=True)
            while engine.restarts < restarts_before + kill + 1:
                await asyncio.sleep(0.05)

    async def run(with_kills: bool) -> list[str]:
        chunks[:] = [[] for _ in prompts]
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, timeout=300,
                                      max_retries=0) as aclient:
            streams = asyncio.gather(*[stream_one(aclient, i) for i in range(len(prompts))])
            if not with_kills:
                return await streams
            texts, _ = await asyncio.wait_for(asyncio.gather(streams, kill_twice()), 300)
            return texts

    reference = asyncio.run(run(with_kills=False))
    restarts_before = engine.restarts
    assert asyncio.run(run(with_kills=True)) == reference
    assert engine.restarts == restarts_before + 2
    _wait_idle(served.engine)
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200


def test_zz_health_turns_503_when_a_stage_dies(served):
    """Kills a stage of the shared engine: keep this test last in the module."""
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200
    namespace = served.engine.engine.executor.namespace
    ray.kill(ray.get_actor("raypp_worker_1_0", namespace=namespace), no_restart=True)
    deadline = time.monotonic() + 30
    codes = []
    while time.monotonic() < deadline:
        codes.append(httpx.get(served.url + "/health", timeout=30).status_code)
        if codes[-1] == 503:
            break
        time.sleep(0.2)
    assert codes[-1] == 503, codes
    r = httpx.get(served.url + "/health", timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
