"""``raypp generate``: generate text for one or more prompts and print it.

What callers may rely on: with ``--model``, each prompt is printed as ``--- 'PROMPT'``
followed by the prompt and its first completion; with ``--demo`` (an instruct model)
each prompt is a user turn through the chat template, printed as ``--- user: …`` then
``assistant: …``; exit status 2 without ``--model`` or ``--demo``.
"""

from __future__ import annotations

import argparse
import sys

from raypp.entrypoints.args import add_engine_args, engine_kwargs, resolve_model

_DEMO_QUESTIONS = ["What is the capital of France?", "Name the three primary colors."]


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``raypp generate`` on the top-level CLI."""
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
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Start an engine, generate, print, shut it down."""
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
            for question, out in zip(questions, outs, strict=True):
                print(f"--- user: {question}")
                print(f"assistant: {out.outputs[0].text.strip()}")
            return 0
        for out in llm.generate(args.prompt or ["The list type"], params):
            print(f"--- {out.prompt!r}")
            print(out.prompt + out.outputs[0].text)
    return 0
