"""What n-gram speculation costs where it finds nothing to draft: the tests' tiny Llama
(steps of ~2 ms on CPU, so per-step driver overhead shows as it does on a GPU), batch 1,
one 40-token text prompt, 200 greedy tokens, prompt lookup ``min_n`` 2, k = 4.

``python -m benchmarks.speculative_quiet [--reps 5] [--out FILE]``

Two engines in turn (plain defaults; n-gram), each timed ``--reps`` times after a
warm-up; reported: output tokens/s (median), rounds continued ahead, tokens drafted and
accepted. Rows that keep drafting nothing are *quiet* and ride rounds run ahead
(:mod:`raypp.engine.speculative`); before that change every step of such a row was one
synchronous step (``benchmarks/README.md`` has both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

MAX_TOKENS = 200
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from raypp import LLM, SamplingParams
    from raypp.testing.tiny_model import CORPUS, make_tiny_model

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="raypp_spec_quiet_")) / "tiny")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {}
    for name, spec in (("plain", None), ("ngram k=4", NGRAM)):
        with LLM(str(model), max_num_seqs=4, speculative_config=spec) as llm:
            prompt = {"prompt_token_ids": llm.get_tokenizer().encode(CORPUS.read_text()[:4000])[:40]}
            llm.generate([prompt], params, use_tqdm=False)  # warm-up
            seconds = []
            for _ in range(args.reps):
                started = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                seconds.append(time.perf_counter() - started)
            stats = llm.engine.stats
            results[name] = {"tok_s": [round(MAX_TOKENS / s, 1) for s in seconds],
                             "median_tok_s": round(MAX_TOKENS / statistics.median(seconds), 1),
                             "rounds_ahead": stats.rounds_ahead,
                             "drafted": stats.spec_drafted_tokens,
                             "accepted": stats.spec_accepted_tokens}
            print(name, results[name], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
