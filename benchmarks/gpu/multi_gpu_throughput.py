"""The suites' bf16 engines: start-up state, the bf16 check against (1, 1), and
``raypp bench throughput``'s runner on each layout (one of them with a timeline)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.multi_gpu_checks import compare, generate_check
from benchmarks.gpu.multi_gpu_comms import comm_report
from benchmarks.gpu.multi_gpu_engines import make_llm, shutdown
from benchmarks.gpu.multi_gpu_models import check_prompts
from benchmarks.gpu.multi_gpu_suites import REFERENCE, Layout, SuiteRun
from benchmarks.harness import log


def engine_bench(run: SuiteRun, model: Path, layout: Layout, timeline: bool,
                 refs: dict[str, Any]) -> None:
    """One bf16 engine: start-up state, bf16 check against (1, 1), throughput, state after.

    Fills ``run.results["engines"][layout.name]`` as it goes (partial results survive
    an error); the reference layout's check output goes to ``refs["bf16"]``.
    """
    from raypp.bench.runner import run_throughput
    from raypp.cli import build_parser

    work, args = run.work, run.args
    info: dict[str, Any] = {"layout": layout.name, "tp": layout.tp, "pp": layout.pp,
                            "dtype": args.dtype}
    run.results["engines"][layout.name] = info
    started = time.perf_counter()
    llm = make_llm(args, work, model, layout, args.dtype, trace_comm=timeline)
    try:
        info["startup_s"] = round(time.perf_counter() - started, 1)
        info["num_kv_blocks"] = llm.engine.executor.num_kv_blocks
        info["communicators"] = [comm_report(llm, args.device, "after start-up")]
        prompts = check_prompts(work, llm.engine.config.model.vocab_size)
        out = generate_check(llm, prompts, work.check_tokens)
        info["check_tokens"] = out["tokens"]
        if layout == REFERENCE:
            refs["bf16"] = out
        elif "bf16" in refs:
            info["vs_reference"] = compare(refs["bf16"], out, exact=False)
        argv = ["bench", "throughput", "--num-prompts", str(work.num_prompts),
                "--input-len", str(work.input_len), "--output-len", str(work.output_len),
                "--num-warmup", "2", "--no-progress"]
        if timeline:
            argv += ["--timeline", str(run.out / f"timeline_{layout.name}")]
        tp = run_throughput(build_parser().parse_args(argv), llm=llm)
        tp.pop("context", None)
        tp["stage_bound"] = stage_bound(tp)
        info["throughput"] = tp
        info["communicators"].append(comm_report(llm, args.device, "after the benchmark"))
        log(f"   {layout.name}: {tp['output_tokens_per_s']:.1f} output tok/s, "
            f"{tp['mean_step_ms']:.2f} ms/step, start-up {info['startup_s']} s, "
            f"vs (1,1): {info.get('vs_reference', {}).get('ok', '-')}")
    finally:
        shutdown(llm)


def stage_bound(tp: dict[str, Any]) -> dict[str, Any]:
    """Throughput if the slowest stage never idled: steps × its mean micro-batch time."""
    means = [s["mean"] for s in tp.get("stage_compute_ms", [])]
    if not means or not tp.get("engine_steps"):
        return {}
    ideal_s = tp["engine_steps"] * max(means) / 1e3
    ideal = tp["num_output_tokens"] / ideal_s if ideal_s > 0 else float("nan")
    return {"ideal_output_tokens_per_s": round(ideal, 2),
            "share_of_ideal": round(tp["output_tokens_per_s"] / ideal, 4) if ideal else None,
            "slowest_stage_mean_ms": max(means)}


def bench_engines(run: SuiteRun, model: Path, layouts: list[Layout], timeline: Layout) -> None:
    """:func:`engine_bench` of each layout, one section each (``timeline``'s records one)."""
    refs: dict[str, Any] = {}
    need = 60 if run.args.device == "cuda" else 10
    for layout in layouts:
        run.section(f"engine {layout.name}",
                    lambda layout=layout: engine_bench(run, model, layout, layout == timeline,
                                                       refs), need_s=need)
