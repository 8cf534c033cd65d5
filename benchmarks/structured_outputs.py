"""Structured outputs: what a grammar costs, on CPU (issue 29). Results in
``benchmarks/structured_outputs/``, commands in ``benchmarks/structured_outputs.md``.

Sections (``--sections``, default all):

- ``mask``: the per-step cost of the token bitmask at batch 64 with a 128,256-entry
  vocabulary (a byte-level BPE vocabulary of that size, :func:`byte_bpe_tokenizer`):
  the driver's fill of 64 masks (xgrammar: its threaded batch call, as the engine does,
  vs one fill per row; llguidance's
  fill for comparison when installed), the bytes a step carries, pickling the step,
  and the last stage's unpack + apply on a ``[64, 128256]`` float32 CPU tensor.
- ``engine``: decode throughput on the tiny Llama (``raypp.testing.tiny_model``,
  vocab 384), every request constrained by a JSON schema vs none, at batch 1 and 64,
  pp 1, the default round settings.
- ``stall``: the longest gap between an unconstrained stream's updates while a large
  new schema compiles, against the same stream with no compile.

Run from the repository root: ``python -m benchmarks.structured_outputs [--out DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

VOCAB = 128256
# a nested schema: enums, a bounded integer, an array, a nested object, a pattern string
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo", "Lisbon"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 99},
        "units": {"type": "array", "items": {"enum": ["C", "F"]}},
        "where": {"type": "object", "properties": {"coast": {"type": "boolean"},
                                                    "code": {"type": "string",
                                                             "pattern": "^[A-Z]{2,3}$"}},
                  "required": ["coast", "code"]},
        "note": {"type": "string"},
    },
    "required": ["city", "days", "units", "where", "note"],
}
# a JSON value the schema accepts, written as the grammar writes it (", " and ": ")
SAMPLE = json.dumps({"city": "Lisbon", "days": 42, "units": ["C", "F", "C"],
                     "where": {"coast": True, "code": "PT"},
                     "note": "Sunny all week, light wind from the north in the afternoons."})
# never complete within the measured tokens: every row decodes the same number of tokens
ENDLESS = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 1000}


def byte_bpe_tokenizer(vocab_size: int, seed: int = 0) -> Any:
    """A byte-level BPE fast tokenizer of exactly ``vocab_size`` entries: ``<s>``,
    ``</s>``, ``<pad>``, the 256 byte symbols, then merges of random pairs of shorter
    tokens (up to 12 symbols), as a real large vocabulary holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tokens = list(alphabet)
    common = [ch for ch in alphabet if ch.isalnum() or ch in '"{}[]:, ']
    merges = []
    while len(vocab) < vocab_size:
        a = rng.choice(tokens if rng.random() < 0.7 else common)
        b = rng.choice(tokens if rng.random() < 0.7 else common)
        merged = a + b
        if len(merged) > 12 or merged in vocab:
            continue
        vocab[merged] = len(vocab)
        tokens.append(merged)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def _ms(samples: list[float]) -> dict[str, float]:
    return {"median_ms": round(1e3 * statistics.median(samples), 3),
            "p90_ms": round(1e3 * sorted(samples)[int(0.9 * (len(samples) - 1))], 3)}


# -- mask ----------------------------------------------------------------------------------------
def mask_cost(rows: int = 64) -> dict[str, Any]:
    import numpy as np
    import torch
    import xgrammar

    from raypp.engine.structured import StructuredOutputs
    from raypp.sampling_params import StructuredOutputsParams
    from raypp.step import SamplingBatch, StepInput
    from raypp.worker.logits_processors import shape_logits

    t0 = time.perf_counter()
    tok = byte_bpe_tokenizer(VOCAB)
    out: dict[str, Any] = {"vocab": VOCAB, "rows": rows, "tokenizer_s": round(time.perf_counter() - t0, 2)}
    structured = StructuredOutputs(tok, VOCAB, [tok.eos_token_id])
    t0 = time.perf_counter()
    compiled = structured.compile(StructuredOutputsParams(json=SCHEMA))
    out["first_compile_s (indexes the vocabulary)"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    structured.compile(StructuredOutputsParams(json={**SCHEMA, "title": "other"}))
    out["compile_s"] = round(time.perf_counter() - t0, 3)
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    out["sample_tokens"] = len(ids)
    grammars = [structured.grammar(compiled) for _ in range(rows)]
    offsets = [r % len(ids) for r in range(rows)]  # rows at different places in the JSON
    for g, k in zip(grammars, offsets):
        assert g.accept(ids[:k])
    engine, threaded, apply, pickled, sizes = [], [], [], [], []
    buffer = np.zeros((rows, (VOCAB + 31) // 32), dtype=np.int32)
    batch_matcher = xgrammar.BatchGrammarMatcher(max_threads="auto")
    logits = torch.randn(rows, VOCAB)
    z = [0.0] * rows
    for step in range(len(ids)):
        for which in ((0, 1) if step % 2 else (1, 0)):  # alternate: the second runs warm
            t0 = time.perf_counter()
            if which == 0:
                masks = structured.bitmasks(grammars)  # what the step builder runs
                engine.append(time.perf_counter() - t0)
            else:  # xgrammar's threaded batch fill, the alternative
                batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars],
                                                            buffer)
                threaded.append(time.perf_counter() - t0)
        batch = SamplingBatch(z, [1.0] * rows, [0] * rows, z, [0] * rows, [0] * rows, [-1] * rows,
                              z, z, [1.0] * rows, token_bitmask=masks)
        step_input = StepInput(step, [0] * rows, list(range(rows + 1)), [100] * rows,
                               list(range(rows)), list(range(rows)), batch)
        t0 = time.perf_counter()
        data = pickle.dumps(step_input, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
        pickled.append(time.perf_counter() - t0)
        sizes.append(len(data))
        t0 = time.perf_counter()
        shape_logits(logits, batch)
        apply.append(time.perf_counter() - t0)
        for i, g in enumerate(grammars):  # advance each row by its next token (wrapping)
            k = (offsets[i] + step) % len(ids)
            if k == 0:
                grammars[i] = g = structured.grammar(compiled)
            assert g.accept([ids[k]])
    out["driver_fill_64_engine (a fill per row)"] = _ms(engine)
    out["driver_fill_64_batch_threads"] = _ms(threaded)
    out["step_bytes_with_masks"] = statistics.median(sizes)
    out["mask_bytes_per_row"] = len(masks[0])
    out["pickle_roundtrip"] = _ms(pickled)
    out["stage_apply_cpu_fp32"] = _ms(apply)
    structured.close()
    out["llguidance_fill_64"] = _llguidance_fill(tok, ids, rows)
    out["xgrammar"] = xgrammar.__name__
    return out


def _llguidance_fill(tok: Any, ids: list[int], rows: int) -> dict[str, Any] | str:
    """The same fill with llguidance (for the choice of library), if installed."""
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:
        return "llguidance not installed"
    import numpy as np

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(  # xgrammar's separators
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ",
                                      "key_separator": ": "})
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
    setup = time.perf_counter() - t0
    offsets = [r % len(ids) for r in range(rows)]
    for m, k in zip(matchers, offsets):
        m.consume_tokens(ids[:k])
    buffer = llguidance.numpy.allocate_token_bitmask(rows, VOCAB)
    fills = []
    for step in range(len(ids)):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            llguidance.numpy.fill_next_token_bitmask(m, buffer, i)
        fills.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            k = (offsets[i] + step) % len(ids)
            if k == 0:
                matchers[i] = m = llguidance.LLMatcher(lltok, grammar)
            m.consume_token(ids[k])
    assert not np.all(buffer == 0)
    return {"setup_s": round(setup, 3), "version": llguidance.get_version()
            if hasattr(llguidance, "get_version") else "?", **_ms(fills)}


# -- engine --------------------------------------------------------------------------------------
def engine_overhead(batches: list[int], tokens: int = 64, reps: int = 3) -> dict[str, Any]:
    from raypp import LLM, SamplingParams, StructuredOutputsParams
    from raypp.testing.tiny_model import make_tiny_model

    path = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny_llama", architecture="llama", seed=0,
                           max_position_embeddings=512)
    out: dict[str, Any] = {"model": "tiny Llama (raypp.testing.tiny_model: 6 layers, hidden 64, "
                                    "vocab 384)", "tokens_per_request": tokens}
    free = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    forced = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=ENDLESS))
    with LLM(str(path), kv_cache_memory_bytes=64 * 2**20, max_num_seqs=max(batches)) as llm:
        llm.generate(["warm up"], [forced], use_tqdm=False)  # compiles the schema once
        for batch in batches:
            prompts = [{"prompt_token_ids": [5 + i % 50, 7, 9]} for i in range(batch)]
            row: dict[str, Any] = {}
            for name, params in (("unconstrained", free), ("json_schema", forced)):
                rates = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    elapsed = time.perf_counter() - t0
                    made = sum(len(o.outputs[0].token_ids) for o in outs)
                    assert made == batch * tokens, made
                    rates.append(made / elapsed)
                row[f"{name}_tok_s"] = round(statistics.median(rates), 1)
            row["constrained_vs_free"] = round(row["json_schema_tok_s"] / row["unconstrained_tok_s"], 3)
            out[f"batch_{batch}"] = row
    return out


# -- stall ---------------------------------------------------------------------------------------
def compile_stall(reps: int = 3) -> dict[str, Any]:
    from raypp import SamplingParams, StructuredOutputsParams
    from raypp.engine.async_engine import AsyncLLMEngine

    tok_path = Path(tempfile.mkdtemp())
    from raypp.testing.tiny_model import make_tiny_model

    path = make_tiny_model(tok_path / "tiny_llama", architecture="llama", seed=0,
                           max_position_embeddings=512)
    engine = AsyncLLMEngine.from_model(str(path), kv_cache_memory_bytes=16 * 2**20)
    structured = engine.engine.structured
    structured.compile(StructuredOutputsParams(regex="a"))  # the vocabulary indexed once

    def big_schema(seed: int) -> StructuredOutputsParams:
        props = {f"f{seed}_{i}": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "[a-z]{3,9}"},
            "b": {"enum": [f"v{j}" for j in range(30)]},
            "c": {"type": "array", "items": {"type": "number"}}}, "required": ["a", "b", "c"]}
            for i in range(40)}
        return StructuredOutputsParams(json={"type": "object", "properties": props,
                                             "required": list(props)})

    async def stream(compile_seed: int | None) -> tuple[float, float]:
        gaps, last, compile_s = [], None, 0.0
        params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        async for out in engine.generate("The list type", params, f"s-{compile_seed}-{time.time()}"):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if compile_seed is not None and len(out.outputs[0].token_ids) == 20:
                t0 = time.perf_counter()
                future = structured.submit(big_schema(compile_seed))
                future.add_done_callback(lambda _: None)
                compile_future, compile_t0 = future, t0
        if compile_seed is not None:
            compile_future.result()
            compile_s = time.perf_counter() - compile_t0
        return max(gaps), compile_s

    try:
        rows = []
        for rep in range(reps):
            base_gap, _ = asyncio.run(stream(None))
            gap, compile_s = asyncio.run(stream(rep))
            rows.append({"max_gap_ms_without_compile": round(1e3 * base_gap, 1),
                         "max_gap_ms_while_compiling": round(1e3 * gap, 1),
                         "compile_s": round(compile_s, 3)})
        return {"runs": rows}
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="mask,engine,stall")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--out", default="benchmarks/structured_outputs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    results: dict[str, Any] = {}
    if "mask" in sections:
        results["mask"] = mask_cost()
        print(json.dumps(results["mask"], indent=1), flush=True)
    if "engine" in sections:
        results["engine"] = engine_overhead([int(b) for b in args.batches.split(",")])
        print(json.dumps(results["engine"], indent=1), flush=True)
    if "stall" in sections:
        results["stall"] = compile_stall()
        print(json.dumps(results["stall"], indent=1), flush=True)
    for name, value in results.items():
        (out / f"{name}.json").write_text(json.dumps(value, indent=1) + "\n")


if __name__ == "__main__":
    main()
