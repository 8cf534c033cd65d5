"""CPU dry run of ``benchmarks.gpu.multi_gpu`` (the lab script for the 2- and 4-GPU issues).

Real Ray, real gloo groups, the tiny Llama: the suites' sections run trimmed with
``--only``, write well-formed results, and their correctness checks pass. Speed is
never asserted (the box is shared and noisy).
"""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu.multi_gpu import build_arg_parser, run_suite
from benchmarks.gpu.multi_gpu_checks import compare
from benchmarks.gpu.multi_gpu_comms import nccl_inits
from benchmarks.gpu.multi_gpu_suites import REFERENCE, Layout

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WRAPPED, NATIVE = Layout(1, 2, True).name, Layout(1, 2, False).name


def _run(tmp_path, tiny_llama, suite: str, only: str) -> dict:
    args = build_arg_parser().parse_args([
        "--suite", suite, "--device", "cpu", "--out", str(tmp_path), "--model", str(tiny_llama),
        "--check-model", str(tiny_llama), "--only", only, "--budget-s", "300",
        "--hop-steps", "8"])
    results = run_suite(args)
    assert json.loads((tmp_path / "results.json").read_text())["targets"] == json.loads(
        json.dumps(results["targets"]))
    assert "CPU dry run" in (tmp_path / "summary.md").read_text()
    assert results["errors"] == {}, results["errors"]
    for target, measured, met in results["targets"]:
        assert isinstance(target, str) and isinstance(measured, str) and met in (True, False, None)
    return results


def _last_report(entry: dict) -> dict:
    report = entry["communicators"][-1]
    assert report["when"] in ("after generation", "after the benchmark")
    return report


@pytest.fixture(scope="module")
def pp2(ray_cluster, tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2")
    only = f"fp32,hop,engine {WRAPPED}"  # the bf16 (1,1) engine is left out: time
    return out, _run(out, tiny_llama, "pp2", only)


def test_pp2_fp32_equals_pp1_wrapped_and_native(pp2):
    _, r = pp2
    corr = r["correctness"]
    assert set(corr) == {f"fp32/{REFERENCE.name}", f"fp32/{WRAPPED}", f"fp32/{NATIVE}"}
    ref = corr[f"fp32/{REFERENCE.name}"]["tokens"]
    assert len(ref) == 3 and all(len(t) == 6 for t in ref)
    for name in (WRAPPED, NATIVE):
        c = corr[f"fp32/{name}"]
        assert c["vs_reference"]["equal"] and c["vs_reference"]["ok"]
        assert c["tokens"] == ref


def test_pp2_communicators_per_process(pp2):
    _, r = pp2
    wrapped = _last_report(r["correctness"][f"fp32/{WRAPPED}"])
    native = _last_report(r["correctness"][f"fp32/{NATIVE}"])
    assert wrapped["graph"] == {"custom": ["RayPPCommunicator"], "ray_created": []}
    assert native["graph"] == {"custom": [], "ray_created": []}  # Ray's shm channel on CPU
    assert [w["channel_communicators"] for w in wrapped["workers"]] == [["RayPPCommunicator"]] * 2
    assert [w["channel_communicators"] for w in native["workers"]] == [[], []]
    # the flag changes no process group: the same gloo groups in every worker
    assert wrapped["gloo_groups_per_worker"] == native["gloo_groups_per_worker"]
    assert len(set(wrapped["gloo_groups_per_worker"])) == 1
    assert len({w["pid"] for w in wrapped["workers"]}) == 2
    assert all(w["memory"]["rss_gib"] > 0 for w in wrapped["workers"])


def test_pp2_hop_rows_for_every_transport(pp2):
    _, r = pp2
    hop = r["hop"]
    assert hop["errors"] == {}
    sizes = {"1", "64", "512"}
    assert set(hop["rows"]) == {"wrapped", "native", "raw", "one_stage"}
    for label in ("wrapped", "native", "one_stage"):
        assert set(hop["rows"][label]) == sizes
        for row in hop["rows"][label].values():
            assert 0 < row["step"]["p50_ms"] <= row["step"]["p90_ms"]
            assert row["step"]["n"] == hop["steps"]
    for row in hop["rows"]["wrapped"].values():  # our send/recv hooks saw the hop
        assert row["send"]["n"] == row["recv"]["n"] == hop["steps"]
    assert all(r["one_way"]["p50_ms"] > 0 for r in hop["rows"]["raw"].values())
    assert set(hop["derived"]) == sizes
    assert all("wrapped_over_raw_us" in d and "wrapped_le_native" in d
               for d in hop["derived"].values())


def test_pp2_bf16_engine_and_throughput(pp2):
    out, r = pp2
    engines = r["engines"]
    assert set(engines) == {Layout(1, 2, True, 2).name}
    wrapped = engines[Layout(1, 2, True, 2).name]
    assert len(wrapped["check_tokens"]) == 3
    assert wrapped["communicators"][0]["when"] == "after start-up"
    tp = wrapped["throughput"]
    assert tp["pipeline_parallel_size"] == 2 and tp["max_inflight"] == 2
    assert tp["num_output_tokens"] == 8 * 8 and tp["output_tokens_per_s"] > 0
    assert tp["pp_transport"] == "RayPPCommunicator"
    assert tp["stage_bound"]["share_of_ideal"] > 0
    png = out / f"timeline_{Layout(1, 2, True, 2).name}.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["results.json", "summary.md", png.name, png.with_suffix(".json").name])
    assert any("not selected" in s for s in r["skipped"])  # --only left the rest out


def test_summary_of_a_partial_cuda_shaped_run(pp2):
    """The CUDA-only fields (NCCL counts, GPU memory) and an engine that died at start-up
    still give targets and a summary."""
    import copy

    from benchmarks.gpu.multi_gpu_summary import summary_markdown, targets

    r = copy.deepcopy(pp2[1])
    r["device"], r["kind"] = "cuda", "GPU run"
    wrapped = r["engines"][WRAPPED]
    for report in wrapped["communicators"]:
        report["nccl_comms_per_worker"] = [2, 2]
        for w in report["workers"]:
            w["memory"] = {"gpu_used_gib": 70.1}
    native = copy.deepcopy(wrapped)
    native["layout"] = NATIVE
    for report in native["communicators"]:
        report["nccl_comms_per_worker"] = [3, 3]
    r["engines"][NATIVE] = native
    r["engines"]["tp1pp2_native_inflight1"] = {"layout": "tp1pp2_native_inflight1", "tp": 1,
                                               "pp": 2, "dtype": "bfloat16"}
    rows = {t: (m, ok) for t, m, ok in targets(r)}
    assert rows["wrapped: fewer NCCL communicators than native"] == ("4 vs 6", True)
    assert rows["wrapped: no more GPU memory after start-up"] == ("70.1 vs 70.1 GiB", True)
    text = summary_markdown(r)
    assert text.startswith("# raypp multi-GPU suite `pp2` — GPU run")
    assert "CPU dry run" not in text


def test_tp2pp2_equals_tp1pp1(pp2, tiny_llama, tmp_path):
    # (1,1) ran in the pp2 suite on the same checkpoint and prompts: not started again
    reference = pp2[1]["correctness"][f"fp32/{REFERENCE.name}"]["tokens"]
    r = _run(tmp_path, tiny_llama, "tp2pp2", "fp32 tp2pp2")
    c = r["correctness"][f"fp32/{Layout(2, 2).name}"]
    assert c["tokens"] == reference
    report = _last_report(c)
    assert report["graph"] == {"custom": ["RayPPCommunicator"] * 2, "ray_created": []}
    assert sorted((w["pp_rank"], w["tp_rank"]) for w in report["workers"]) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(w["channel_communicators"] == ["RayPPCommunicator"] for w in report["workers"])


def test_nccl_init_lines_are_counted_per_pid(tmp_path):
    lines = [
        "h1:101:150 [0] NCCL INFO comm 0x55a1 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 "
        "commId 0xabc - Init COMPLETE",
        "h1:101:150 [0] NCCL INFO ncclCommInitRankConfig comm 0x55b2 rank 1 nRanks 2 cudaDev 0 "
        "nvmlDev 0 busId 18000 commId 0xdef - Init COMPLETE",
        "h1:101:150 [0] NCCL INFO comm 0x55a1 rank 0 nRanks 2 nNodes 1 localRanks 2",
        "h1:202:250 [0] NCCL INFO comm 0x77c3 rank 1 nranks 2 cudaDev 0 nvmlDev 1 busId 19000 "
        "commId 0xabc - Init COMPLETE",
        "h1:303:350 [0] NCCL INFO comm 0x88d4 rank 0 nranks 2 commId 0x1 - Init COMPLETE",
    ]
    (tmp_path / "worker-aa-01000000-101.out").write_text("\n".join(lines[:3]) + "\n")
    (tmp_path / "worker-bb-01000000-202.err").write_text(lines[3] + "\nnoise\n")
    (tmp_path / "worker-cc-01000000-303.log").write_text(lines[4] + "\n")  # not a log we read
    got = nccl_inits([101, 202, 303], tmp_path)
    assert [c["comm_id"] for c in got["101"]] == ["0xabc", "0xdef"]
    assert got["101"][1] == {"comm": "0x55b2", "rank": 1, "nranks": 2, "comm_id": "0xdef"}
    assert got["202"] == [{"comm": "0x77c3", "rank": 1, "nranks": 2, "comm_id": "0xabc"}]
    assert got["303"] == []


def test_compare_accepts_near_ties_only():
    ref = {"tokens": [[5, 6, 7]], "logprobs": [[{5: -0.1, 9: -2.0}, {6: -0.70, 8: -0.75},
                                                {7: -0.2}]]}
    tie = {"tokens": [[5, 8, 3]], "logprobs": [[{5: -0.12, 9: -2.01}, {8: -0.7, 6: -0.72},
                                                {3: -0.1}]]}
    far = {"tokens": [[9, 6, 7]], "logprobs": [[{9: -0.1, 5: -0.2}, {6: -0.1}, {7: -0.1}]]}
    assert compare(ref, ref, exact=True) == {
        "equal": True, "ok": True, "first_diff": [None], "max_abs_logprob_diff": 0.0,
        "tie_gaps": [], "tolerance": None}
    near = compare(ref, tie, exact=False)
    assert near["ok"] and not near["equal"] and near["first_diff"] == [1]
    assert near["tie_gaps"] == [0.05] and near["max_abs_logprob_diff"] == pytest.approx(0.02)
    assert not compare(ref, tie, exact=True)["ok"]
    assert not compare(ref, far, exact=False)["ok"]  # 1.9 nats apart is no tie
