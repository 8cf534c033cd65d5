"""Starting and stopping the suites' engines: the Ray cluster, one ``LLM`` per layout
(every setting through the engine's config), and a shutdown that waits for the
workers to exit so the next engine finds its GPUs free."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.multi_gpu_comms import probe_workers
from benchmarks.gpu.multi_gpu_suites import Layout, Workload


def start_ray(device: str) -> None:
    """A private local cluster (unless one is up; Ray counts the GPUs), with NCCL's INIT
    logging on CUDA."""
    import ray

    if ray.is_initialized():
        return
    if device == "cuda":  # inherited by the raylet and so by every worker
        os.environ.setdefault("NCCL_DEBUG", "INFO")
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2),
             num_gpus=None if device == "cuda" else 0, object_store_memory=512 * 2**20,
             include_dashboard=False, log_to_driver=False)


def make_llm(args: argparse.Namespace, work: Workload, model: Path, layout: Layout,
             dtype: str, eager: bool = False, trace_comm: bool = False) -> Any:
    """An engine of ``layout`` on ``model``. The compiled graph is never suspended when
    idle (``idle_suspend_s=0``: on CUDA each recompile would make Ray's native transport
    build a new NCCL communicator and skew the counts); ``eager`` turns CUDA graphs off;
    ``--compile-decode``, when given, sets ``compile_decode``; ``trace_comm`` records the
    PP send/recv intervals (for the timeline)."""
    from raypp import LLM

    extra: dict[str, Any] = {}
    if args.device == "cuda":
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        extra["kv_cache_memory_bytes"] = 64 * 2**20
    if eager:
        extra["enforce_eager"] = True
    if args.compile_decode is not None:
        extra["compile_decode"] = args.compile_decode == "1"
    return LLM(str(model), pipeline_parallel_size=layout.pp,
               tensor_parallel_size=layout.tp, dtype=dtype, device=args.device,
               max_model_len=work.max_model_len, max_num_seqs=work.max_num_seqs,
               max_num_batched_tokens=work.max_num_batched_tokens,
               max_inflight=layout.max_inflight, use_ray_wrapped_pp_comm=layout.wrapped,
               trace_comm=trace_comm, idle_suspend_s=0.0, **extra)


def shutdown(llm: Any) -> None:
    """Shut the engine down and wait until its worker processes are gone (GPU memory free)."""
    pids = []
    with contextlib.suppress(Exception):
        pids = [w["pid"] for w in probe_workers(llm)]
    llm.shutdown()
    deadline = time.time() + 30
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
