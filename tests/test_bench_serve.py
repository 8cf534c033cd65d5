"""``raypp bench serve`` against a real server: uvicorn on loopback, a real engine, real HTTP
streaming. Asserts structure and relations between the numbers, never speed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from raypp.bench.arrivals import parse_rates, poisson_offsets
from raypp.bench.serve_client import RequestResult
from raypp.bench.serve_metrics import summarize_run
from raypp.cli import build_parser

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def server_url(ray_cluster, tiny_llama):
    from raypp.engine.async_engine import AsyncLLMEngine
    from raypp.entrypoints.openai.app import ServerConfig, build_app
    from raypp.testing.server import ServerThread

    engine = AsyncLLMEngine.from_model(str(tiny_llama), max_model_len=128,
                                       kv_cache_memory_bytes=8 * 2**20)
    server = ServerThread(build_app(engine, ServerConfig(["tiny"], str(tiny_llama)))).start()
    yield server.url
    server.stop()
    engine.shutdown()


def _run(*argv: str) -> int:
    args = build_parser().parse_args(["bench", "serve", *argv])
    return args.func(args)


def test_request_rates_poisson_arrivals_slo_and_plot(server_url, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    # an SLO nobody meets: goodput must fall to 0 while every request succeeds
    assert _run("--url", server_url, "--request-rate", "40,inf", "-n", "6", "--seed", "7",
                "--max-tokens", str(MAX_TOKENS), "--warmup", "1", "--slo-ttft-ms", "0.001",
                "--no-progress", "--json", str(out), "--plot", str(png)) == 0
    saved = json.loads(out.read_text())
    assert saved["mode"] == "request-rate" and saved["requests"] == 12 and saved["failed"] == 0
    assert saved["slo"] == {"ttft_ms": 0.001, "tpot_ms": None}
    assert [r["request_rate"] for r in saved["runs"]] == [40.0, "inf"]
    for run in saved["runs"]:
        rate = math.inf if run["request_rate"] == "inf" else run["request_rate"]
        # the schedule is the seed's: numpy's exponential gaps, first request at 0
        assert run["arrival_offsets_s"] == pytest.approx(poisson_offsets(6, rate, seed=7), abs=1e-6)
        sent = [r["sent_s"] for r in run["per_request"]]
        assert all(s >= at - 1e-6 for s, at in zip(sent, run["arrival_offsets_s"], strict=True))
        for r in run["per_request"]:
            assert r["ok"] and r["tokens"] == MAX_TOKENS
            assert 0 < r["ttft_ms"] <= r["latency_ms"]
            # TPOT = the time after the first token over the tokens after the first
            assert r["ttft_ms"] + (MAX_TOKENS - 1) * r["tpot_ms"] == pytest.approx(r["latency_ms"],
                                                                                  abs=0.01)
            assert r["latency_ms"] <= 1e3 * run["duration_s"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
            assert run[key]["n"] > 0 and run[key]["p50"] <= run[key]["p99"], key
        assert run["ttft_ms"]["max"] <= run["latency_ms"]["max"]
        assert run["requests_per_s"] == pytest.approx(6 / run["duration_s"])
        assert run["output_tokens_per_s"] == pytest.approx(6 * MAX_TOKENS / run["duration_s"])
        assert run["good_requests"] == 0 and run["goodput_requests_per_s"] == 0.0
    assert saved["runs"][1]["arrival_offsets_s"] == [0.0] * 6
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_closed_loop_concurrency_still_works(server_url, tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    assert _run("--url", server_url, "-c", "2", "-n", "4", "--max-tokens", str(MAX_TOKENS),
                "--warmup", "0", "--endpoint", "chat", "--no-progress", "--json", str(out),
                "--plot", str(png)) == 0
    saved = json.loads(out.read_text())
    assert saved["mode"] == "concurrency" and saved["concurrency"] == 2
    assert saved["requests"] == 4 and saved["failed"] == 0
    # no SLO: goodput is every successful request
    assert saved["good_requests"] == 4
    assert saved["goodput_requests_per_s"] == saved["requests_per_s"] > 0
    assert saved["ttft_ms"]["n"] == 4 and saved["tpot_ms"]["n"] == 4
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_poisson_offsets_follow_the_seed():
    offsets = poisson_offsets(5, 2.0, seed=3)
    gaps = np.random.default_rng(3).exponential(0.5, size=4)
    assert offsets == pytest.approx([0.0, *np.cumsum(gaps)])
    assert poisson_offsets(5, 4.0, seed=3) == pytest.approx([t / 2 for t in offsets])
    assert poisson_offsets(5, 2.0, seed=4) != offsets
    assert poisson_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "x", "", "nan"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    # the mean gap approaches 1 / rate
    assert np.mean(np.diff(poisson_offsets(20_000, 10.0, seed=1))) == pytest.approx(0.1, rel=0.05)


def test_goodput_counts_requests_within_both_slos():
    def req(ttft: float, latency: float, tokens: int, ok: bool = True) -> RequestResult:
        return RequestResult(ok=ok, ttft_s=ttft, latency_s=latency, completion_tokens=tokens)

    results = [req(0.010, 0.050, 5),  # TPOT 10 ms
               req(0.030, 0.070, 5),  # TTFT over 20 ms
               req(0.010, 0.110, 5),  # TPOT 25 ms, over 20 ms
               req(0.015, 0.015, 1),  # one token: no TPOT, meets that bound
               req(0.0, 0.0, 0, ok=False)]
    run = summarize_run(results, duration=2.0, slo_ttft_ms=20, slo_tpot_ms=20)
    assert run["requests"] == 5 and run["failed"] == 1
    assert run["good_requests"] == 2 and run["goodput_requests_per_s"] == 1.0
    assert run["requests_per_s"] == 2.0 and run["output_tokens_per_s"] == 8.0
    assert run["tpot_ms"]["n"] == 3 and run["tpot_ms"]["min"] == pytest.approx(10.0)
    assert summarize_run(results, 2.0)["goodput_requests_per_s"] == 2.0  # no SLO
