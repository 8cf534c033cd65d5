"""The benchmarks run end to end on tiny sizes and write well-formed results.

These assert structure and sane values, never speed: the CI box is shared and noisy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raypp.bench.timeline import Timeline, timeline_paths, to_chrome_trace
from raypp.bench.workload import dataset_requests, synthetic_requests
from raypp.cli import build_parser

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.fixture(scope="module")
def bench_llm(ray_cluster, tiny_llama):
    """pp=2 engine on the tiny Llama with send/recv tracing on (as ``--timeline`` does)."""
    from raypp import LLM

    llm = LLM(str(tiny_llama), pipeline_parallel_size=2, max_model_len=128, trace_comm=True)
    yield llm
    llm.shutdown()


def test_hop_bench_writes_rows_for_every_transport(ray_cluster, tmp_path):
    from raypp.bench.hop import TRANSPORTS, hop_table, run_hop_bench

    out = tmp_path / "hop.json"
    args = _args("bench", "hop", "--steps", "10", "--warmup", "2", "--stages", "2",
                 "--sizes", "1,8", "--hidden", "64", "--json", str(out))
    result = run_hop_bench(args)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    combos = {(r["stages"], r["transport"], r["rows"]) for r in result["rows"]}
    assert combos == {(2, t, n) for t in TRANSPORTS for n in (1, 8)}
    for row in result["rows"]:
        assert row["steps"] == 10
        assert 0 < row["min_ms"] <= row["p50_ms"] <= row["p90_ms"] <= row["max_ms"]
        assert row["bytes"] == row["rows"] * 64 * 4
        assert set(row["cpu"]) == {"driver", "stage0", "stage1"}
        if row["transport"] == "raypp":  # our hooks saw the hop's send and recv
            assert row["send_p50_ms"] > 0 and row["recv_p50_ms"] > 0
        if row["transport"] == "shm":
            assert row["p50_vs_shm"] == 1.0
    assert [r["rows"] for r in result["gloo_raw"]] == [1, 8]
    assert all(r["one_way_p50_ms"] > 0 for r in result["gloo_raw"])
    assert "RayPPCommunicator (PP group)" in hop_table(result)


def test_throughput_json_and_timeline(bench_llm, tmp_path):
    from raypp.bench.runner import run_throughput

    args = _args("bench", "throughput", "--num-prompts", "6", "--input-len", "8",
                 "--output-len", "5", "--num-warmup", "1", "--no-progress",
                 "--json", str(tmp_path / "tp.json"), "--timeline", str(tmp_path / "tl"))
    result = run_throughput(args, llm=bench_llm)
    saved = json.loads((tmp_path / "tp.json").read_text())
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s",
                "num_requests", "pipeline_parallel_size", "max_inflight",
                "engine_overhead_share"):
        assert key in saved, key
    assert saved["num_requests"] == 6
    assert saved["num_output_tokens"] == 30 and saved["num_prompt_tokens"] == 48
    assert saved["pipeline_parallel_size"] == 2 and saved["max_inflight"] == 2
    assert saved["pp_transport"] == "RayPPCommunicator"
    assert saved["output_tokens_per_s"] == pytest.approx(30 / saved["elapsed_s"], rel=1e-3)
    assert 0 <= saved["engine_overhead_share"] <= 1
    assert saved["ttft_ms"]["n"] == 6 and saved["tpot_ms"]["n"] == 6
    assert len(saved["stage_busy_share"]) == 2
    assert all(0 < b <= 1 for b in saved["stage_busy_share"])
    occupancy = saved["stage_occupancy"]  # the stages' own counters over the run
    assert [w["stage"] for w in occupancy] == [0, 1]
    for w in occupancy:
        assert w["steps"] == result["engine_steps"] and 0 < w["busy"] <= 1
        assert w["busy"] + w["idle"] == pytest.approx(1, abs=1e-3) and w["bubble"] <= w["idle"]
        assert w["tokens_per_step"] >= 1

    trace = json.loads((tmp_path / "tl.json").read_text())
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"driver", "stage 0", "stage 1"}
    compute = [e for e in events if e.get("cat") == "compute"]
    steps = result["engine_steps"]
    for tid in (1, 2):  # every stage ran every micro-batch once, labelled by step id
        mine = [e for e in compute if e["tid"] == tid]
        assert len(mine) == steps
        assert all(e["args"]["step_id"] >= 0 and e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
    sends = [e for e in events if e.get("cat") == "comm.send"]
    recvs = [e for e in events if e.get("cat") == "comm.recv"]
    assert sends and all(e["tid"] == 1 for e in sends)  # stage 0 → stage 1 only
    assert recvs and all(e["tid"] == 2 for e in recvs)
    png = (tmp_path / "tl.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_throughput_with_a_shared_prefix_reports_cache_hits(bench_llm):
    """One request at a time after a warm-up (the cache is reset after it): the first
    computes the 48-token prefix (3 blocks of 16), the 5 others find it cached."""
    from raypp.bench.runner import run_throughput

    args = _args("bench", "throughput", "--num-prompts", "6", "--shared-prefix-len", "48",
                 "--input-len", "4", "--output-len", "3", "--concurrency", "1",
                 "--num-warmup", "2", "--no-progress")
    result = run_throughput(args, llm=bench_llm)
    assert result["enable_prefix_caching"] and result["shared_prefix_len"] == 48
    assert result["prefix_cache"] == {"queried_tokens": 6 * 52, "hit_tokens": 5 * 48,
                                      "hit_rate": round(240 / 312, 4)}
    assert set(result["ttft_ms"]) >= {"p50", "p99"}


def test_throughput_compare_hf_generates_raypp_greedy_tokens(bench_llm, tmp_path):
    """transformers' generate on the same prompts (lengths 3 to 11, so left padding) and
    output lengths (two, so two batches of at most 2) yields raypp's greedy ids exactly."""
    from raypp.bench.runner import run_throughput

    data = tmp_path / "d.jsonl"
    prompts = [[5 + k + j for j in range(n)] for k, n in enumerate((3, 11, 7, 5, 9))]
    data.write_text("".join(json.dumps({"prompt_token_ids": p, "output_len": 6 + 2 * (k % 2)})
                            + "\n" for k, p in enumerate(prompts)))
    args = _args("bench", "throughput", "--dataset", str(data), "--num-warmup", "1",
                 "--compare-hf", "--hf-batch-size", "2", "--no-progress",
                 "--json", str(tmp_path / "tp.json"), "--plot", str(tmp_path / "tp.png"))
    run_throughput(args, llm=bench_llm)
    saved = json.loads((tmp_path / "tp.json").read_text())
    hf = saved["transformers"]
    assert hf["cache"] == "dynamic" and hf["torch_compile"] is False  # CPU: auto = dynamic
    assert hf["batch_size"] == 2 and hf["num_output_tokens"] == saved["num_output_tokens"] == 34
    assert hf["tokens_match"] == {"requests": 5, "identical": 5, "first_difference": None}
    assert hf["output_tokens_per_s"] == pytest.approx(34 / hf["elapsed_s"], rel=1e-3)
    for key in ("output_tokens_per_s", "total_tokens_per_s"):
        row = saved["vs_transformers"][key]
        assert row["raypp"] == saved[key] and row["transformers"] == hf[key]
        assert row["ratio"] == pytest.approx(saved[key] / hf[key], rel=1e-3)
    assert saved["device"] == "cpu" and saved["plot"] == str(tmp_path / "tp.png")
    assert (tmp_path / "tp.png").read_bytes().startswith(PNG_MAGIC)

    args = _args("bench", "throughput", "--dataset", str(data), "--num-warmup", "0",
                 "--compare-hf", "--hf-cache", "static", "--no-progress")
    hf = run_throughput(args, llm=bench_llm)["transformers"]  # a fixed-size cache, one batch
    assert hf["cache"] == "static" and hf["batch_size"] == 5
    assert hf["tokens_match"]["identical"] == 5


def test_hf_baseline_batches_and_token_agreement():
    from raypp.bench.hf_baseline import _batches, resolve_cache, token_agreement
    from raypp.bench.workload import BenchRequest

    reqs = [BenchRequest([1], n) for n in (4, 8, 4, 4, 8)]
    assert _batches(reqs, 2) == [[0, 2], [3], [1, 4]]
    assert resolve_cache("auto", "cpu") == "dynamic" and resolve_cache("auto", "cuda") == "static"
    assert resolve_cache("static", "cpu") == "static"
    with pytest.raises(ValueError):
        resolve_cache("paged", "cpu")
    agree = token_agreement({0: [1, 2, 3], 1: [4, 5, 6]}, [[1, 2, 3], [4, 9, 6]])
    assert agree == {"requests": 2, "identical": 1, "first_difference":
                     {"request": 1, "position": 1, "raypp": 5, "transformers": 9}}


def test_latency_json_steps_and_plot(bench_llm, tmp_path):
    from raypp.bench.runner import run_latency

    args = _args("bench", "latency", "--num-prompts", "2", "--input-len", "6",
                 "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1",
                 "--num-warmup", "0", "--no-progress", "--json", str(tmp_path / "lat.json"),
                 "--plot", str(tmp_path / "lat.png"))
    run_latency(args, llm=bench_llm)
    saved = json.loads((tmp_path / "lat.json").read_text())
    assert saved["benchmark"] == "latency"
    assert saved["batch_size"] == 2 and saved["num_requests"] == 4
    assert saved["num_output_tokens"] == 16
    lat = saved["latency_s"]
    assert lat["n"] == 2 and 0 < lat["min"] <= lat["p50"] <= lat["max"]
    assert lat["max"] <= saved["elapsed_s"]

    steps = saved["steps"]
    assert {r["batch"] for r in steps} == {0, 1}
    read = [r for r in steps if r["kind"] != "idle"]  # every micro-batch is read once
    assert len(read) == saved["engine_steps"]
    for batch in (0, 1):
        mine = [r for r in steps if r["batch"] == batch]
        assert [r["index"] for r in mine] == list(range(len(mine)))
        assert mine[0]["kind"] == "prefill"  # the batch's first step reads its prompts
        # both prompts (12 tokens) computed once; 3 more tokens each decoded one at a time
        assert sum(r["tokens"] for r in mine if r["kind"] == "prefill") == 12
        assert sum(r["tokens"] for r in mine if r["kind"] == "decode") == 2 * 3
    for r in read:
        assert r["wall_ms"] > 0 and r["micro_batch_ms"] > 0
        assert (r["tokens"] > r["seqs"]) == (r["kind"] == "prefill")
    summary = saved["step_ms"]
    for kind in ("prefill", "decode"):
        wall = summary[kind]["wall_ms"]
        assert wall["n"] == sum(r["kind"] == kind for r in steps)
        assert wall["min"] <= wall["p50"] <= wall["p99"] <= wall["max"]
    assert (tmp_path / "lat.png").read_bytes().startswith(PNG_MAGIC)


def test_dataset_and_synthetic_requests(tmp_path, tiny_llama):
    from raypp.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_llama))
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "The list type", "output_len": 3}\n\n'
                    '{"prompt_token_ids": [5, 6, 7]}\n')
    reqs = dataset_requests(path, tok, default_output_len=9)
    assert [r.output_len for r in reqs] == [3, 9]
    assert reqs[0].prompt_token_ids == tok.encode("The list type")
    assert reqs[1].prompt_token_ids == [5, 6, 7]
    assert len(dataset_requests(path, tok, 9, num=1)) == 1
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="d.jsonl:1"):
        dataset_requests(path, tok, 9)

    synth = synthetic_requests(4, 10, 7, vocab_size=50, avoid={0, 1, 2}, seed=3)
    assert len(synth) == 4 and all(r.prompt_len == 10 and r.output_len == 7 for r in synth)
    assert all(3 <= t < 50 for r in synth for t in r.prompt_token_ids)
    params = synth[0].sampling_params()
    assert params.ignore_eos and params.max_tokens == 7
    assert synth == synthetic_requests(4, 10, 7, vocab_size=50, avoid={0, 1, 2}, seed=3)
    shared = synthetic_requests(4, 10, 7, vocab_size=50, avoid={0, 1, 2}, seed=3,
                                shared_prefix_len=20)
    assert all(r.prompt_len == 30 for r in shared)
    assert len({tuple(r.prompt_token_ids[:20]) for r in shared}) == 1
    assert len({tuple(r.prompt_token_ids[20:]) for r in shared}) == 4


def test_make_model_cli(tmp_path):
    from raypp.cli import main

    out = tmp_path / "m"
    assert main(["bench", "make-model", "--out", str(out), "--hidden", "64", "--layers", "2",
                 "--heads", "4", "--vocab", "300"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
    assert config["intermediate_size"] == 192  # 11/4 × 64 = 176, rounded up to 64
    assert config["num_key_value_heads"] == 4
    assert list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()


def test_chrome_trace_and_busy_shares_of_a_known_timeline():
    tl = Timeline(num_stages=2)
    tl.driver = [("submit", 0, 0.0, 0.1), ("wait", 0, 0.1, 4.0)]
    tl.compute = [(0, 0, 0.1, 1.1), (1, 0, 1.5, 3.5)]
    tl.comm = [(0, "send", 1, 1.1, 1.5, 64), (1, "recv", 0, 1.1, 1.5, 64)]
    tl.steps = {0: {"tokens": 8, "seqs": 2}}
    assert tl.busy_shares() == [0.25, 0.5]
    assert tl.comm_shares() == [0.1, 0.1]
    events = to_chrome_trace(tl)["traceEvents"]
    step = [e for e in events if e.get("cat") == "compute" and e["tid"] == 2][0]
    assert step["ts"] == pytest.approx(1.5e6) and step["dur"] == pytest.approx(2e6)
    assert step["args"] == {"step_id": 0, "tokens": 8, "seqs": 2}
    assert timeline_paths("x/run") == (Path("x/run.json"), Path("x/run.png"))
    assert timeline_paths("x/run.png") == (Path("x/run.json"), Path("x/run.png"))
