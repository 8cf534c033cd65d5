"""The result dictionaries of ``raypp bench throughput`` and ``latency``, and their printout.

Times in keys ending ``_ms`` are milliseconds, ``_s`` seconds; a ``*_ms`` summary is
:func:`raypp.bench.report.summarize` (``n``, ``mean``, ``p50``, ``p90``, ``p99``,
``min``, ``max``) in milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from raypp.bench.report import summarize
from raypp.bench.steps import RunStats, StepTime
from raypp.bench.workload import BenchRequest


def base_result(args: argparse.Namespace, engine: Any, concurrency: int) -> dict[str, Any]:
    """The engine's configuration and the workload's shape."""
    cfg = engine.config
    return {
        "model": cfg.model.model,
        "device": cfg.device,
        "dtype": str(cfg.model.torch_dtype).replace("torch.", ""),
        "pipeline_parallel_size": cfg.parallel.pipeline_parallel_size,
        "max_inflight": cfg.scheduler.max_inflight,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "enable_prefix_caching": cfg.cache.enable_prefix_caching,
        "speculative_config": (None if cfg.speculative_config is None
                               else dataclasses.asdict(cfg.speculative_config)),
        "concurrency": concurrency,
        "control_plane": getattr(engine.executor, "control_plane", "cgraph"),
        "pp_transport": _pp_transport(engine),
        "dataset": args.dataset,
        "input_len": None if args.dataset else args.input_len,
        "shared_prefix_len": None if args.dataset else args.shared_prefix_len,
        "output_len": None if args.dataset else args.output_len,
    }


def _pp_transport(engine: Any) -> str | None:
    """What carries stage-to-stage tensors in this engine."""
    executor = engine.executor
    if engine.config.parallel.pipeline_parallel_size == 1:
        return None
    if getattr(executor, "control_plane", "cgraph") != "cgraph":
        return "PP group send/recv (direct plane)"
    return "RayPPCommunicator" if getattr(executor, "use_wrapped_comm", True) else "ray-native"


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def throughput_numbers(requests: list[BenchRequest], stats: RunStats,
                       repeats: int = 1) -> dict[str, Any]:
    """Token counts and rates of ``repeats`` passes over ``requests`` (prefill included)."""
    prompt_tokens = repeats * sum(r.prompt_len for r in requests)
    output_tokens = repeats * sum(r.output_len for r in requests)
    elapsed = stats.elapsed_s
    overhead = max(0.0, stats.step_wall_s - stats.wait_s)
    return {
        "num_requests": repeats * len(requests),
        "num_prompt_tokens": prompt_tokens,
        "num_output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 6),  # enough digits to recompute the rates
        "requests_per_s": round(repeats * len(requests) / elapsed, 4),
        "output_tokens_per_s": round(output_tokens / elapsed, 3),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / elapsed, 3),
        "engine_steps": stats.steps,
        "mean_step_ms": round(1e3 * stats.step_wall_s / max(1, stats.steps), 3),
        "engine_overhead_share": round(overhead / stats.step_wall_s, 4)
        if stats.step_wall_s else None,
        "engine_overhead_ms_per_step": round(1e3 * overhead / max(1, stats.steps), 3),
        "submit_ms_per_step": round(1e3 * stats.submit_s / max(1, stats.steps), 3),
    }


def ms_summary(values: list[float]) -> dict[str, float]:
    """:func:`summarize` of seconds, in milliseconds (3 decimals)."""
    return {k: (round(v * 1e3, 3) if k != "n" else v) for k, v in summarize(values).items()}


def step_summary(steps: list[StepTime]) -> dict[str, Any]:
    """Per-step times, apart for the steps that read a prefill micro-batch, a decode one, or
    none: ``{"prefill" | "decode" | "idle": {"wall_ms": ..., "micro_batch_ms": ...}}``
    (``idle`` holds ``wall_ms`` only and is left out when no step was idle)."""
    out: dict[str, Any] = {}
    for kind in ("prefill", "decode", "idle"):
        mine = [s for s in steps if s.kind == kind]
        if kind == "idle" and not mine:
            continue
        out[kind] = {"wall_ms": ms_summary([s.wall_s for s in mine])}
        if kind != "idle":
            out[kind]["micro_batch_ms"] = ms_summary([s.micro_batch_s for s in mine
                                                      if s.micro_batch_s is not None])
    return out


def step_rows(steps: list[StepTime], batch: int) -> list[dict[str, Any]]:
    """One JSON row per step of a batch (``batch`` numbers the batch)."""
    return [{"batch": batch, "index": s.index, "kind": s.kind, "wall_ms": round(1e3 * s.wall_s, 3),
             "micro_batch_ms": None if s.micro_batch_s is None else round(1e3 * s.micro_batch_s, 3),
             "tokens": s.num_tokens, "seqs": s.num_seqs, "decode_steps": s.decode_steps}
            for s in steps]


def comparison(result: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """raypp's and transformers' tokens/s side by side, and raypp / transformers."""
    out: dict[str, Any] = {}
    for key in ("output_tokens_per_s", "total_tokens_per_s"):
        ours, theirs = result[key], hf[key]
        out[key] = {"raypp": ours, "transformers": theirs,
                    "ratio": round(ours / theirs, 4) if theirs else None}
    return out


def occupancy_line(stages: list[dict[str, Any]]) -> str:
    """Each stage's busy, bubble and idle shares, wait per step and tokens per step."""
    return "; ".join(
        f"stage {w['stage']} busy {100 * w['busy']:.0f}% (waiting for input "
        f"{100 * w['bubble']:.0f}%, idle {100 * w['idle']:.0f}%, {w['mean_wait_ms']:.2f} ms "
        f"wait/step, {w['tokens_per_step']:.1f} tokens/step)" for w in stages)


def print_summary(r: dict[str, Any]) -> None:
    lines = [
        f"{r['num_requests']} requests in {r['elapsed_s']:.2f} s: "
        f"{r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s, "
        f"{r['total_tokens_per_s']:.1f} total tok/s",
        f"pp={r['pipeline_parallel_size']} max_inflight={r['max_inflight']} "
        f"concurrency={r['concurrency']}: {r['engine_steps']} engine steps, "
        f"{r['mean_step_ms']:.2f} ms/step, engine overhead "
        f"{100 * (r['engine_overhead_share'] or 0):.1f}% of step time",
        f"TTFT p50 {r['ttft_ms'].get('p50', float('nan')):.1f} ms, "
        f"p99 {r['ttft_ms'].get('p99', float('nan')):.1f} ms, "
        f"TPOT p50 {r['tpot_ms'].get('p50', float('nan')):.2f} ms",
    ]
    if "prefix_cache" in r:
        pc = r["prefix_cache"]
        lines.append(f"prefix caching {'on' if r['enable_prefix_caching'] else 'off'}: "
                     f"{pc['hit_tokens']} of {pc['queried_tokens']} prompt tokens cached")
    if r.get("speculative"):
        sp = r["speculative"]
        lines.append(f"speculative decoding: {sp['spec_accepted_tokens']} of "
                      f"{sp['spec_drafted_tokens']} drafted tokens accepted "
                      f"({100 * sp['spec_acceptance_rate']:.1f}%), mean accepted length "
                      f"{sp['spec_mean_accepted_length']:.2f} tokens per verification")
    if r.get("stage_occupancy"):
        lines.append("stage occupancy: " + occupancy_line(r["stage_occupancy"]))
    if "step_ms" in r:
        for kind in ("prefill", "decode"):
            wall = r["step_ms"][kind]["wall_ms"]
            if wall.get("n"):
                lines.append(f"{kind} steps: {wall['n']}, p50 {wall['p50']:.2f} ms, "
                             f"p99 {wall['p99']:.2f} ms")
    if "latency_s" in r:
        lat = r["latency_s"]
        lines.append(f"batch latency: mean {lat['mean']:.3f} s, p50 {lat['p50']:.3f} s, "
                     f"p90 {lat['p90']:.3f} s")
    if "vs_transformers" in r:
        hf, cmp = r["transformers"], r["vs_transformers"]["output_tokens_per_s"]
        match = r["transformers"]["tokens_match"]
        lines.append(f"transformers generate ({hf['cache']} cache, batch {hf['batch_size']}): "
                     f"{cmp['transformers']:.1f} output tok/s; raypp / transformers = "
                     f"{cmp['ratio']:.2f}x; identical greedy tokens in {match['identical']} of "
                     f"{match['requests']} requests")
    print("\n".join(lines))
