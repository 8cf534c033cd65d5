"""raypp through the real engine (Ray, pp=1, one GPU): the correctness tokens and the
decode tokens/s at each batch size and number of decode steps per round trip."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.decode_workload import (
    CHECK_DECODE_STEPS,
    CHECK_TOKENS,
    DECODE_STEPS,
    MAX_MODEL_LEN,
    OUTPUT_LEN,
    PROMPT_LEN,
    SYNC_AB_BATCHES,
    SYNC_AB_STEPS,
    check_prompts,
    random_prompts,
)
from benchmarks.harness import Run, log


def _llm(ckpt: Path, dtype: str, max_num_seqs: int, num_decode_steps: int = 1,
         control_plane: str | None = None, device: str = "cuda") -> Any:
    from raypp import LLM

    return LLM(str(ckpt), device=device, dtype=dtype, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
               gpu_memory_utilization=0.5, num_decode_steps=num_decode_steps,
               control_plane=control_plane)


def graphs_summary(worker: Any) -> dict[str, Any] | None:
    """What a :class:`~raypp.worker.worker.StageWorker` captured: replays so far, sizes,
    compiled and fused sizes, capture time (``None`` without graphs)."""
    g = worker.decode_graphs
    if g is None:
        return None
    return {"replays": g.replays, "sizes": len(g.sizes), "compiled_sizes": len(g.compiled_sizes),
            "compile_error": g.compile_error, "fused_sizes": g.fused_sizes,
            "fused_unsupported": g.fused_unsupported, "capture_s": round(g.capture_seconds, 1)}


def _graph_info(llm: Any) -> dict[str, Any] | None:
    import ray

    worker = llm.engine.executor.workers[0][0]
    return ray.get(worker.__ray_call__.remote(graphs_summary), timeout=60)


def raypp_check(ckpt: Path, dtype: str, logprobs: int | None, llm: Any = None,
                device: str = "cuda") -> dict[str, Any]:
    """Greedy tokens (and top ``logprobs``) of the check prompts through the engine
    (``llm``, else one started and stopped here on ``device``): ``{"tokens",
    "top_logprobs", "graphs"}``."""
    from raypp import SamplingParams

    own = llm is None
    llm = llm or _llm(ckpt, dtype, 4, CHECK_DECODE_STEPS, device=device)
    try:
        params = SamplingParams(temperature=0, max_tokens=CHECK_TOKENS, ignore_eos=True,
                                logprobs=logprobs)
        outs = llm.generate(check_prompts(), params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        top = None
        if logprobs is not None:  # per step: {token id: logprob}
            top = [[{int(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                   for o in outs]
        return {"tokens": tokens, "top_logprobs": top, "graphs": _graph_info(llm)}
    finally:
        if own:
            llm.shutdown()


def raypp_engine_bench(ckpt: Path, batches: tuple[int, ...], run: Run,
                       control_plane: str = "cgraph",
                       decode_steps: tuple[int, ...] = DECODE_STEPS, device: str = "cuda",
                       dtype: str = "bfloat16") -> dict[str, Any]:
    """Decode tokens/s through LLMEngine.step at each batch size and each of ``decode_steps``
    (``device`` and ``dtype``: the GPU in bf16 unless a CPU dry run asks otherwise).

    One engine serves every run; ``num_decode_steps`` is switched between runs
    (:func:`_set_rounds`). On the compiled-graph plane the result
    also holds the bf16 correctness tokens under ``"check"``, and at
    ``SYNC_AB_STEPS`` × ``SYNC_AB_BATCHES`` a ``*_sync`` run with asynchronous
    scheduling off.
    """
    from raypp import SamplingParams

    llm = _llm(ckpt, dtype, max(batches), CHECK_DECODE_STEPS, control_plane, device)
    results: dict[str, Any] = {"control_plane": control_plane}
    try:
        engine = llm.engine
        if control_plane == "cgraph":  # the bf16 correctness tokens, from this same engine
            results["check"] = raypp_check(ckpt, dtype, 5, llm)
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate(random_prompts(2, 64, 1), warm, use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
        for batch in batches:
            for k in decode_steps:
                key = f"b{batch}" + ("" if k == 1 else f"_k{k}")
                if run.left() < 20:
                    results[key] = "skipped: time"
                    continue
                _set_rounds(engine, num_decode_steps=k)
                prompts = random_prompts(batch, PROMPT_LEN, 100 + batch)
                results[key] = engine_run(engine, prompts, params, f"{control_plane}{key}")
                log(f"raypp engine ({control_plane}) {key}: {results[key]}")
                if (control_plane == "cgraph" and k == SYNC_AB_STEPS and batch in SYNC_AB_BATCHES
                        and run.left() >= 20):
                    # A/B: each round submitted only after the previous one's result is read
                    _set_rounds(engine, async_scheduling=False)
                    sync = engine_run(engine, prompts, params, f"{control_plane}{key}sync")
                    _set_rounds(engine, async_scheduling=True)
                    results[f"{key}_sync"] = sync
                    log(f"raypp engine ({control_plane}) {key}_sync: {sync}")
        results["graphs"] = _graph_info(llm)
    finally:
        llm.shutdown()
    return results


def _set_rounds(engine: Any, **settings: Any) -> None:
    """Change the engine's scheduler settings between runs (no micro-batch in flight):
    the round policy is rebuilt from them."""
    from raypp.engine.rounds import RoundPolicy

    config = engine.config.scheduler
    for name, value in settings.items():
        setattr(config, name, value)
    engine.scheduler.rounds = RoundPolicy(config)


def engine_run(engine: Any, prompts: list[list[int]], params: Any, tag: str) -> dict[str, Any]:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    started = time.perf_counter()
    have_first: set[str] = set()
    engine.emit_unfinished = True  # to see each request's first token
    while len(have_first) < len(ids):  # prefill phase (decode of early sequences mixed in)
        for out in engine.step():
            have_first.add(out.request_id)
    prefill_done = time.perf_counter()
    engine.emit_unfinished = False  # decode as LLM.generate runs it: final outputs only
    engine.trace_steps = True  # the stage records the decode phase's steps only
    stats0 = _stats(engine)
    generated = engine.stats.tokens_generated
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    tokens = engine.stats.tokens_generated - generated
    done = time.perf_counter()
    engine.trace_steps = False
    stats1 = _stats(engine)
    decode_s = done - prefill_done
    out = {
        "total_s": round(done - started, 3),
        "prefill_phase_s": round(prefill_done - started, 3),
        "decode_steps": steps,
        "decode_tokens": tokens,
        "decode_tok_s": round(tokens / decode_s, 1),
        "decode_step_ms": round(1e3 * decode_s / max(1, steps), 3),
        "e2e_output_tok_s": round(len(prompts) * OUTPUT_LEN / (done - started), 1),
    }
    if stats0 and stats1 and steps:
        out["engine_wait_ms_per_step"] = round(
            1e3 * (stats1["step_time_s"] - stats0["step_time_s"]) / steps, 3)
        out["engine_host_ms_per_step"] = round(
            1e3 * (stats1["overhead_time_s"] - stats0["overhead_time_s"]) / steps, 3)
        out["rounds_ahead"] = stats1["rounds_ahead"] - stats0["rounds_ahead"]
    intervals = sorted(_stage_intervals(engine))
    if len(intervals) > 1:  # the stage's side: time in execute_step, and between steps
        out["stage_busy_ms_per_step"] = round(
            1e3 * sum(end - start for start, end in intervals) / len(intervals), 3)
        out["stage_gap_ms_per_step"] = round(1e3 * sum(
            b[0] - a[1] for a, b in zip(intervals, intervals[1:])) / (len(intervals) - 1), 3)
    return out


def _stage_intervals(engine: Any) -> list[tuple[float, float]]:
    """The last stage's traced ``(start, end)`` of each step since the previous call."""
    import ray

    worker = engine.executor.workers[-1][0]
    try:
        traced = ray.get(worker.traced_intervals.remote(), timeout=10)
    except Exception as e:  # noqa: BLE001 - a missing timeline only loses two fields
        log(f"no stage timeline: {e}")
        return []
    return [(start, end) for _, start, end in traced]


def _stats(engine: Any) -> dict[str, float] | None:
    stats = getattr(engine, "stats", None)
    if stats is None:
        return None
    return {"step_time_s": stats.step_time_s, "overhead_time_s": stats.overhead_time_s,
            "rounds_ahead": stats.rounds_ahead}
