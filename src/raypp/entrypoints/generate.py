"""``raypp generate MODEL``: generate text for one or more prompts and print it.

What callers may rely on: every check of the model, the options and the prompts
(non-empty, within ``max_model_len`` with ``--max-tokens``) runs before Ray or any stage
starts, and a failed one raises ``ValueError`` (the CLI prints it as one line, exit 2).
With a chat model (its tokenizer has a chat template; ``--chat``/``--no-chat`` decide
otherwise) each prompt is a user turn, printed as ``--- user: …`` then
``assistant: …``; else each prompt is printed as ``--- 'PROMPT'`` followed by the prompt
and its completion. Sampling options left out take the model's generation-config
defaults (``--generation-config``), then ``SamplingParams``' own.
"""

from __future__ import annotations

import argparse
from typing import Any

from raypp.entrypoints.args import add_engine_args, add_model_args, engine_config, model_name

_CHAT_PROMPTS = ["What is the capital of France?", "Name the three primary colors."]
_COMPLETION_PROMPTS = ["The list type"]


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``raypp generate`` on the top-level CLI."""
    p = sub.add_parser("generate", help="generate text for one or more prompts",
                       description="Generate text for one or more prompts and print it.")
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeat for a batch; default: two questions for a chat model, "
                        "'The list type' otherwise)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="send each prompt as a user turn through the chat template (default: "
                        "when the model's tokenizer has one)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the model's generation config, else 1.0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling (default: the model's generation config, else 1.0)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample from the k likeliest tokens, 0 for all (default: the model's "
                        "generation config, else 0)")
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Check everything, then start an engine, generate, print, shut it down."""
    from raypp import LLM, SamplingParams
    from raypp.engine.request_checks import check_max_tokens, check_prompt
    from raypp.engine.tokenizer import load_tokenizer, render_chat

    if args.prompt is not None and "" in args.prompt:
        raise ValueError("--prompt is empty: give at least one character")
    config = engine_config(model_name(args), args)  # the model and every option, no Ray yet
    model = config.model
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    params = SamplingParams(**{**model.sampling_defaults,
                               **{k: v for k, v in given.items() if v is not None}},
                            max_tokens=args.max_tokens, seed=args.seed)
    tokenizer = load_tokenizer(model.tokenizer)
    chat = bool(getattr(tokenizer, "chat_template", None)) if args.chat is None else args.chat
    questions = args.prompt or (_CHAT_PROMPTS if chat else _COMPLETION_PROMPTS)
    prompts: list[dict[str, Any]] = []
    for question in questions:
        text = render_chat(tokenizer, [{"role": "user", "content": question}]) if chat else question
        ids = tokenizer.encode(text)  # as the engine tokenizes a text prompt
        check_prompt(ids, model.max_model_len, model.vocab_size)
        check_max_tokens(len(ids), params.max_tokens, model.max_model_len)
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    with LLM.from_config(config) as llm:
        outs = llm.generate(prompts, params)
        for question, out in zip(questions, outs, strict=True):  # before the engine stops
            if chat:
                print(f"--- user: {question}")
                print(f"assistant: {out.outputs[0].text.strip()}", flush=True)
            else:
                print(f"--- {question!r}")
                print(question + out.outputs[0].text, flush=True)
    return 0
