"""Hop latency between two GPUs: a compiled-graph hop carrying decode- and prefill-sized
tensors through RayPPCommunicator ("wrapped") vs Ray's own transport ("native"), raw
send/recv over the same PP group between the same two processes, and a one-stage
graph as the fixed cost."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from benchmarks.gpu.multi_gpu_comms import nccl_inits
from benchmarks.gpu.multi_gpu_suites import SuiteRun, Workload
from benchmarks.harness import log
from raypp.bench.report import summarize


def _hop_dag(stages: list[Any], transport: Any, buffer_bytes: int) -> Any:
    from ray.dag import InputNode

    with InputNode() as inp:
        if len(stages) == 1:
            node = stages[0].only.bind(inp)
        else:
            node = stages[0].first.bind(inp)
            if transport is not None:
                node = node.with_tensor_transport(transport=transport)
            node = stages[1].last.bind(node)
    return node.experimental_compile(_buffer_size_bytes=buffer_bytes,
                                     _max_inflight_executions=2)


def _ms(times: list[float]) -> dict[str, float]:
    s = summarize(times)
    return {"p50_ms": round(1e3 * s["p50"], 4), "p90_ms": round(1e3 * s["p90"], 4),
            "mean_ms": round(1e3 * s["mean"], 4), "n": s["n"]}


def hop_latency(run: SuiteRun) -> dict[str, Any]:
    """Per-step time of a 1-hop graph per transport, the 1-stage graph, raw send/recv.

    Two :class:`~raypp.bench.hop.HopStage` actors (one GPU each on CUDA) form a real PP
    group whose send/recv intervals are traced; a transport that fails (e.g. Ray's NCCL
    without cupy) is recorded under ``errors`` and the others still run.
    """
    import ray

    from raypp.bench.hop import HopStage, _time_steps
    from raypp.config import RuntimeConfig
    from raypp.distributed.ray_communicator import RayPPCommunicator

    work, device = run.work, run.args.device
    # Ray's own compiled-graph knobs, if set here, apply in the hop actors too
    env_vars = {k: v for k, v in os.environ.items() if k.startswith("RAY_CGRAPH_")}
    actor = ray.remote(num_cpus=0, num_gpus=1 if device == "cuda" else 0)(HopStage)
    stages = [actor.options(runtime_env={"env_vars": env_vars}).remote(
        r, 2, work.hop_hidden, device, "bfloat16") for r in range(2)]
    result: dict[str, Any] = {"hidden": work.hop_hidden, "dtype": "bfloat16",
                              "steps": work.hop_steps, "warmup": work.hop_warmup, "rows": {},
                              "errors": {}}
    try:
        pids = ray.get([s.pid.remote() for s in stages], timeout=300)
        init = ray.get(stages[0].rendezvous_address.remote())
        timeout_s = RuntimeConfig().dist_timeout_s  # the RAYPP_* default
        ray.get([s.init_group.remote(init, timeout_s) for s in stages], timeout=300)
        item = 2  # bf16
        biggest = max(work.hop_rows) * work.hop_hidden * item
        buffer_bytes = 8_000_000 if device == "cuda" else max(8_000_000, 2 * biggest + 2**20)
        native = "accelerator" if device == "cuda" else "shm"
        for label, transport in (("wrapped", RayPPCommunicator(stages)), ("raw", None),
                                 ("native", native), ("one_stage", None)):
            try:
                result["rows"][label] = _hop_rows(stages, label, transport, buffer_bytes, work,
                                                  _time_steps)
            except Exception as e:  # noqa: BLE001 - e.g. Ray's NCCL needs cupy: record, go on
                result["errors"][label] = f"{type(e).__name__}: {e}"
                log(f"!! hop {label}: {type(e).__name__}: {e}")
        if device == "cuda":
            result["nccl_comms"] = nccl_inits(pids)
    finally:
        for s in stages:
            with contextlib.suppress(Exception):
                ray.get(s.shutdown.remote(), timeout=30)
            ray.kill(s, no_restart=True)
    result["derived"] = hop_derived(result["rows"])
    return result


def _hop_rows(stages: list[Any], label: str, transport: Any, buffer_bytes: int,
              work: Workload, time_steps: Callable[..., list[float]]) -> dict[str, Any]:
    import ray

    rows: dict[str, Any] = {}
    if label == "raw":
        for n in work.hop_rows:
            times = ray.get([s.raw_pingpong.remote(n, work.hop_steps, work.hop_warmup)
                             for s in stages], timeout=600)[0]
            rows[str(n)] = {"one_way": _ms(times)}
        return rows
    dag = _hop_dag(stages[:1] if label == "one_stage" else stages, transport, buffer_bytes)
    try:
        for n in work.hop_rows:
            time_steps(dag.execute, n, work.hop_warmup, 0, 1)  # warm-up (NCCL set-up)
            ray.get([s.drain_comm_trace.remote() for s in stages])
            rows[str(n)] = {"step": _ms(time_steps(dag.execute, n, work.hop_steps, 0, 1))}
            events = [e for t in ray.get([s.drain_comm_trace.remote() for s in stages])
                      for e in t]
            for op in ("send", "recv"):
                spans = [e[3] - e[2] for e in events if e[0] == op]
                if spans:
                    rows[str(n)][op] = _ms(spans)
            log(f"   hop {label} {n}x{work.hop_hidden}: p50 {rows[str(n)]['step']['p50_ms']} ms")
    finally:
        dag.teardown()
    return rows


def hop_derived(rows: dict[str, Any]) -> dict[str, Any]:
    """Per size: hop = step − one-stage step; overhead = hop − raw one-way (µs)."""
    out: dict[str, Any] = {}
    base = rows.get("one_stage", {})
    raw = rows.get("raw", {})
    for label in ("wrapped", "native"):
        for n, r in rows.get(label, {}).items():
            d = out.setdefault(n, {})
            step = r["step"]["p50_ms"]
            d[f"{label}_step_p50_us"] = round(1e3 * step, 1)
            if n in base:
                hop = step - base[n]["step"]["p50_ms"]
                d[f"{label}_hop_us"] = round(1e3 * hop, 1)
                if n in raw:
                    d[f"{label}_over_raw_us"] = round(1e3 * (hop - raw[n]["one_way"]["p50_ms"]), 1)
    for d in out.values():
        if "wrapped_step_p50_us" in d and "native_step_p50_us" in d:
            d["wrapped_le_native"] = d["wrapped_step_p50_us"] <= d["native_step_p50_us"]
    return out
