"""The model and engine options shared by every command that starts an engine (generate,
serve, bench throughput|latency).

What callers may rely on: :func:`add_model_args` lets a command take its model as the
positional ``MODEL`` or ``--model`` (``--demo`` is the model name ``demo``), and
:func:`model_name` returns the one name given (a :class:`UsageError` when there are none
or two different ones); names are resolved by :mod:`raypp.model_source`, as ``LLM``'s
are. :func:`engine_kwargs` returns keyword arguments that ``LLM(model, **kwargs)`` (and
``AsyncLLMEngine.from_model``) accept; an option not given on the command line is left
out, so its ``RAYPP_*`` default applies. :func:`engine_config` turns them into the
engine's config through :meth:`EngineConfig.from_kwargs
<raypp.config.EngineConfig.from_kwargs>`, the mapping ``LLM`` uses, so a flag and the
keyword it becomes always mean the same. Importing this module does not import torch
or Ray.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raypp.config import EngineConfig


MODEL_HELP = ("a Hugging Face–format model directory, a .gguf file (or a directory holding "
              "one), 'demo' (SmolLM2-135M-Instruct, fetched once into the cache), or a Hugging "
              "Face Hub id (org/name, or org/name/FILE.gguf), fetched into the Hub cache")


class UsageError(ValueError):
    """A command line that names no model, or two different ones."""


def add_model_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """``MODEL`` (positional), ``--model MODEL`` and ``--demo``: one name, given either way;
    ``--revision`` for a Hub id."""
    what = "" if required else " (default: demo)"
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help=MODEL_HELP + what)
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="the same as the positional MODEL")
    parser.add_argument("--demo", action="store_true",
                        help="the same as the model name 'demo'")
    parser.add_argument("--revision", default=None,
                        help="a Hub id's branch, tag or commit (default: main)")


def model_name(args: argparse.Namespace, default: str | None = None) -> str:
    """The one model the command line names (``default`` when it names none);
    :class:`UsageError` when it names none without a default, or two different ones."""
    given = {name for name in (args.model, args.model_option, "demo" if args.demo else None)
             if name is not None}
    if len(given) > 1:
        raise UsageError(f"two different models given: {', '.join(map(repr, sorted(given)))}; "
                         "name one, as MODEL or --model")
    if given:
        return given.pop()
    if default is None:
        raise UsageError(f"give a model: raypp {args.command} MODEL, where MODEL is "
                         f"{MODEL_HELP}")
    return default


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that starts an engine."""
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="number of pipeline stages (Ray actors)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="tensor-parallel ranks per stage")
    parser.add_argument("--dtype", default="auto",
                        help="auto (the checkpoint's; float32 for GGUF), float32, bfloat16 or "
                             "float16")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output (default: the checkpoint's "
                             "max_position_embeddings, lowered with a warning to what the KV "
                             "cache holds)")
    parser.add_argument("--generation-config", default=None, metavar="auto|none|DIR",
                        help="sampling defaults: 'auto' takes the model's generation_config.json "
                             "(for a GGUF file, one beside it), 'none' ignores it, DIR reads "
                             "DIR/generation_config.json (default: auto)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the engine's sampling (and of each request without its own)")
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster (default: RAY_ADDRESS, else start a local one)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="sequences running at once (default: 256 on CUDA, 64 on CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens in one step (default: 8192 on CUDA, 2048 on CPU)")
    parser.add_argument("--max-inflight", type=int, default=None,
                        help="micro-batches in the pipeline at once (default: pp)")
    parser.add_argument("--num-decode-steps", type=int, default=None,
                        help="decode steps per round trip to the stage for pure decode "
                             "batches (pp=1 only; default: CUDA, the engine sizes rounds to "
                             "about 20 ms, at most 64 steps; CPU, 1)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="submit a decode batch's next multi-step round "
                        "before reading the current one (pp=1; default on)")
    parser.add_argument("--pipelined-prefill", action=argparse.BooleanOptionalAction,
                        default=None, help="pp > 1: a long prompt's next chunk enters the "
                        "pipeline while its earlier chunks are still in it (default on)")
    parser.add_argument("--long-prefill-chunk-tokens", type=int, default=None,
                        help="most tokens of one prompt per step (default: the step budget, "
                             "over the stages with pipelined prefill)")
    parser.add_argument("--balanced-prefill-chunks", action=argparse.BooleanOptionalAction,
                        default=None, help="later prompt chunks shrink as their context "
                        "grows, for even stage times (default on)")
    parser.add_argument("--balanced-decode", action=argparse.BooleanOptionalAction,
                        default=None, help="at most ceil(decodes / micro-batches in flight) "
                        "decode rows per micro-batch, so decodes spread evenly over the "
                        "pipeline (default on)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None, help="reuse the KV of prompt prefixes seen before "
                        "(default on; --no-enable-prefix-caching turns it off)")
    parser.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                        help="KV cache bytes per stage on CPU (default: a quarter of the host's "
                             "available memory, split between its stages)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                        help="share of each GPU's memory the engine may use, weights and KV "
                             "cache (default: 0.9)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where stages run (default: auto, cuda when a GPU is visible)")
    parser.add_argument("--control-plane", default=None, choices=["cgraph", "direct"],
                        help="how steps reach the stages (default: RAYPP_CONTROL_PLANE, cgraph)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="stage-worker replacements allowed in a rolling window (default 3)")
    parser.add_argument("--layer-partition", type=_layer_partition, default=None,
                        metavar="N,N,...",
                        help='layers per stage, e.g. "3,2,2" (default: RAYPP_PP_LAYER_PARTITION, '
                             "else an even split)")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="never capture CUDA graphs (default: RAYPP_ENFORCE_EAGER, off)")
    parser.add_argument("--workers-per-gpu", type=int, default=None, metavar="N",
                        help="stage workers that may share one GPU, e.g. -pp 2 --workers-per-gpu 2 "
                             "on one GPU (default: RAYPP_WORKERS_PER_GPU, 1)")
    parser.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                        help="torch threads per stage worker on CPU (default: "
                             "RAYPP_CPU_THREADS, else the host's cores over the workers)")
    parser.add_argument("--step-timeout-s", type=float, default=None, metavar="SECONDS",
                        help="how long no stage may advance while a step runs before the "
                             "pipeline counts as stuck; long steps that advance are waited "
                             "for (default: RAYPP_STEP_TIMEOUT_S, 60)")
    parser.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                        help="fp8: quantize a 16/32-bit checkpoint's linear weights to FP8 "
                             "as they load (default: load the checkpoint as it is; FP8 "
                             "checkpoints are read in their own format)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "fp8_e4m3"],
                        help="KV cache element type: auto (the model's dtype) or fp8 (e4m3 "
                             "with per-layer scales: twice the tokens of 16-bit)")
    parser.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4}\' (default: off)')


def _json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _layer_partition(text: str) -> list[int]:
    from raypp.config import parse_partition

    try:
        return parse_partition(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments from parsed :func:`add_engine_args` options."""
    kwargs: dict[str, Any] = dict(
        pipeline_parallel_size=args.pipeline_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        ray_address=args.ray_address,
        device=args.device,
        control_plane=args.control_plane,
        max_restarts=args.max_restarts,
    )
    optional = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_inflight": args.max_inflight,
        "num_decode_steps": args.num_decode_steps,
        "async_scheduling": args.async_scheduling,
        "pipelined_prefill": args.pipelined_prefill,
        "long_prefill_chunk_tokens": args.long_prefill_chunk_tokens,
        "balanced_prefill_chunks": args.balanced_prefill_chunks,
        "balanced_decode": args.balanced_decode,
        "enable_prefix_caching": args.enable_prefix_caching,
        "kv_cache_memory_bytes": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "generation_config": args.generation_config,
        "layer_partition": args.layer_partition,
        "enforce_eager": args.enforce_eager,
        "step_timeout_s": args.step_timeout_s,
        "workers_per_gpu": args.workers_per_gpu,
        "cpu_threads": args.cpu_threads,
        "speculative_config": args.speculative_config,
        "revision": getattr(args, "revision", None),  # add_model_args's
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs


def engine_config(model: str, args: argparse.Namespace, **extra: Any) -> EngineConfig:
    """The config of ``LLM(model, **engine_kwargs(args), **extra)``, without starting it."""
    from raypp.config import EngineConfig

    return EngineConfig.from_kwargs(model, **engine_kwargs(args), **extra)
