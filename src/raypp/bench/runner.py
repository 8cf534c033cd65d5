"""``raypp bench throughput`` and ``raypp bench latency``: drive a real engine and time it.

Both drive ``LLMEngine.step()`` directly (not ``LLM.generate``) so the driver can
time each step. The engine's executor is wrapped by :class:`StepRecorder`, which
times ``submit`` (handing a micro-batch to the compiled graph) and ``result``
(blocking for a micro-batch's sampled tokens). Per engine step,

    engine overhead = step wall time - time blocked in ``result``

i.e. scheduling, step-descriptor building, submission and post-processing
(appending tokens, detokenizing, stop checks) on the driver.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from raypp.bench.cpu import CpuMeter
from raypp.bench.report import run_context, summarize, write_json
from raypp.bench.workload import (
    BenchRequest,
    dataset_requests,
    special_token_ids,
    synthetic_requests,
)


@dataclass
class _Submit:
    step_id: int
    start: float
    end: float
    num_tokens: int
    num_seqs: int
    traced: bool


@dataclass
class _Wait:
    step_id: int
    start: float
    end: float


class StepRecorder:
    """Times an executor's ``submit`` and ``result`` calls until :meth:`close`.

    Wraps the bound methods on the instance (the class is untouched), so the
    engine runs its normal code path.
    """

    def __init__(self, executor: Any):
        self.executor = executor
        self.submits: list[_Submit] = []
        self.waits: list[_Wait] = []
        self._submit, self._result = executor.submit, executor.result
        executor.submit, executor.result = self.submit, self.result

    def submit(self, step: Any) -> Any:
        start = time.time()
        handle = self._submit(step)
        self.submits.append(_Submit(step.step_id, start, time.time(), step.num_tokens,
                                    step.num_seqs, bool(step.trace)))
        return handle

    def result(self, handle: Any, timeout: float | None = None) -> Any:
        start = time.time()
        out = self._result(handle, timeout)
        self.waits.append(_Wait(out.step_id, start, time.time()))
        return out

    def clear(self) -> None:
        self.submits, self.waits = [], []

    def close(self) -> None:
        for name in ("submit", "result"):
            if name in vars(self.executor):
                delattr(self.executor, name)


@dataclass
class RunStats:
    """What one pass over a list of requests measured on the driver."""

    elapsed_s: float = 0.0
    steps: int = 0
    step_wall_s: float = 0.0
    wait_s: float = 0.0
    submit_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)


def drive(engine: Any, recorder: StepRecorder, requests: list[BenchRequest], concurrency: int,
          bar: tqdm | None = None, prefix: str = "bench") -> RunStats:
    """Run ``requests`` to completion keeping at most ``concurrency`` of them in the engine.

    TTFT, TPOT and end-to-end times come from the engine's own request times (arrival,
    first token), so they are right whether or not the engine emits unfinished requests.
    """
    stats = RunStats()
    pending = deque(enumerate(requests))
    added: dict[str, BenchRequest] = {}
    active = 0
    waits_before = len(recorder.waits)
    submits_before = len(recorder.submits)
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and active < concurrency:
            i, req = pending.popleft()
            rid = f"{prefix}-{i}"
            engine.add_request(rid, {"prompt_token_ids": req.prompt_token_ids},
                               req.sampling_params())
            added[rid] = req
            active += 1
        step_start = time.perf_counter()
        outputs = engine.step()
        stats.step_wall_s += time.perf_counter() - step_start
        now = time.monotonic()  # the clock of the engine's request times
        for out in outputs:
            if out.finished:
                active -= 1
                req = added[out.request_id]
                arrival = out.metrics["arrival_time"]
                first = out.metrics.get("first_token_time", now)
                stats.ttft_s.append(first - arrival)
                stats.e2e_s.append(now - arrival)
                if req.output_len > 1:
                    stats.tpot_s.append((now - first) / (req.output_len - 1))
                if bar is not None:
                    bar.update(1)
    stats.elapsed_s = time.perf_counter() - started
    waits = recorder.waits[waits_before:]
    stats.steps = len(waits)
    stats.wait_s = sum(w.end - w.start for w in waits)
    stats.submit_s = sum(s.end - s.start for s in recorder.submits[submits_before:])
    return stats


# -- building the engine and the workload ------------------------------------------------------
def make_llm(args: argparse.Namespace) -> Any:
    """The ``LLM`` a ``throughput`` or ``latency`` command line describes (starts Ray)."""
    from raypp import LLM
    from raypp.bench.cluster import start_ray
    from raypp.entrypoints.args import engine_kwargs, resolve_model

    start_ray(args.ray_address)
    # a timeline needs the stages' send/recv intervals
    return LLM(resolve_model(args.model, args.demo), **engine_kwargs(args),
               **({"trace_comm": True} if args.timeline else {}))


def _requests(args: argparse.Namespace, engine: Any) -> list[BenchRequest]:
    if args.dataset:
        return dataset_requests(args.dataset, engine.tokenizer, args.output_len, args.num_prompts)
    avoid = special_token_ids(engine.tokenizer, engine.output_processor.eos_token_ids)
    return synthetic_requests(args.num_prompts, args.input_len, args.output_len,
                              engine.config.model.vocab_size, avoid, args.seed,
                              args.shared_prefix_len)


def _warm_up(engine: Any, recorder: StepRecorder, requests: list[BenchRequest], n: int) -> None:
    """A few short requests so start-up effects stay out of the timed run, which starts
    with an empty prefix cache all the same."""
    if n > 0:
        warm = [BenchRequest(r.prompt_token_ids, min(4, r.output_len)) for r in requests[:n]]
        drive(engine, recorder, warm, len(warm), prefix="warmup")
        _discard_traces(engine)
    engine.reset_prefix_cache()


class _PrefixCacheDelta:
    """The prefix cache's lookups and hits (prompt tokens) from construction to :meth:`stop`."""

    def __init__(self, engine: Any):
        self.scheduler = engine.scheduler
        self.start = (self.scheduler.prefix_cache_queries, self.scheduler.prefix_cache_hits)

    def stop(self) -> dict[str, Any]:
        queries = self.scheduler.prefix_cache_queries - self.start[0]
        hits = self.scheduler.prefix_cache_hits - self.start[1]
        return {"queried_tokens": queries, "hit_tokens": hits,
                "hit_rate": round(hits / queries, 4) if queries else 0.0}


def _discard_traces(engine: Any) -> None:
    from raypp.bench.timeline import drain_stage_comm

    engine.executor.traced_intervals()
    drain_stage_comm(engine.executor)


def _stage_pids(engine: Any) -> dict[str, int]:
    import ray

    pids = ray.get([lane[0].ping.remote() for lane in engine.executor.workers], timeout=60)
    return {f"stage{k}": pid for k, pid in enumerate(pids)}


def _base_result(args: argparse.Namespace, engine: Any, requests: list[BenchRequest],
                 concurrency: int) -> dict[str, Any]:
    cfg = engine.config
    return {
        "model": cfg.model.model,
        "dtype": str(cfg.model.torch_dtype).replace("torch.", ""),
        "pipeline_parallel_size": cfg.parallel.pipeline_parallel_size,
        "max_inflight": cfg.scheduler.max_inflight,
        "max_num_seqs": cfg.scheduler.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "enable_prefix_caching": cfg.cache.enable_prefix_caching,
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


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _throughput_numbers(requests: list[BenchRequest], stats: RunStats,
                        repeats: int = 1) -> dict[str, Any]:
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


def _ms_summary(values: list[float]) -> dict[str, float]:
    return {k: (round(v * 1e3, 3) if k != "n" else v) for k, v in summarize(values).items()}


def _finish(args: argparse.Namespace, engine: Any, recorder: StepRecorder,
            result: dict[str, Any], title: str) -> dict[str, Any]:
    """Attach the timeline (and its files) and write ``--json``."""
    from raypp.bench.timeline import collect, write_timeline

    tl = collect(engine.executor, recorder)
    result["stage_busy_share"] = tl.busy_shares()
    result["stage_compute_ms"] = tl.compute_ms()
    if tl.comm:
        result["stage_comm_share"] = tl.comm_shares()
    if args.timeline:
        trace, png = write_timeline(tl, args.timeline, title)
        result["timeline"] = {"chrome_trace": str(trace), "png": str(png)}
        print(f"timeline: {trace} (open in https://ui.perfetto.dev), {png}")
    result["context"] = run_context()
    if args.json:
        write_json(args.json, result)
        print(f"results: {args.json}")
    return result


def _title(kind: str, result: dict[str, Any]) -> str:
    return (f"raypp bench {kind}: pp={result['pipeline_parallel_size']}, "
            f"max_inflight={result['max_inflight']}, concurrency={result['concurrency']}, "
            f"{result['output_tokens_per_s']:.1f} output tok/s")


# -- the two benchmarks ----------------------------------------------------------------------
def run_throughput(args: argparse.Namespace, llm: Any = None) -> dict[str, Any]:
    """Offline throughput: all requests queued (or ``--concurrency`` at a time)."""
    owned = llm is None
    llm = llm or make_llm(args)
    engine = llm.engine
    recorder = StepRecorder(engine.executor)
    try:
        requests = _requests(args, engine)
        concurrency = args.concurrency or len(requests)
        _warm_up(engine, recorder, requests, args.num_warmup)
        recorder.clear()
        meter = CpuMeter.with_driver(_stage_pids(engine))
        engine.trace_steps = True
        load_at_start = _load_avg()
        prefix_cache = _PrefixCacheDelta(engine)
        meter.start()
        with tqdm(total=len(requests), desc="bench throughput", dynamic_ncols=True,
                  disable=args.no_progress) as bar:
            stats = drive(engine, recorder, requests, concurrency, bar)
        cpu = meter.stop(stats.elapsed_s)
        engine.trace_steps = False
        result = {"benchmark": "throughput", **_base_result(args, engine, requests, concurrency),
                  **_throughput_numbers(requests, stats),
                  "ttft_ms": _ms_summary(stats.ttft_s), "tpot_ms": _ms_summary(stats.tpot_s),
                  "prefix_cache": prefix_cache.stop(), "cpu": cpu,
                  "load_avg_at_start": load_at_start}
        _print_summary(result)
        return _finish(args, engine, recorder, result, _title("throughput", result))
    finally:
        recorder.close()
        if owned:
            llm.shutdown()


def run_latency(args: argparse.Namespace, llm: Any = None) -> dict[str, Any]:
    """Latency of one batch of ``--num-prompts`` requests, over ``--num-iters`` runs."""
    owned = llm is None
    llm = llm or make_llm(args)
    engine = llm.engine
    recorder = StepRecorder(engine.executor)
    try:
        requests = _requests(args, engine)
        _warm_up(engine, recorder, requests, args.num_warmup)
        for i in range(args.num_iters_warmup):
            drive(engine, recorder, requests, len(requests), prefix=f"lat-warm{i}")
            engine.reset_prefix_cache()  # every batch computes its prompts, as the first did
        _discard_traces(engine)
        recorder.clear()
        meter = CpuMeter.with_driver(_stage_pids(engine))
        engine.trace_steps = True
        load_at_start = _load_avg()
        meter.start()
        total = RunStats()
        latencies = []
        for i in tqdm(range(args.num_iters), desc="bench latency", dynamic_ncols=True,
                      disable=args.no_progress):
            stats = drive(engine, recorder, requests, len(requests), prefix=f"lat{i}")
            engine.reset_prefix_cache()
            latencies.append(stats.elapsed_s)
            for name in ("elapsed_s", "steps", "step_wall_s", "wait_s", "submit_s"):
                setattr(total, name, getattr(total, name) + getattr(stats, name))
            total.ttft_s += stats.ttft_s
            total.tpot_s += stats.tpot_s
            total.e2e_s += stats.e2e_s
        cpu = meter.stop(total.elapsed_s)
        engine.trace_steps = False
        result = {"benchmark": "latency", **_base_result(args, engine, requests, len(requests)),
                  "batch_size": len(requests), "num_iters": args.num_iters,
                  **_throughput_numbers(requests, total, repeats=args.num_iters),
                  "latency_s": {k: (round(v, 4) if k != "n" else v)
                                for k, v in summarize(latencies).items()},
                  "ttft_ms": _ms_summary(total.ttft_s), "tpot_ms": _ms_summary(total.tpot_s),
                  "cpu": cpu, "load_avg_at_start": load_at_start}
        _print_summary(result)
        return _finish(args, engine, recorder, result, _title("latency", result))
    finally:
        recorder.close()
        if owned:
            llm.shutdown()


def _print_summary(r: dict[str, Any]) -> None:
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
    if "latency_s" in r:
        lat = r["latency_s"]
        lines.append(f"batch latency: mean {lat['mean']:.3f} s, p50 {lat['p50']:.3f} s, "
                     f"p90 {lat['p90']:.3f} s")
    print("\n".join(lines))


# -- options --------------------------------------------------------------------------------
def add_workload_args(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    """Model, workload and output options shared by ``throughput`` and ``latency``."""
    from raypp.entrypoints.args import add_engine_args

    parser.add_argument("--model", default=None, help="Hugging Face–format model directory")
    parser.add_argument("--demo", action="store_true",
                        help="use the demo model (SmolLM2-135M-Instruct, fetched once)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts,
                        help="synthetic requests (or the first N of --dataset)")
    parser.add_argument("--input-len", type=int, default=32,
                        help="synthetic prompt tokens (each prompt's own, after the shared prefix)")
    parser.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                        help="synthetic prompts all start with the same N tokens (a system "
                             "prompt; compare with --no-enable-prefix-caching)")
    parser.add_argument("--output-len", type=int, default=64,
                        help="tokens generated per request (forced: ignore_eos + max_tokens)")
    parser.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                        help='JSONL lines {"prompt" | "prompt_token_ids", "output_len"?}')
    parser.add_argument("--num-warmup", type=int, default=2,
                        help="short untimed requests before measuring")
    parser.add_argument("--json", default=None, metavar="OUT", help="write results as JSON")
    parser.add_argument("--timeline", default=None, metavar="OUT",
                        help="write OUT.json (Chrome trace, Perfetto) and OUT.png (Gantt chart)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, num_prompts=32)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in the engine at once (default: all; 1 = one at a time)")


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, num_prompts=1)
    parser.add_argument("--num-iters", type=int, default=5, help="timed batches")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed batches")
