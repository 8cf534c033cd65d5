"""Speculative decoding on the GPU (issue 33): what one verification step costs, and
where speculation stops paying as the batch grows, at the engine level (``raypp.LLM``).

``python3 -m benchmarks.gpu.speculative_decode --out DIR [--shape 8b|1b|tiny]
[--device cuda|cpu] [--budget-s 500] [--k 4] [--batches 1,4,16,64] [--reps 2]
[--model DIR] [--model-root /tmp]``

The checkpoint has random weights: ``8b`` is Llama-3-8B's shape (``LLAMA_8B``: hidden
4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128,256), ``1b``
Llama-3.2-1B's (``LLAMA_1B``, the shape of ``decode_workload.SHAPE_1B``), both drawn
with :func:`benchmarks.checkpoints.sharp_init_checkpoint` in a child process and kept
under ``--model-root`` (:func:`benchmarks.gpu.multi_gpu_models.model_dir`, shared with
the multi-GPU suites); ``tiny`` is :func:`raypp.testing.tiny_model.make_tiny_model`
(for a CPU dry run). bf16 on CUDA (``gpu_memory_utilization`` 0.85: one engine alive
at a time, each shut down before the next starts), fp32 on CPU; ``max_model_len``
1024, prefix caching off, ``max_num_seqs`` the largest batch, greedy,
``ignore_eos``. Every prompt is a random block of 64 token ids repeated 4 times
(256 tokens), the case prompt lookup is for.

Engines, in this order, each a section skipped when the budget is short:

- ``plain``: the defaults (on CUDA, engine-sized multi-step decode rounds submitted
  ahead of the running one);
- ``ngram``: ``speculative_config={"method": "ngram", "num_speculative_tokens": k}``;
- ``draft_target``: ``{"method": "draft_model", "model": <the target itself>, ...}``:
  every draft accepted (acceptance 1.0), at the cost of running the model k more times;
- ``plain_1step``: ``num_decode_steps=1, async_scheduling=False``: one synchronous
  one-token step per round trip, the like-for-like reference of a verification step
  (which is never multi-step nor submitted ahead: the driver needs its accepted tokens
  before it drafts again).

How step times are derived. ``LLMEngine.step`` reads one micro-batch's result per
call; this script wraps the engine's ``output_processor.append_results`` on the
instance to note, at each result read, the time and the micro-batch read: its mode
(``forward``, ``decode_round``, ``verify``), steps, rows, per-row draft lengths,
whether it carried a prompt chunk, tokens returned. A step's time is the interval
between its result read and the previous one (the first of a request: from the
``generate`` call), i.e. the engine's period per step at batch 1, driver work
included. Steps are classed ``prefill``, ``decode`` (one token per row, no draft),
``round`` (a multi-step decode round), ``verify_full`` (every row verifies exactly k
drafted tokens) or ``verify_partial``; the median of each class is reported.

Sections of ``results.json`` (rewritten after every measurement) and ``summary.md``:

- ``verify_cost`` (batch 1, ``--verify-requests`` requests of 32 tokens per engine):
  the median ``verify_full`` step of the n-gram engine (drafting on the driver, so the
  target's (k+1)-token forward alone) over the median ``decode`` step of
  ``plain_1step``: target **≤ 1.15× for k = 4**. For this profile the n-gram engine's
  drafting is pinned (:func:`draft_mode` ``forced``): adaptive draft lengths off, as
  ``adaptive: False`` would, and every decode row drafts k tokens, the lookup's padded
  with the row's last token, since a random-weight model's output seldom repeats its
  prompt and a step's cost depends on how many tokens it verifies, not on how many are
  accepted. Also reported: the n-gram engine's verify steps where the lookup itself
  found k tokens (adaptive off, nothing forced; few), its one-token steps, the
  ``plain`` engine's time per token, and the draft-model engine's verify step (its k
  draft forwards included).
- ``throughput``: at each ``--batches`` size, output tokens/s of each engine (whole
  ``generate``, and decode alone: from the last result carrying a prompt chunk to the
  end), median of ``--reps`` runs, the measured mean accepted length (tokens per
  verification: 1 + accepted / verifications) and acceptance rate, speed-up over
  ``plain`` (and ``plain_1step``), and the first batch where speculation stops paying
  (decode speed-up ≤ 1).

Run it from the repository root on the GPU machine (see ``benchmarks/gpu/README.md``):
``python3 -m benchmarks.gpu.speculative_decode --out $OUT/spec --shape 8b --budget-s 560``.
CPU dry run: ``--shape tiny --device cpu --batches 1,4 --budget-s 300``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import Run, add_run_args, log, machine_info, software_versions

BLOCK_LEN, REPEATS = 64, 4  # every prompt: a random block of 64 ids, 4 times
OUTPUT_LEN = 128  # tokens per request in the throughput runs
VERIFY_OUTPUT_LEN = 32  # tokens per request in the batch-1 step profile
MAX_MODEL_LEN = 1024
TARGET_RATIO = 1.15  # verify step (k = 4) over a one-token step
ENGINE_ORDER = ("plain", "ngram", "draft_target", "plain_1step")
# least time left (s) to start an engine / to begin one measurement, per shape
START_S = {"8b": 75.0, "1b": 35.0, "tiny": 8.0}
MEASURE_S = {"8b": 15.0, "1b": 8.0, "tiny": 3.0}


# -- the checkpoint ------------------------------------------------------------------------
def checkpoint(shape: str, device: str, root: Path, given: str | None) -> Path:
    """``given``, or a random-weight checkpoint of ``shape`` under ``root`` (built once)."""
    if given:
        return Path(given)
    if shape == "tiny":
        from raypp.testing.tiny_model import make_tiny_model

        path = root / "raypp-spec-tiny"
        if not (path / "config.json").is_file():
            make_tiny_model(path, architecture="llama", seed=0,
                            max_position_embeddings=MAX_MODEL_LEN)
        return path
    from benchmarks.gpu.multi_gpu_models import model_dir

    # Llama-3.2-1B / Llama-3-8B shapes (LLAMA_1B, LLAMA_8B), built in a child process
    return model_dir(None, shape, device, root)


def repeating_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts, each a random block of ``BLOCK_LEN`` ids repeated ``REPEATS`` times."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(BLOCK_LEN)] * REPEATS for _ in range(n)]


# -- engines -------------------------------------------------------------------------------
def engine_kwargs(name: str, path: Path, k: int) -> dict[str, Any]:
    """The options that make engine ``name`` (module docstring) differ from the defaults."""
    if name == "plain":
        return {}
    if name == "plain_1step":
        return {"num_decode_steps": 1, "async_scheduling": False}
    if name == "ngram":
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": k}}
    if name == "draft_target":
        return {"speculative_config": {"method": "draft_model", "model": str(path),
                                       "num_speculative_tokens": k}}
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINE_ORDER)}")


def common_kwargs(device: str, max_batch: int) -> dict[str, Any]:
    """What every engine shares (module docstring)."""
    out: dict[str, Any] = {"device": device, "max_model_len": MAX_MODEL_LEN,
                           "max_num_seqs": max_batch, "enable_prefix_caching": False,
                           "dtype": "bfloat16" if device == "cuda" else "float32"}
    if device == "cuda":
        out["gpu_memory_utilization"] = 0.85  # one engine alive at a time
    return out


# -- step recording ------------------------------------------------------------------------
@dataclass
class StepEvent:
    """One micro-batch's result, as ``LLMEngine.step`` read it."""

    t: float  # time.perf_counter() when read
    mode: str  # StepMode value: forward, decode_round, verify
    num_steps: int
    rows: int
    draft_lens: list[int]  # per row that carried a draft
    prefill: bool  # a row fed a prompt chunk
    emitted: int  # tokens returned, over the rows


class StepRecorder:
    """Notes every result an engine reads (wraps ``output_processor.append_results`` on
    the instance; the engine is otherwise untouched)."""

    def __init__(self, engine: Any):
        self.events: list[StepEvent] = []
        processor = engine.output_processor
        original = processor.append_results

        def append_results(batch: Any, result: Any) -> Any:
            self.events.append(StepEvent(
                t=time.perf_counter(), mode=batch.mode.value, num_steps=batch.num_steps,
                rows=len(batch.seqs), draft_lens=[len(i.draft) for i in batch.seqs if i.draft],
                prefill=any(i.start < len(i.seq.prompt_token_ids) for i in batch.seqs),
                emitted=sum(len(t) for t in result.token_ids)))
            return original(batch, result)

        processor.append_results = append_results

    def since(self, t0: float) -> list[StepEvent]:
        return [e for e in self.events if e.t >= t0]


def step_class(event: StepEvent, k: int) -> str:
    """``prefill``, ``verify_full`` (every row verifies k drafts), ``verify_partial``,
    ``decode`` (one token per row) or ``round`` (a multi-step decode round)."""
    if event.prefill:
        return "prefill"
    if event.draft_lens:
        return "verify_full" if event.draft_lens == [k] * event.rows else "verify_partial"
    return "decode" if event.num_steps == 1 else "round"


def timed_steps(events: list[StepEvent], t0: float, k: int) -> list[tuple[str, float, StepEvent]]:
    """Each event's class and interval since the previous result read (the first: since
    ``t0``)."""
    out, previous = [], t0
    for e in events:
        out.append((step_class(e, k), e.t - previous, e))
        previous = e.t
    return out


def class_stats(steps: list[tuple[str, float, StepEvent]]) -> dict[str, dict[str, Any]]:
    """Per step class: count, median / mean / p10 / p90 step time (ms), tokens per step
    and time per token returned."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({c for c, _, _ in steps}):
        dts = sorted(dt for c, dt, _ in steps if c == name)
        emitted = sum(e.emitted for c, _, e in steps if c == name)
        out[name] = {"count": len(dts), "median_ms": _ms(statistics.median(dts)),
                     "mean_ms": _ms(statistics.fmean(dts)),
                     "p10_ms": _ms(dts[len(dts) // 10]), "p90_ms": _ms(dts[(9 * len(dts)) // 10]),
                     "tokens_per_step": round(emitted / len(dts), 3),
                     "per_token_ms": _ms(sum(dts) / emitted) if emitted else None}
    return out


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 4)


# -- measurements --------------------------------------------------------------------------
def greedy(max_tokens: int) -> Any:
    from raypp import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def spec_counters(engine: Any) -> tuple[int, int, int]:
    s = engine.stats
    return s.spec_verifications, s.spec_drafted_tokens, s.spec_accepted_tokens


def acceptance(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict[str, Any]:
    """Mean accepted length (tokens per verification) and acceptance rate between two
    readings of the engine's speculative counters."""
    from raypp.engine.speculative import speculative_metrics

    verifications, drafted, accepted = (b - a for a, b in zip(before, after, strict=True))
    return speculative_metrics(verifications, drafted, accepted)


class ForcedDrafts:
    """A proposer that always drafts ``k`` tokens: the n-gram lookup's, padded with the
    sequence's last token (for timing verification steps: a step's cost depends on how
    many tokens it verifies, not on how many are accepted)."""

    def __init__(self, lookup: Any):
        self.lookup = lookup

    def draft(self, seq: Any, k: int) -> list[int]:
        found = self.lookup.draft(seq, k)
        return found + [seq.output_token_ids[-1]] * (k - len(found))


@contextmanager
def draft_mode(engine: Any, mode: str) -> Iterator[None]:
    """``natural``: the engine as configured; ``fixed``: adaptive draft lengths off (as
    ``adaptive: False``: every draft the proposer finds is k long); ``forced``: fixed,
    and every decode row drafts k tokens (:class:`ForcedDrafts`). Restored after."""
    speculator = engine.scheduler.rounds.speculator
    if speculator is None or mode == "natural":
        yield
        return
    adaptive, proposer = speculator.adaptive, speculator.proposer
    speculator.adaptive = False
    if mode == "forced":
        speculator.proposer = ForcedDrafts(proposer)
    try:
        yield
    finally:
        speculator.adaptive, speculator.proposer = adaptive, proposer


def step_profile(llm: Any, recorder: StepRecorder, vocab: int, k: int, requests: int,
                 mode: str = "natural") -> dict[str, Any]:
    """Batch 1: ``requests`` requests one after another, drafting as ``mode`` says
    (:func:`draft_mode`); per step class, its times."""
    steps: list[tuple[str, float, StepEvent]] = []
    before = spec_counters(llm.engine)
    with draft_mode(llm.engine, mode):
        for i in range(requests):
            prompt = repeating_prompts(1, vocab, seed=1000 + i)[0]
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], greedy(VERIFY_OUTPUT_LEN), use_tqdm=False)
            steps += timed_steps(recorder.since(t0), t0, k)
    return {"requests": requests, "output_len": VERIFY_OUTPUT_LEN, "drafts": mode,
            "classes": class_stats(steps), "spec": acceptance(before, spec_counters(llm.engine))}


def throughput_run(llm: Any, recorder: StepRecorder, prompts: list[list[int]], k: int
                   ) -> dict[str, Any]:
    """One ``generate`` of ``prompts``: output tokens/s overall and in the decode window
    (after the last result carrying a prompt chunk), step classes, acceptance."""
    before = spec_counters(llm.engine)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(OUTPUT_LEN),
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    events = recorder.since(t0)
    last_prefill = max((i for i, e in enumerate(events) if e.prefill), default=-1)
    decode_start = events[last_prefill].t if last_prefill >= 0 else t0
    decode_tokens = tokens - sum(e.emitted for e in events[:last_prefill + 1])
    decode_s = events[-1].t - decode_start if events else 0.0
    classes: dict[str, int] = {}
    for e in events[last_prefill + 1:]:
        classes[step_class(e, k)] = classes.get(step_class(e, k), 0) + 1
    return {"wall_s": round(wall, 4), "tokens": tokens, "tok_s": round(tokens / wall, 2),
            "decode_tokens": decode_tokens, "decode_s": round(decode_s, 4),
            "decode_tok_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
            "decode_steps": classes, "spec": acceptance(before, spec_counters(llm.engine))}


def throughput(llm: Any, recorder: StepRecorder, vocab: int, batch: int, k: int, reps: int
               ) -> dict[str, Any]:
    """``reps`` runs at ``batch``; their medians and every run."""
    prompts = repeating_prompts(batch, vocab, seed=batch)
    runs = [throughput_run(llm, recorder, prompts, k) for _ in range(reps)]
    decode = [r["decode_tok_s"] for r in runs if r["decode_tok_s"] is not None]
    return {"batch": batch, "tok_s": round(statistics.median(r["tok_s"] for r in runs), 2),
            "decode_tok_s": round(statistics.median(decode), 2) if decode else None,
            "spec": runs[-1]["spec"], "runs": runs}


# -- one engine ----------------------------------------------------------------------------
@dataclass
class Plan:
    path: Path
    vocab: int
    shape: str
    device: str
    k: int
    batches: list[int]
    reps: int
    verify_requests: int


def run_engine(run: Run, name: str, plan: Plan) -> None:
    """Start engine ``name``, measure what the budget allows, shut it down."""
    from raypp import LLM

    kwargs = engine_kwargs(name, plan.path, plan.k)
    record: dict[str, Any] = {"options": kwargs, "throughput": {}, "skipped": []}
    run.results["engines"][name] = record
    started = time.perf_counter()
    llm = LLM(str(plan.path), **common_kwargs(plan.device, max(plan.batches)), **kwargs)
    try:
        record["start_s"] = round(time.perf_counter() - started, 1)
        log(f"{name}: started in {record['start_s']} s")
        recorder = StepRecorder(llm.engine)
        warm = repeating_prompts(max(plan.batches), plan.vocab, seed=7)
        llm.generate([{"prompt_token_ids": p} for p in warm], greedy(2 * plan.k + 2),
                     use_tqdm=False)
        for label, measure in measurements(llm, recorder, name, plan):
            if run.left() < MEASURE_S[plan.shape]:
                record["skipped"].append(f"{label}: {run.left():.0f} s left")
                continue
            t0 = time.perf_counter()
            value = measure()
            log(f"{name} {label}: {json.dumps(_brief(value))} ({time.perf_counter() - t0:.1f} s)")
            if label.startswith("steps_batch1"):
                record[label] = value
            else:
                record["throughput"][str(value["batch"])] = value
            save(run, plan)
    finally:
        t0 = time.perf_counter()
        llm.shutdown()
        record["shutdown_s"] = round(time.perf_counter() - t0, 1)


def measurements(llm: Any, recorder: StepRecorder, name: str, plan: Plan) -> list[tuple[str, Any]]:
    """The engine's measurements in order: the batch-1 step profile, then each batch."""
    def profile(mode: str) -> Any:
        return lambda: step_profile(llm, recorder, plan.vocab, plan.k, plan.verify_requests,
                                    mode)

    out: list[tuple[str, Any]] = []
    if name == "ngram":  # the verify cost: every decode step verifies k drafts
        out.append(("steps_batch1_forced_drafts", profile("forced")))
    out.append(("steps_batch1", profile("fixed" if name == "ngram" else "natural")))
    for batch in sorted(plan.batches):
        out.append((f"batch_{batch}", lambda b=batch: throughput(
            llm, recorder, plan.vocab, b, plan.k, plan.reps)))
    return out


def _brief(value: dict[str, Any]) -> dict[str, Any]:
    """The numbers a log line shows."""
    if "classes" in value:
        return {c: (s["count"], s["median_ms"]) for c, s in value["classes"].items()}
    return {"tok_s": value["tok_s"], "decode_tok_s": value["decode_tok_s"],
            "mean_accepted_length": value["spec"]["spec_mean_accepted_length"]}


# -- derived sections ----------------------------------------------------------------------
def _median_ms(engines: dict[str, Any], name: str, cls: str, profile: str = "steps_batch1"
               ) -> tuple[float | None, int]:
    """Median step time (ms) of class ``cls`` in engine ``name``'s step ``profile``, and
    how many steps it is the median of."""
    stats = engines.get(name, {}).get(profile, {}).get("classes", {}).get(cls)
    return (stats["median_ms"], stats["count"]) if stats else (None, 0)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _per_token_ms(classes: dict[str, Any]) -> float | None:
    """Decode time per token returned over the ``decode`` and ``round`` steps."""
    decode = [s for c, s in classes.items() if c in ("decode", "round")]
    tokens = sum(s["count"] * s["tokens_per_step"] for s in decode)
    return round(sum(s["count"] * s["mean_ms"] for s in decode) / tokens, 4) if tokens else None


def verify_cost(engines: dict[str, Any], k: int) -> dict[str, Any]:
    """Verification step over one-token step, batch 1 (module docstring)."""
    one, n_one = _median_ms(engines, "plain_1step", "decode")
    same, n_same = _median_ms(engines, "ngram", "decode")
    verify, n_verify = _median_ms(engines, "ngram", "verify_full", "steps_batch1_forced_drafts")
    found, n_found = _median_ms(engines, "ngram", "verify_full")
    draft, n_draft = _median_ms(engines, "draft_target", "verify_full")
    reference = one if one is not None else same
    ratio = _ratio(verify, reference)
    return {
        "k": k,
        "one_token_step_ms": one, "one_token_steps": n_one,
        "ngram_engine_one_token_step_ms": same, "ngram_engine_one_token_steps": n_same,
        "plain_defaults_ms_per_token": _per_token_ms(
            engines.get("plain", {}).get("steps_batch1", {}).get("classes", {})),
        "verify_step_ms": verify, "verify_steps": n_verify,
        "verify_step_lookup_found_ms": found, "verify_steps_lookup_found": n_found,
        "draft_target_verify_step_ms": draft, "draft_target_verify_steps": n_draft,
        "ratio_verify_vs_one_token": ratio,
        "reference": "plain_1step" if one is not None else "the ngram engine's one-token steps",
        "ratio_verify_vs_ngram_engine_one_token": _ratio(verify, same),
        "ratio_draft_target_verify_vs_one_token": _ratio(draft, reference),
        "target_ratio": TARGET_RATIO,
        "meets_target": None if ratio is None else ratio <= TARGET_RATIO,
        "derivation": ("batch 1; a step's time is the interval between consecutive results "
                       "read by LLMEngine.step (output_processor.append_results wrapped to "
                       "note each micro-batch's mode, steps and draft lengths); verify: median "
                       "of the ngram engine's steps verifying exactly k drafts, adaptive draft "
                       "lengths off and every decode row made to draft k tokens (the lookup's, "
                       "padded with the last token); one-token: median of plain_1step's "
                       "decode steps (num_decode_steps=1, async_scheduling=False)"),
    }


def throughput_table(engines: dict[str, Any]) -> dict[str, Any]:
    """Per batch, each engine's tokens/s and speed-up over ``plain``; per speculative
    engine, the first batch where its decode speed-up is ≤ 1."""
    batches = sorted({int(b) for e in engines.values() for b in e.get("throughput", {})})
    rows = []
    for batch in batches:
        row: dict[str, Any] = {"batch": batch}
        base = engines.get("plain", {}).get("throughput", {}).get(str(batch), {})
        ref1 = engines.get("plain_1step", {}).get("throughput", {}).get(str(batch), {})
        for name, e in engines.items():
            t = e.get("throughput", {}).get(str(batch))
            if t is None:
                continue
            row[name] = {"tok_s": t["tok_s"], "decode_tok_s": t["decode_tok_s"],
                         "speedup": _ratio(t["decode_tok_s"], base.get("decode_tok_s")),
                         "speedup_vs_plain_1step": _ratio(t["decode_tok_s"],
                                                          ref1.get("decode_tok_s")),
                         "mean_accepted_length": t["spec"]["spec_mean_accepted_length"],
                         "acceptance_rate": t["spec"]["spec_acceptance_rate"]}
        rows.append(row)
    stops = {}
    for name in ("ngram", "draft_target"):
        ups = [(r["batch"], r[name]["speedup"]) for r in rows
               if name in r and r[name]["speedup"] is not None]
        stops[name] = next((b for b, s in ups if s <= 1.0), None) if ups else "not measured"
    return {"rows": rows, "stops_paying_at_batch": stops,
            "note": "speed-up: decode tokens/s over plain's (defaults); stops_paying_at_batch: "
                    "the smallest batch measured whose speed-up is <= 1 (null: pays at every "
                    "batch measured)"}


def save(run: Run, plan: Plan) -> None:
    """Recompute the derived sections, then rewrite results.json and summary.md."""
    engines = run.results["engines"]
    run.results["verify_cost"] = verify_cost(engines, plan.k)
    run.results["throughput"] = throughput_table(engines)
    run.results["elapsed_s"] = round(run.elapsed(), 1)
    run.save()


def summary_markdown(results: dict[str, Any]) -> str:
    """``summary.md``: the verify-cost numbers and the throughput table."""
    s = results.get("settings", {})
    lines = [f"# Speculative decoding, {s.get('shape')} shape on {s.get('device')} "
             f"(k = {s.get('k')})", ""]
    v = results.get("verify_cost", {})
    if v:
        lines += ["## verify_cost (batch 1)", "", "| quantity | value |", "|---|---|"]
        for key in ("one_token_step_ms", "ngram_engine_one_token_step_ms",
                    "plain_defaults_ms_per_token", "verify_step_ms", "verify_steps",
                    "verify_step_lookup_found_ms", "verify_steps_lookup_found",
                    "draft_target_verify_step_ms",
                    "ratio_verify_vs_one_token", "ratio_verify_vs_ngram_engine_one_token",
                    "ratio_draft_target_verify_vs_one_token", "meets_target"):
            lines.append(f"| {key} | {v.get(key)} |")
        lines += ["", f"Target: ratio ≤ {v.get('target_ratio')}. {v.get('derivation')}.", ""]
    t = results.get("throughput", {})
    names = [n for n in ENGINE_ORDER if n in results.get("engines", {})]
    if t.get("rows"):
        lines += ["## throughput (decode tok/s; speed-up over plain; mean accepted length)", "",
                  "| batch | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for row in t["rows"]:
            cells = [_cell(row.get(n)) for n in names]
            lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
        lines += ["", f"Speculation stops paying at batch: {t.get('stops_paying_at_batch')}", ""]
    for key in ("skipped", "errors"):
        if results.get(key):
            lines += [f"{key}: {results[key] if key == 'skipped' else list(results[key])}"]
    for name, e in results.get("engines", {}).items():
        if e.get("skipped"):
            lines.append(f"{name} skipped: {e['skipped']}")
    return "\n".join(lines) + "\n"


def _cell(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    text = f"{c['decode_tok_s']} ({c['speedup']}x)"
    return text + (f", MAL {c['mean_accepted_length']}" if c["mean_accepted_length"] else "")


# -- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(parser, out_default=None, budget_s=500.0)
    parser.add_argument("--shape", default="8b", choices=["8b", "1b", "tiny"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--reps", type=int, default=2, help="throughput runs per batch")
    parser.add_argument("--verify-requests", type=int, default=16,
                        help="batch-1 requests of the step profile, per engine")
    parser.add_argument("--engines", default=",".join(ENGINE_ORDER))
    parser.add_argument("--model", default=None, help="an existing checkpoint to use")
    parser.add_argument("--model-root", default="/tmp", help="where checkpoints are built")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run(Path(args.out), args.budget_s, {"engines": {}},
              summaries={"summary.md": summary_markdown})
    run.results.update(settings={k: v for k, v in vars(args).items() if k != "out"},
                       machine=machine_info(args.device), software=software_versions())
    path = run.section("checkpoint", lambda: checkpoint(args.shape, args.device,
                                                        Path(args.model_root), args.model))
    if path is None:
        return
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    run.results["checkpoint"] = {"path": str(path), "vocab_size": vocab}
    plan = Plan(path, vocab, args.shape, args.device, args.k,
                [int(b) for b in args.batches.split(",")], args.reps, args.verify_requests)
    for name in args.engines.split(","):
        run.section(f"engine:{name}", lambda n=name: run_engine(run, n, plan),
                    need_s=START_S[args.shape])
    save(run, plan)
    print(summary_markdown(run.results), flush=True)


if __name__ == "__main__":
    main()
