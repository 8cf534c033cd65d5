"""``raypp bench throughput`` and ``raypp bench latency``: drive a real engine and time it.

Both drive ``LLMEngine.step()`` directly (not ``LLM.generate``) so the driver can
time each step (:mod:`raypp.bench.steps`). ``throughput`` runs ``--num-prompts``
requests at once (or ``--concurrency`` at a time) and reports end-to-end tokens/s,
prefill included; ``--compare-hf`` then runs the same requests through transformers'
``generate`` on the same checkpoint and device (:mod:`raypp.bench.hf_baseline`) and
reports both rates, their ratio and whether the greedy tokens agree. ``latency`` runs
one batch ``--num-iters`` times and reports the batch's latency and every engine
step's time, prefill steps apart. Both write ``--json`` and ``--plot``.
"""

from __future__ import annotations

import argparse
from typing import Any

from tqdm import tqdm

from raypp.bench.cpu import CpuMeter
from raypp.bench.engine_report import (
    base_result,
    comparison,
    load_avg,
    ms_summary,
    occupancy_line,
    print_summary,
    step_rows,
    step_summary,
    throughput_numbers,
)
from raypp.bench.report import run_context, summarize, write_json
from raypp.bench.steps import RunStats, StepRecorder, drive
from raypp.bench.workload import (
    BenchRequest,
    dataset_requests,
    special_token_ids,
    synthetic_requests,
)


# -- building the engine and the workload ------------------------------------------------------
def make_llm(args: argparse.Namespace) -> Any:
    """The ``LLM`` a ``throughput`` or ``latency`` command line describes (starts Ray)."""
    from raypp import LLM
    from raypp.entrypoints.args import engine_kwargs, model_name
    from raypp.executor.stage_pool import ensure_ray

    ensure_ray(args.ray_address)
    # a timeline needs the stages' send/recv intervals
    return LLM(model_name(args, default="demo"), **engine_kwargs(args),
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


class _SpeculationDelta:
    """Speculative decoding's counters from construction to :meth:`stop` (``None`` with
    speculation off)."""

    def __init__(self, engine: Any):
        self.stats = engine.stats
        self.on = engine.config.speculative_config is not None
        self.start = self._now()

    def _now(self) -> tuple[int, int, int]:
        s = self.stats
        return s.spec_verifications, s.spec_drafted_tokens, s.spec_accepted_tokens

    def stop(self) -> dict[str, Any] | None:
        if not self.on:
            return None
        from raypp.engine.speculative import speculative_metrics

        return speculative_metrics(*(b - a for a, b in zip(self.start, self._now())))


class _OccupancyDelta:
    """Each stage's occupancy (:mod:`raypp.engine.occupancy`) from construction to
    :meth:`stop`."""

    def __init__(self, engine: Any):
        self.executor = engine.executor
        self.start = self.executor.occupancy(timeout=60)

    def stop(self) -> list[dict[str, Any]]:
        from raypp.engine.occupancy import windows

        return [w.as_dict() for w in windows(self.start, self.executor.occupancy(timeout=60))]


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


def _nice(pid: int = 0) -> int | None:
    """A process's niceness (Ray starts its workers at 15; ``None`` if not readable)."""
    import os

    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None


def _stage_pids(engine: Any) -> dict[str, int]:
    import ray

    pids = ray.get([lane[0].ping.remote() for lane in engine.executor.workers], timeout=60)
    return {f"stage{k}": pid for k, pid in enumerate(pids)}


def _attach_timeline(args: argparse.Namespace, engine: Any, recorder: StepRecorder,
                     result: dict[str, Any], kind: str) -> None:
    """Stage busy shares, and with ``--timeline`` its files (the engine must be up)."""
    from raypp.bench.timeline import collect, write_timeline

    tl = collect(engine.executor, recorder)
    result["stage_busy_share"] = tl.busy_shares()
    result["stage_compute_ms"] = tl.compute_ms()
    if tl.comm:
        result["stage_comm_share"] = tl.comm_shares()
    if args.timeline:
        title = (f"raypp bench {kind}: pp={result['pipeline_parallel_size']}, "
                 f"max_inflight={result['max_inflight']}, concurrency={result['concurrency']}, "
                 f"{result['output_tokens_per_s']:.1f} output tok/s\n"
                 + occupancy_line(result.get("stage_occupancy", [])))
        trace, png = write_timeline(tl, args.timeline, title)
        result["timeline"] = {"chrome_trace": str(trace), "png": str(png)}
        print(f"timeline: {trace} (open in https://ui.perfetto.dev), {png}")


def _write(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """Print the summary; write ``--plot`` and ``--json``."""
    from raypp.bench import plots

    print_summary(result)
    result["context"] = run_context()
    if args.plot:
        draw = plots.plot_throughput if result["benchmark"] == "throughput" else plots.plot_latency
        result["plot"] = str(draw(result, args.plot))
        print(f"plot: {result['plot']}")
    if args.json:
        write_json(args.json, result)
        print(f"results: {args.json}")
    return result


# -- the two benchmarks ----------------------------------------------------------------------
def run_throughput(args: argparse.Namespace, llm: Any = None) -> dict[str, Any]:
    """Offline throughput: all requests queued (or ``--concurrency`` at a time); with
    ``--compare-hf``, then transformers on the same requests (after an engine this call
    started has shut down and Ray with it, so the two never share the device)."""
    owned = llm is None
    llm = llm or make_llm(args)
    engine = llm.engine
    recorder = StepRecorder(engine.executor)
    try:
        requests = _requests(args, engine)
        concurrency = args.concurrency or len(requests)
        _warm_up(engine, recorder, requests, args.num_warmup)
        recorder.clear()
        pids = _stage_pids(engine)
        meter = CpuMeter.with_driver(pids)
        engine.trace_steps = True
        load_at_start = load_avg()
        prefix_cache = _PrefixCacheDelta(engine)
        occupancy = _OccupancyDelta(engine)
        speculation = _SpeculationDelta(engine)
        meter.start()
        with tqdm(total=len(requests), desc="bench throughput", dynamic_ncols=True,
                  disable=args.no_progress) as bar:
            stats = drive(engine, recorder, requests, concurrency, bar)
        cpu = meter.stop(stats.elapsed_s)
        engine.trace_steps = False
        result = {"benchmark": "throughput", **base_result(args, engine, concurrency),
                  **throughput_numbers(requests, stats),
                  "ttft_ms": ms_summary(stats.ttft_s), "tpot_ms": ms_summary(stats.tpot_s),
                  "step_ms": step_summary(stats.step_times),
                  "prefix_cache": prefix_cache.stop(), "speculative": speculation.stop(),
                  "stage_occupancy": occupancy.stop(),
                  "cpu": cpu,
                  "nice": {name: _nice(pid) for name, pid in pids.items()},
                  "load_avg_at_start": load_at_start}
        _attach_timeline(args, engine, recorder, result, "throughput")
        model, dtype, device = engine.config.model.model, engine.config.model.torch_dtype, \
            engine.config.device
    finally:
        recorder.close()
        if owned:
            llm.shutdown()
    if args.compare_hf:
        if owned:  # leave transformers the machine: no raylet, no idle workers starting up
            import ray

            ray.shutdown()
        result["transformers"] = _transformers(args, model, dtype, device, requests,
                                               stats.output_token_ids)
        result["vs_transformers"] = comparison(result, result["transformers"])
    return _write(args, result)


def _transformers(args: argparse.Namespace, model: str, dtype: Any, device: str,
                  requests: list[BenchRequest], raypp_ids: dict[int, list[int]]
                  ) -> dict[str, Any]:
    """``--compare-hf``: transformers' numbers on ``requests`` and its token agreement."""
    import time

    import torch
    import transformers

    from raypp.bench.hf_baseline import load_hf_model, resolve_cache, run_hf_generate, token_agreement

    start = time.perf_counter()
    hf_model = load_hf_model(model, dtype, device)
    load_s = time.perf_counter() - start
    run = run_hf_generate(hf_model, requests, resolve_cache(args.hf_cache, device),
                          args.hf_batch_size or len(requests), device,
                          progress=not args.no_progress)
    del hf_model
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    return {"version": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "nice": _nice(),
            "cache": run.cache,
            "torch_compile": run.compiled, "batch_size": run.batch_size,
            "load_s": round(load_s, 3), "warmup_s": round(run.warmup_s, 3),
            "num_output_tokens": output_tokens, "elapsed_s": round(run.elapsed_s, 6),
            "output_tokens_per_s": round(output_tokens / run.elapsed_s, 3),
            "total_tokens_per_s": round((prompt_tokens + output_tokens) / run.elapsed_s, 3),
            "tokens_match": token_agreement(raypp_ids, run.output_token_ids)}


def run_latency(args: argparse.Namespace, llm: Any = None) -> dict[str, Any]:
    """Latency of one batch of ``--num-prompts`` requests, over ``--num-iters`` runs; every
    engine step's time (``steps``) and their summary, prefill and decode steps apart
    (``step_ms``)."""
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
        load_at_start = load_avg()
        occupancy = _OccupancyDelta(engine)
        meter.start()
        total = RunStats()
        latencies, rows = [], []
        for i in tqdm(range(args.num_iters), desc="bench latency", dynamic_ncols=True,
                      disable=args.no_progress):
            stats = drive(engine, recorder, requests, len(requests), prefix=f"lat{i}")
            engine.reset_prefix_cache()
            latencies.append(stats.elapsed_s)
            rows += step_rows(stats.step_times, batch=i)
            total.add(stats)
        cpu = meter.stop(total.elapsed_s)
        engine.trace_steps = False
        result = {"benchmark": "latency", **base_result(args, engine, len(requests)),
                  "batch_size": len(requests), "num_iters": args.num_iters,
                  **throughput_numbers(requests, total, repeats=args.num_iters),
                  "latency_s": {k: (round(v, 4) if k != "n" else v)
                                for k, v in summarize(latencies).items()},
                  "ttft_ms": ms_summary(total.ttft_s), "tpot_ms": ms_summary(total.tpot_s),
                  "step_ms": step_summary(total.step_times), "steps": rows,
                  "stage_occupancy": occupancy.stop(),
                  "cpu": cpu, "load_avg_at_start": load_at_start}
        _attach_timeline(args, engine, recorder, result, "latency")
    finally:
        recorder.close()
        if owned:
            llm.shutdown()
    return _write(args, result)


# -- options --------------------------------------------------------------------------------
def add_workload_args(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    """Model, workload and output options shared by ``throughput`` and ``latency``."""
    from raypp.entrypoints.args import add_engine_args, add_model_args

    add_model_args(parser, required=False)
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
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="draw the results (matplotlib PNG)")
    parser.add_argument("--timeline", default=None, metavar="OUT",
                        help="write OUT.json (Chrome trace, Perfetto) and OUT.png (Gantt chart)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, num_prompts=32)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in the engine at once (default: all; 1 = one at a time)")
    hf = parser.add_argument_group("transformers baseline")
    hf.add_argument("--compare-hf", action="store_true",
                    help="then run the same requests through transformers' generate (same "
                         "checkpoint, dtype and device; greedy) and report both")
    hf.add_argument("--hf-cache", default="auto", choices=["auto", "static", "dynamic"],
                    help="transformers' KV cache: static (torch.compile on CUDA) or dynamic "
                         "(default auto: static on CUDA, dynamic on CPU)")
    hf.add_argument("--hf-batch-size", type=int, default=None, metavar="N",
                    help="requests per generate call (default: all of them)")


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, num_prompts=1)
    parser.add_argument("--num-iters", type=int, default=5, help="timed batches")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed batches")
