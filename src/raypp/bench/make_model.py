"""``raypp bench make-model``: a random-weight Llama checkpoint big enough that compute dominates.

The default (hidden 512, 8 layers, MLP 1408, fp32) is the model the engine's
performance targets are stated for: about 25 M parameters, tens of milliseconds
of compute per batch-32 step on one CPU core. ``--architecture qwen3_moe`` or ``mixtral``
writes a mixture-of-experts model (``--experts``, ``--experts-per-token``,
``--moe-intermediate``, ``--dense-first``), e.g. Qwen3-30B-A3B's proportions at a sixteenth
of its size (1.9 B parameters; the model is built in fp32 in memory before it is written):
``--architecture qwen3_moe --hidden 1024 --layers 24 --heads 16 --kv-heads 4 --experts 64
--experts-per-token 8 --moe-intermediate 384 --intermediate 3072 --dtype bfloat16``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_make_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
    parser.add_argument("--architecture", default="llama",
                        choices=["llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe",
                                 "mixtral"],
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
    parser.add_argument("--max-position-embeddings", type=int, default=2048,
                        help="the model's context length")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the weights written")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    moe = parser.add_argument_group("mixture of experts (qwen3_moe, mixtral)")
    moe.add_argument("--experts", type=int, default=8, help="experts per sparse layer")
    moe.add_argument("--experts-per-token", type=int, default=2, help="experts each token uses")
    moe.add_argument("--moe-intermediate", type=int, default=None,
                     help="qwen3_moe: one expert's width (default: --intermediate / 4); mixtral's "
                          "experts are --intermediate wide")
    moe.add_argument("--dense-first", type=int, default=0,
                     help="qwen3_moe: this many first layers have a dense MLP (mlp_only_layers)")


def make_bench_model(args: argparse.Namespace) -> Path:
    """Write the checkpoint described by ``args``; returns its directory."""
    from raypp.testing.tiny_model import make_tiny_model

    intermediate = args.intermediate or -(-(args.hidden * 11 // 4) // 64) * 64
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    extra: dict = {}
    if args.architecture == "qwen3_moe":
        extra = {"num_experts": args.experts, "num_experts_per_tok": args.experts_per_token,
                 "moe_intermediate_size": args.moe_intermediate or intermediate // 4,
                 "mlp_only_layers": list(range(args.dense_first)), "norm_topk_prob": True}
    elif args.architecture == "mixtral":
        extra = {"num_local_experts": args.experts, "num_experts_per_tok": args.experts_per_token}
    return make_tiny_model(
        args.out,
        extra_config=extra,
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
