"""``raypp bench make-model``: a random-weight Llama checkpoint big enough that compute dominates.

The default (hidden 512, 8 layers, MLP 1408, fp32) is the model the engine's
performance targets are stated for: about 25 M parameters, tens of milliseconds
of compute per batch-32 step on one CPU core.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_make_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
    parser.add_argument("--architecture", default="llama",
                        choices=["llama", "qwen2", "qwen3", "mistral", "gemma3"],
                        help="family; qwen3, mistral and gemma3 take their transformers config "
                             "class's defaults for head_dim and sliding windows")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers")
    parser.add_argument("--intermediate", type=int, default=None,
                        help="MLP width (default: 11/4 × hidden, rounded up to 64)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: heads)")
    parser.add_argument("--vocab", type=int, default=384,
                        help="tokenizer vocabulary (BPE trained on the bundled corpus)")
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)


def make_bench_model(args: argparse.Namespace) -> Path:
    """Write the checkpoint described by ``args``; returns its directory."""
    from raypp.testing.tiny_model import make_tiny_model

    intermediate = args.intermediate or -(-(args.hidden * 11 // 4) // 64) * 64
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    return make_tiny_model(
        args.out,
        architecture=args.architecture,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads or args.heads,
        max_position_embeddings=args.max_position_embeddings,
        dtype=args.dtype,
        seed=args.seed,
    )


def run_make_model(args: argparse.Namespace) -> int:
    path = make_bench_model(args)
    print(f"wrote {path}")
    return 0
