"""Prefix caching on vs off, in one run: a shared-prefix workload (every prompt starts
with the same system prompt, then a question of its own) for TTFT and throughput, and
the same prompt lengths with nothing shared, for what caching costs when nothing hits.

    python -m benchmarks.prefix_caching --out DIR [--model DIR | --ckpt DIR] [--rounds 3]
        [--num-prompts 64 --shared-prefix-len 1024 --input-len 64 --output-len 64]
        [--engine-args "--device cuda --dtype bfloat16 ..."] [--budget-s 540]

Each (round, caching) section starts one engine and runs both workloads through
``raypp bench throughput`` (``raypp.bench.runner.run_throughput``: all requests queued
at once, a short warm-up, then the prefix cache is reset, so the timed run starts cold:
its first requests compute the shared prefix). Rounds alternate the engines (on, off,
off, on, on, off, …) so a noisy neighbour's load and any drift fall on both alike; the
summary takes each number's median over rounds. ``results["runs"]`` holds every run's
numbers and the ``raypp bench`` command that reproduces it alone. Without ``--model``,
the Llama-3.2-1B-shaped random bf16 checkpoint of :mod:`benchmarks.gpu.decode_workload`
is used from ``--ckpt``, written there first if missing (on the GPU). A section is
skipped when the time left is less than the longest one so far. The ``driver`` section
(:mod:`benchmarks.prefix_caching_driver`) times the driver's work alone for the
nothing-shared workload, caching on vs off.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness import Run, add_run_args, log, machine_info, software_versions
from benchmarks.prefix_caching_driver import driver_cost

_KEPT = ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
         "engine_steps", "mean_step_ms", "engine_overhead_ms_per_step", "ttft_ms", "tpot_ms",
         "stage_compute_ms", "prefix_cache", "cpu", "load_avg_at_start")


def _workloads(a: argparse.Namespace) -> dict[str, list[str]]:
    """``raypp bench throughput`` workload options: shared prefix, and nothing shared
    (the same prompt lengths)."""
    common = ["--num-prompts", str(a.num_prompts), "--output-len", str(a.output_len),
              "--seed", str(a.seed), "--no-progress"]
    return {
        "shared": [*common, "--shared-prefix-len", str(a.shared_prefix_len),
                   "--input-len", str(a.input_len)],
        "no_shared": [*common, "--input-len", str(a.shared_prefix_len + a.input_len)],
    }


def _bench_args(argv: list[str]) -> argparse.Namespace:
    from raypp.cli import build_parser

    return build_parser().parse_args(["bench", "throughput", *argv])


def _section(run: Run, a: argparse.Namespace, model: str, caching: bool) -> None:
    from raypp.bench.runner import make_llm, run_throughput

    switch = [] if caching else ["--no-enable-prefix-caching"]
    engine = ["--model", model, *shlex.split(a.engine_args), *switch]
    llm = None
    try:
        for workload, options in _workloads(a).items():
            argv = [*engine, *options]
            args = _bench_args(argv)
            llm = llm or make_llm(args)
            result = run_throughput(args, llm=llm)
            kept = {k: result[k] for k in _KEPT}
            kept["command"] = "raypp bench throughput " + shlex.join(argv)
            run.results["runs"].setdefault(f"{workload}/{'on' if caching else 'off'}",
                                           []).append(kept)
            log(f"{workload} caching={'on' if caching else 'off'}: TTFT p50 "
                f"{kept['ttft_ms']['p50']:.1f} ms, {kept['output_tokens_per_s']:.1f} out tok/s")
    finally:
        if llm is not None:
            llm.shutdown()


def _median(runs: list[dict[str, Any]], *path: str) -> float:
    values = []
    for r in runs:
        for key in path:
            r = r[key]
        values.append(float(r))
    return statistics.median(values)


def summary(results: dict[str, Any]) -> str:
    """The markdown table of medians over rounds, and the two ratios the issue targets."""
    runs = results.get("runs", {})
    lines = ["| workload | caching | runs | TTFT p50 ms | TTFT p99 ms | output tok/s | "
             "total tok/s | prompt tokens cached |", "|---|---|---|---|---|---|---|---|"]
    for key in ("shared/on", "shared/off", "no_shared/on", "no_shared/off"):
        if key not in runs:
            continue
        rs = runs[key]
        workload, caching = key.split("/")
        lines.append(
            f"| {workload} | {caching} | {len(rs)} | {_median(rs, 'ttft_ms', 'p50'):.1f} | "
            f"{_median(rs, 'ttft_ms', 'p99'):.1f} | {_median(rs, 'output_tokens_per_s'):.1f} | "
            f"{_median(rs, 'total_tokens_per_s'):.1f} | "
            f"{100 * _median(rs, 'prefix_cache', 'hit_rate'):.1f} % |")
    lines.append("")
    if "shared/on" in runs and "shared/off" in runs:
        on, off = runs["shared/on"], runs["shared/off"]
        ttft = _median(off, "ttft_ms", "p50") / _median(on, "ttft_ms", "p50")
        speed = _median(on, "output_tokens_per_s") / _median(off, "output_tokens_per_s")
        lines.append(f"- shared prefix: TTFT p50 {ttft:.2f}× lower with caching on; "
                     f"throughput {speed:.2f}× caching off's")
    if "no_shared/on" in runs and "no_shared/off" in runs:
        on, off = runs["no_shared/on"], runs["no_shared/off"]
        ratio = _median(on, "output_tokens_per_s") / _median(off, "output_tokens_per_s")
        pairs = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(on, off)]
        lines.append(f"- nothing shared (0 % hits): throughput with caching on = {ratio:.3f}× "
                     f"caching off's (round by round: {', '.join(f'{p:.3f}' for p in pairs)}); "
                     f"the driver's own time per engine step "
                     f"{_median(on, 'engine_overhead_ms_per_step'):.3f} ms on vs "
                     f"{_median(off, 'engine_overhead_ms_per_step'):.3f} ms off, of "
                     f"{_median(off, 'mean_step_ms'):.1f} ms per step")
    driver = results.get("driver")
    if driver:
        on, off = driver["on"], driver["off"]
        lines.append(f"- the driver alone, nothing shared (no model, median of {driver['repeats']} "
                     f"runs): {on['prefill_us_per_step']:.0f} vs {off['prefill_us_per_step']:.0f} µs "
                     f"per prefill step, {on['decode_us_per_step']:.0f} vs "
                     f"{off['decode_us_per_step']:.0f} µs per decode step, "
                     f"{on['us_per_request'] - off['us_per_request']:.0f} µs more per request "
                     "with caching on")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(parser, out_default=None, budget_s=540.0)
    parser.add_argument("--model", default=None, help="model directory (default: --ckpt)")
    parser.add_argument("--ckpt", default="/tmp/raypp_prefix_caching_llama1b",
                        help="the 1B random-weight checkpoint, written here if missing (CUDA)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="on/off engine pairs, in the order on-off, off-on, on-off, ...")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--shared-prefix-len", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=64, help="each prompt's own tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-args", default="", help="more `raypp bench throughput` engine "
                        'options, one string, e.g. "--device cuda --dtype bfloat16 -pp 2"')
    a = parser.parse_args()
    out = Path(a.out)
    model = a.model or a.ckpt
    if a.model is None and not (Path(model) / "config.json").is_file():
        from benchmarks.gpu.decode_workload import make_checkpoint

        log(f"writing the checkpoint {model}")
        make_checkpoint(Path(model))
    device = "cuda" if "cuda" in a.engine_args else "cpu"
    results: dict[str, Any] = {"argv": vars(a), "model": model, "runs": {},
                               "software": software_versions(), "machine": machine_info(device)}
    run = Run(out, a.budget_s, results, summaries={"summary.md": summary})
    run.section("driver", lambda: results.update(driver=driver_cost(
        a.num_prompts, a.shared_prefix_len + a.input_len, a.output_len)))
    for r in range(a.rounds):
        for caching in ((True, False) if r % 2 == 0 else (False, True)):
            need = max(run.results["timings_s"].values(), default=0.0)
            run.section(f"round{r}-{'on' if caching else 'off'}",
                        lambda caching=caching: _section(run, a, model, caching), need_s=need)
    print(summary(results))


if __name__ == "__main__":
    main()
