"""Structured outputs, tool calling, logit bias and the utility endpoints through the
OpenAI server: real uvicorn on loopback, real engines, the official ``openai`` client.

The checkpoint is a tiny Qwen2 whose tokenizer carries a Hermes/Qwen-style chat
template that renders tools, tool calls and tool results. Its weights are random, so
schemas keep every value bounded and the grammar ends each reply.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass

import httpx
import jsonschema
import openai
import pytest

from raypp.engine.async_engine import AsyncLLMEngine
from raypp.entrypoints.openai.app import ServerConfig, build_app
from raypp.entrypoints.openai.tool_parsers import parser_for
from raypp.testing.server import ServerThread

MODEL = "tiny-tools"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "units": {"type": "array", "items": {"enum": ["C", "F"]}, "maxItems": 2},
        "where": {"type": "object", "properties": {"coast": {"type": "boolean"},
                                                    "code": {"type": "string",
                                                             "pattern": "^[A-Z]{2,3}$"}},
                  "required": ["coast", "code"]},
    },
    "required": ["city", "days", "units", "where"],
}
TIME_ARGS = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_ARGS}},
]
ASK = [{"role": "user", "content": "What is the weather?"}]
FMT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    from raypp.testing.tiny_model import TOOL_CHAT_TEMPLATE, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_tools"), architecture="qwen2",
                           seed=1, tie_word_embeddings=True, max_position_embeddings=2048,
                           chat_template=TOOL_CHAT_TEMPLATE)


@dataclass
class Served:
    url: str
    engine: AsyncLLMEngine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=120,
                             max_retries=0)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120)


def _serve(model, **engine_kwargs):
    engine = AsyncLLMEngine.from_model(str(model), kv_cache_memory_bytes=16 * 2**20,
                                       **engine_kwargs)
    server = ServerThread(build_app(engine, ServerConfig([MODEL], str(model)))).start()
    return server, engine


@pytest.fixture(scope="module")
def served(ray_cluster, tools_model):
    server, engine = _serve(tools_model, pipeline_parallel_size=2)
    yield Served(server.url, engine)
    server.stop()
    engine.shutdown()


def _check_weather(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


# -- structured outputs ------------------------------------------------------------------------
@pytest.mark.parametrize(("pp", "plane"), [(1, "cgraph"), (1, "direct"), (2, "direct")])
def test_json_schema_outputs_validate_on_every_layout(ray_cluster, tools_model, pp, plane):
    server, engine = _serve(tools_model, pipeline_parallel_size=pp, control_plane=plane)
    try:
        _json_schema_round(Served(server.url, engine))
    finally:
        server.stop()
        engine.shutdown()


def test_json_schema_outputs_validate(served):  # pp 2, compiled graph
    _json_schema_round(served)


def _json_schema_round(served: Served) -> None:
    client = served.client()
    for temperature, seed in ((0, None), (1.0, 7), (0.7, 8)):
        r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=FMT,
                                           max_tokens=200, temperature=temperature, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        _check_weather(r.choices[0].message.content)
    r = client.completions.create(model=MODEL, prompt="Weather:", max_tokens=200, n=2, seed=3,
                                  temperature=1.0, extra_body={"structured_outputs": {"json": SCHEMA}})
    for choice in r.choices:
        _check_weather(choice.text)


def test_choice_regex_and_json_object(served):
    client = served.client()
    choices = ["red wine", "blue", "green tea"]
    for t in (0, 1.0):
        r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=t, seed=5,
                                           max_tokens=20, extra_body={"guided_choice": choices})
        assert r.choices[0].message.content in choices
    regex = r"[A-Z][a-z]{2,5} \d{2}"
    r = client.completions.create(model=MODEL, prompt="Name:", temperature=1.0, seed=2,
                                  max_tokens=30, extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                       extra_body={"structured_outputs": {"grammar":
                                                   'root ::= "yes" | "no" | "n/a"'}})
    assert r.choices[0].message.content in ("yes", "no", "n/a")
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still an object's beginning
        assert text.startswith("{")


def test_constrained_and_unconstrained_requests_interleave_without_effect(served):
    prompts = ["The list type", "A function", "Import this", "x = [1, 2"]

    async def run(with_constrained: bool) -> list[str]:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none",
                                      max_retries=0, timeout=120) as client:
            free = [client.completions.create(model=MODEL, prompt=p, max_tokens=16,
                                              temperature=0, extra_body={"ignore_eos": True})
                    for p in prompts]
            forced = [client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200,
                                                     temperature=t, seed=1, response_format=FMT)
                      for t in (0, 1.0, 0.5)] if with_constrained else []
            results = await asyncio.gather(*free, *forced)
        for r in results[len(prompts):]:
            _check_weather(r.choices[0].message.content)
        return [r.choices[0].text for r in results[:len(prompts)]]

    assert asyncio.run(run(True)) == asyncio.run(run(False))


def test_logprobs_come_from_the_constrained_distribution(served):
    r = served.client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, temperature=1.0, seed=4, logprobs=True,
        top_logprobs=5, extra_body={"guided_regex": "[ab]{8}"})
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for token in content:
        assert token.logprob > -9999
        for alt in token.top_logprobs:  # masked tokens have probability 0: listed at -9999
            assert set(alt.token) <= {"a", "b"} or alt.logprob == -9999.0


# -- tool calling -------------------------------------------------------------------------------
def _call_args(call, schema: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def test_required_and_named_tool_choice_give_valid_calls(served):
    client = served.client()
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    _call_args(call, SCHEMA if call.function.name == "get_weather" else TIME_ARGS)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0,
                                       seed=3, max_tokens=200,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "get_weather"}})
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _call_args(call, SCHEMA)


def test_tool_result_renders_and_the_next_turn_answers(served):
    client = served.client()
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                           tool_choice={"type": "function",
                                                        "function": {"name": "get_time"}},
                                           max_tokens=50)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "It is 12:00."},
    ]
    rendered = served.post("/tokenize", {"messages": history, "tools": TOOLS})
    assert rendered.status_code == 200, rendered.text
    text = served.engine.tokenizer.decode(rendered.json()["tokens"])
    assert "<tool_response>\nIt is 12:00.\n</tool_response>" in text
    assert f'"name": "get_time", "arguments": {call.function.arguments}' in text
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                            tool_choice="none", temperature=0, max_tokens=8)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble_into_the_same_call(served, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                  parallel_tool_calls=False, max_tokens=200)
    client = served.client()
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"] for c in calls.values())


def test_auto_parses_the_models_own_tool_call_format(served):
    """``auto`` parses free output; a regex makes this random model write a Hermes call."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    regex = "Sure[.] " + re.escape(call)
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
                  extra_body={"guided_regex": regex})
    client = served.client()
    r = client.chat.completions.create(**kwargs)
    message = r.choices[0].message
    assert message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"tz": "CET"})]
    assert r.choices[0].finish_reason == "tool_calls"
    content, names = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            names += [d.function.name for d in choice.delta.tool_calls or []]
    assert content.strip() == "Sure." and names == ["get_time"]


@pytest.mark.parametrize(("name", "text", "content", "calls"), [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Let me check.",
     [("f", {"x": 1}), ("g", {})]),
    ("hermes", "no call here", "no call here", []),
    ("hermes", '<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
    ("llama3_json", '{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}',
     None, [("f", {"x": "y"}), ("g", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": [1]}}', None,
     [("f", {"a": [1]})]),
    ("llama3_json", "The answer is {1, 2}", "The answer is {1, 2}", []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 2}}, {"name": "g", '
     '"arguments": {"y": true}}]', None, [("f", {"x": 2}), ("g", {"y": True})]),
    ("mistral", 'Ok [TOOL_CALLS]f[ARGS]{"x": 3}[TOOL_CALLS]g[CALL_ID]abc123[ARGS]{}', "Ok",
     [("f", {"x": 3}), ("g", {})]),
])
def test_tool_call_parsers(name, text, content, calls):
    got_content, got = parser_for(name, None).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_tool_call_parser_follows_the_model_family():
    assert parser_for(None, "qwen2").name == "hermes"
    assert parser_for(None, "llama").name == "llama3_json"
    assert parser_for(None, "mistral").name == "mistral"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parser_for("nope", None)


# -- logit bias, usage, fields ------------------------------------------------------------------
def test_logit_bias_in_both_apis(served):
    client = served.client()
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0,
                                  logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    tok = served.engine.tokenizer
    assert r.choices[0].text == tok.decode([77] * 5)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0,
                                       logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == tok.decode([77] * 5)


def test_stream_usage_every_chunk_and_at_the_end(served):
    chunks = list(served.client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 6


def test_documented_and_unknown_fields_are_accepted(served, caplog):
    client = served.client()
    with caplog.at_level(logging.DEBUG, logger="raypp.entrypoints.openai.serving"):
        for _ in range(2):
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "developer", "content": "Be brief."},
                                       {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                max_tokens=3, store=True, metadata={"k": "v"}, service_tier="auto", user="u",
                parallel_tool_calls=True, prediction={"type": "content", "content": "x"},
                prompt_cache_key="k", safety_identifier="s", reasoning_effort="low",
                verbosity="low", modalities=["text"], extra_body={"made_up_field": 1})
            assert r.choices[0].message.content is not None
        r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, user="u", best_of=2,
                                      extra_body={"another_made_up": {"a": 1}})
        assert len(r.choices) == 1
    logged = [rec.getMessage() for rec in caplog.records if "unknown request field" in rec.getMessage()]
    assert sum("made_up_field" in m for m in logged) == 1  # once per field name
    assert any("another_made_up" in m for m in logged)


BAD = [
    ("invalid schema", "/v1/chat/completions",
     {"messages": ASK, "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ("unsupported regex", "/v1/completions", {"prompt": "x", "guided_regex": "(?<=a)b"},
     "guided_regex", "Lookbehind"),
    ("bad EBNF", "/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= "}},
     "structured_outputs", "EBNF"),
    ("missing tool", "/v1/chat/completions",
     {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ("required without tools", "/v1/chat/completions", {"messages": ASK, "tool_choice": "required"},
     "tool_choice", "needs tools"),
    ("bad tool schema", "/v1/chat/completions",
     {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters":
                                                                   {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools", "objectx"),
    ("logit_bias id out of range", "/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}},
     "logit_bias", "999999"),
    ("logit_bias value", "/v1/chat/completions", {"messages": ASK, "logit_bias": {"5": 500}},
     "logit_bias", "100"),
    ("two grammars", "/v1/chat/completions",
     {"messages": ASK, "response_format": {"type": "json_object"}, "guided_regex": "a"},
     "guided_regex", "one structured-output field"),
    ("audio", "/v1/chat/completions", {"messages": ASK, "audio": {"voice": "x", "format": "wav"}},
     "audio", "audio"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "suffix"),
    ("best_of < n", "/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of", "best_of"),
    ("image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages", "image_url"),
]


@pytest.mark.parametrize(("case", "path", "body", "param", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_problem(served, case, path, body, param, words):
    r = served.post(path, {"model": MODEL, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    ok = served.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                                 response_format=FMT, temperature=0)
    assert ok.choices[0].message.content


# -- endpoints ----------------------------------------------------------------------------------
def test_utility_endpoints(served):
    tok = served.engine.tokenizer
    r = served.post("/tokenize", {"model": MODEL, "prompt": "The list type"})
    assert r.json() == {"count": len(tok.encode("The list type")), "max_model_len": 2048,
                        "tokens": tok.encode("The list type")}
    r = served.post("/detokenize", {"model": MODEL, "tokens": tok.encode("The list type")})
    assert r.json() == {"prompt": "The list type"}
    assert served.post("/detokenize", {"tokens": [10**7]}).status_code == 400
    assert served.post("/tokenize", {"prompt": "x", "model": "other"}).status_code == 404
    import raypp

    assert httpx.get(served.url + "/version").json() == {"version": raypp.__version__}
    schema = httpx.get(served.url + "/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert "response_format" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert httpx.get(served.url + "/docs").status_code == 200
    models = served.client().models.list().data
    assert [(m.id, m.max_model_len) for m in models] == [(MODEL, 2048)]
