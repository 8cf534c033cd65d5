"""Issue 35's GPU targets (items 2-6) in one script: the defaults as the fast path, the
Qwen3 / Mistral / Gemma 3 families, Qwen3-MoE, prefix caching and batch-1 asynchronous
scheduling, each against its target, on one GPU.

    python -m benchmarks.gpu.debt_targets --out DIR [--sections a,b] [--budget-s 540]
        [--ckpt-root /tmp/raypp_debt] [--moe-layers 24] [--families qwen3_8b,...]
        [--prefix-rounds 2] [--async-reps 6] [--keep-checkpoints] [--dry-run | --summarize]

(from the repository root, raypp importable; ``--dry-run``: the same code on the CPU with
tiny shapes, see below). Every checkpoint has random weights
(:func:`benchmarks.checkpoints.sharp_init_checkpoint`, bf16, a word-level tokenizer over
the real vocabulary), is written once under ``--ckpt-root`` (on the GPU) and, except the
1B one the later sections share, deleted after its section (``--keep-checkpoints`` keeps
them: the machine has 64 GB of disk). Engines run in bf16; "defaults" means
``LLM(model, device="cuda", dtype="bfloat16")`` and nothing else (256 sequences, 35 graph
sizes, engine-sized decode rounds, asynchronous scheduling, ``gpu_memory_utilization``
0.9); each engine is shut down before the next starts. Decode tok/s: 512-token random
prompts, 256 greedy tokens (``ignore_eos``), from the step after every sequence has its
first token to the end (:func:`benchmarks.gpu.decode_engine.engine_run`). Rooflines: the
bytes a decode step must read — every checkpoint parameter once in bf16 (a tied embedding
once: the LM head reads it), less an untied input embedding (a step reads one row of it),
plus the batch's KV at the mean context (512 + 128 tokens) — over the copy bandwidth
measured in the same process (:func:`benchmarks.cuda_timing.bandwidth`), as
:mod:`benchmarks.gpu.decode` defines it (its 1B roofline: 2.47 GB of weights + KV).

Sections (``--sections``: run in the order named there; default all, in this order). GPU
time is estimated for one H100/H200 from runs 10-17: an engine start is Ray + the weights'
load + CUDA graph capture (35 sizes, ~15-25 s of capture, up to ~40 s with the compiled
sizes), ~50 s for the 1B shape, ~70 s for 8B:

- ``defaults_1b`` (~3 min: 1B checkpoint ~15 s, two engine starts, transformers load +
  static-cache compile ~30 s): Llama-3.2-1B shape. First the tuned figure as
  ``python -m benchmarks.gpu.decode`` measures it
  (:func:`~benchmarks.gpu.decode_engine.raypp_engine_bench`: its engine settings, here with
  ``max_num_seqs`` 64, ``num_decode_steps`` 1/8/32/64 at batch 1 and 64, the k=32
  asynchronous-off A/B; the best batch-1 figure is the reference). Then one engine of
  defaults built as ``raypp bench throughput`` builds it
  (:func:`raypp.bench.runner.make_llm`): 64 prompts of 512 + 256 tokens end to end
  (:func:`~raypp.bench.runner.run_throughput`), then decode at batch 1 and 64; the engine
  and Ray shut down, transformers on the same requests (static cache + torch.compile,
  ``--compare-hf``'s own :func:`~raypp.bench.runner._transformers`; raypp's tokens are
  not kept by ``run_throughput``, so their agreement is not reported). Targets: defaults
  at batch 1 ≥ 90 % of the tuned figure; end to end ≥ 3× transformers.
- ``defaults_8b`` (~5-6 min: 16 GB checkpoint ~30-60 s, two engine starts, transformers
  load + compile + first full batch ~70 s): the same on Llama-3.1-8B's shape. Targets: as
  1B, and batch-64 decode with defaults ≥ 70 % of the weights + KV roofline.
- ``families`` (~5-6 min for the three, ~100-120 s each: checkpoint 9-16 GB ~20-45 s,
  one engine start ~70 s; ``--families`` runs some): Qwen3-8B, Mistral-7B (v0.3) and
  Gemma-3-4B (its text model) shapes, from their config.json values (:data:`MODELS`);
  defaults, batch-1 decode. Target: ≥ 85 % of the weight-read roofline (weights + batch
  1's KV, which is < 1 % of it).
- ``moe`` (~6-7 min at 24 layers: 31 GB checkpoint ~60-90 s, two engine starts ~80-100 s
  each, transformers load ~60 s + eager decode ~20 s): a Qwen3-30B-A3B-shaped checkpoint
  (hidden 2048, 32 heads, 4 KV heads, head_dim 128, 128 experts, 8 per token, expert width
  768, vocab 151,936) with ``--moe-layers`` of its 48 layers: default 24 (31 GB), since
  all 48 are 61 GB, which fits neither the device machine's 64 GB disk beside the rest nor
  one 10-minute call with two engine starts and transformers (the results and
  ``summary.md`` say how many layers ran). Defaults at pp 1, and at pp 2 with both stages
  on the one GPU (``workers_per_gpu=2``): decode at batch 1 and 64, and each engine's
  stage byte table as it logs it at start (:func:`raypp.executor.stage_pool.
  format_stage_table` of the engine's ``stage_summary``). Then transformers (``generate``,
  dynamic cache, 64 tokens: decode = the full run − a one-token run) on the same
  checkpoint if its weights fit 85 % of the free GPU memory. No numeric target: raypp
  against transformers, and against an active-bytes roofline (experts touched in
  expectation under uniform routing).
- ``async_k32`` (~1-1.5 min: one engine start + ~14 runs of ~0.5 s): the 1B shape on
  :mod:`benchmarks.gpu.decode`'s engine (``max_num_seqs`` 256, ``num_decode_steps`` 32),
  batch 1: one k=1 run first (the order of run 11, where asynchronous came out 22 %
  below synchronous), then ``--async-reps`` pairs, asynchronous scheduling on / off in
  alternating order (on-off, off-on, …) so drift shows; each run with the engine's wait,
  its host time, the stage's busy time and the gaps between its steps. Target: on ≥ 98 %
  of off (the median of the pairs' ratios): not below synchronous beyond the noise.
- ``prefix`` (~2 min a round: two engine starts and the two workloads; plus the driver
  probe, ~10-20 s of CPU): :mod:`benchmarks.prefix_caching`'s workloads (64 requests, a
  shared 1,024-token prefix + 64 own tokens, 64 output tokens; the same lengths with
  nothing shared) on the 1B shape, ``--max-model-len 2048``, caching on vs off in
  ``--prefix-rounds`` alternating rounds (its own ``_section`` and ``summary``; a round
  is skipped when the time left is less than the longest so far; its files also under
  ``DIR/prefix/``). Targets: TTFT p50 ≥ 3× lower with caching on; with 0 % hits,
  throughput ≥ 97 % of caching off's (medians over rounds).

Device calls (carry ``.whl``; ``scripts/gpu_run.sh 1 0`` only installs the wheels), each
~550 s at most; every call writes its own checkpoints (a machine given back keeps none).
A call's ``summary.md`` lists its own sections and any other ``<section>.json`` already in
``--out``; each device call's ``$OUT`` starts empty, so copy the calls' files into one
folder here and run ``--summarize`` on it (no GPU, nothing measured) for the whole table::

    bash scripts/gpu_run.sh 1 0; PYTHONPATH=/tmp/site:$PWD/src RAY_AUTH_MODE=disabled \
      PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false timeout 520 python3 -m \
      benchmarks.gpu.debt_targets --out $OUT --budget-s 480 \
      --sections defaults_1b,async_k32,prefix > $OUT/log_1.txt 2>&1; cat $OUT/summary.md
    # the same with --sections defaults_8b (log_2), --sections families (log_3),
    # --sections moe (log_4)

The four take ~22-25 minutes of device time in all; with less, ``--prefix-rounds 1``
(-2 min), ``--moe-layers 12`` (-2 min) or ``--families`` in two calls.

Output, rewritten as each measurement finishes (a run cut short keeps what finished):
``DIR/<section>.json`` per section, ``DIR/results.json`` (all, with the machine, software
and commit), ``DIR/summary.md`` (one row per target: figure, target, measured, met).
A section that does not fit the time left is skipped and listed; an error is recorded and
the next section runs (:class:`benchmarks.harness.Run`); inside a section, each engine
start and each transformers run is skipped the same way when the time left is short.

``--dry-run``: the same code on the CPU in fp32, every shape with hidden size 64, 2 layers,
4 heads of 16 (the MoE: 8 experts of width 32, 2 per token) and its real vocabulary;
32-token prompts and 16 output tokens (48 for ``async_k32``), batch 4 where the GPU runs 64
(the prefix workload: 8 requests sharing 512 tokens, 8 output tokens); transformers with a
dynamic cache; checkpoints under ``/tmp/raypp_debt_dry``. The figures mean nothing; it
checks that every section runs end to end (~15-25 s each). The tuned figure still runs
:mod:`benchmarks.gpu.decode`'s workload (512 + 256 tokens), at batch 1 only.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.checkpoints import LLAMA_1B, LLAMA_8B, LLAMA_FAMILY, sharp_init_checkpoint
from benchmarks.gpu.decode_workload import random_prompts
from benchmarks.gpu.fp8_checkpoints import QWEN3_8B
from benchmarks.harness import (
    Run,
    add_run_args,
    cuda_card,
    log,
    machine_info,
    parse_sections,
    software_versions,
)

SECTIONS = ("defaults_1b", "defaults_8b", "families", "moe", "async_k32", "prefix")


# -- shapes (transformers config fields, from each model's config.json) --------------------------
@dataclass(frozen=True)
class Model:
    title: str
    family: tuple[str, str]  # transformers config class, model class
    shape: dict[str, Any]


QWEN3_30B_A3B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False)
MODELS: dict[str, Model] = {
    "llama1b": Model("Llama-3.2-1B", LLAMA_FAMILY, LLAMA_1B),
    "llama8b": Model("Llama-3.1-8B", LLAMA_FAMILY, LLAMA_8B),
    "qwen3_8b": Model("Qwen3-8B", ("Qwen3Config", "Qwen3ForCausalLM"), {
        **QWEN3_8B, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6}),
    "mistral_7b": Model("Mistral-7B-v0.3", ("MistralConfig", "MistralForCausalLM"), dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=None,
        max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False)),
    "gemma3_4b": Model("Gemma-3-4B (text)", ("Gemma3TextConfig", "Gemma3ForCausalLM"), dict(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=1024, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072,
        rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen3_30b_a3b": Model("Qwen3-30B-A3B", ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                           QWEN3_30B_A3B),
}
FAMILIES = ("qwen3_8b", "mistral_7b", "gemma3_4b")
TINY: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_MOE: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

# targets of issue 35
B1_VS_TUNED, E2E_VS_HF, B64_ROOFLINE, FAMILY_ROOFLINE = 0.90, 3.0, 0.70, 0.85
PREFIX_TTFT, PREFIX_NO_HIT, ASYNC_VS_SYNC = 3.0, 0.97, 0.98


# -- the run's settings: GPU, or the CPU dry run -----------------------------------------------
@dataclass(frozen=True)
class Setup:
    dry: bool
    root: Path
    keep: bool
    moe_layers: int
    families: tuple[str, ...]
    prefix_rounds: int
    async_reps: int

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def dtype(self) -> str:
        return "float32" if self.dry else "bfloat16"

    @property
    def itemsize(self) -> int:
        return 4 if self.dry else 2

    @property
    def prompt_len(self) -> int:
        return 32 if self.dry else 512

    @property
    def output_len(self) -> int:
        return 16 if self.dry else 256

    @property
    def big_batch(self) -> int:  # the "batch 64" runs and the end-to-end prompts
        return 4 if self.dry else 64

    @property
    def context(self) -> int:  # the rooflines' KV context: the decode phase's mean
        return self.prompt_len + self.output_len // 2

    def start_s(self, key: str) -> float:
        """Least time left (s) to start an engine on model ``key`` and measure a little."""
        if self.dry:
            return 15.0
        return {"llama1b": 60.0, "qwen3_30b_a3b": 150.0}.get(key, 100.0)

    @property
    def hf_s(self) -> float:  # least time left for a transformers pass
        return 10.0 if self.dry else 90.0

    def shape(self, key: str) -> dict[str, Any]:
        shape = dict(MODELS[key].shape)
        if self.dry:
            shape.update(TINY, **(TINY_MOE if "num_experts" in shape else {}))
        elif key == "qwen3_30b_a3b":
            shape["num_hidden_layers"] = self.moe_layers
        return shape


NEED_S = {"defaults_1b": 150.0, "defaults_8b": 300.0, "families": 130.0, "moe": 250.0,
          "prefix": 120.0, "async_k32": 75.0}  # least time left to begin a section (GPU)


# -- one section's results, written as they come ----------------------------------------------
class Part:
    """A section's results: ``run.results[name]``, and ``OUT/<name>.json`` (with the
    section's error and time, once known) rewritten at every :meth:`put`."""

    def __init__(self, run: Run, name: str):
        self.run, self.name = run, name
        self.data: dict[str, Any] = {}
        run.results[name] = self.data

    def put(self, key: str, value: Any) -> Any:
        self.data[key] = value
        self.flush()
        return value

    def flush(self) -> None:
        r = self.run.results
        doc = {"section": self.name, "result": self.data, "error": r["errors"].get(self.name),
               "timing_s": r["timings_s"].get(self.name), "env": r.get("env")}
        (self.run.out / f"{self.name}.json").write_text(json.dumps(doc, indent=1, default=str))
        self.run.save()

    def fits(self, key: str, need_s: float) -> bool:
        """Whether ``need_s`` seconds are left; if not, ``key`` is recorded as skipped."""
        left = self.run.left()
        if left >= need_s:
            return True
        self.put(key, f"skipped: {left:.0f} s left, needs ~{need_s:.0f}")
        log(f"{self.name}/{key}: skipped ({left:.0f} s left)")
        return False


# -- checkpoints, bandwidth, prompts ----------------------------------------------------------
def checkpoint(key: str, setup: Setup, part: Part) -> Path:
    """The random-weight checkpoint of model ``key`` under ``--ckpt-root`` (written once)."""
    shape = setup.shape(key)
    suffix = "_tiny" if setup.dry else f"_{shape['num_hidden_layers']}l"
    path = setup.root / f"{key}{suffix}"
    if not (path / "config.json").is_file():  # config.json is written last
        log(f"writing {path}")
        started = time.perf_counter()
        sharp_init_checkpoint(path, shape, family=MODELS[key].family)
        _free_cuda()
        part.put(f"checkpoint_{key}", {"path": str(path), "write_s": round(
            time.perf_counter() - started, 1), "bytes": _dir_bytes(path), "shape": shape})
    return path


def drop_checkpoint(path: Path, setup: Setup) -> None:
    if not setup.keep and path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        log(f"deleted {path}")


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def bandwidth(setup: Setup, run: Run) -> float:
    """Copy bandwidth (GB/s, bytes read + written), measured once per run."""
    if "bandwidth" not in run.results:
        if setup.dry:
            run.results["bandwidth"] = _cpu_bandwidth()
        else:
            from benchmarks.cuda_timing import bandwidth as cuda_bandwidth

            run.results["bandwidth"] = cuda_bandwidth()
            _free_cuda()
        log(f"bandwidth: {run.results['bandwidth']}")
    return float(run.results["bandwidth"]["copy_GBps"])


def _cpu_bandwidth() -> dict[str, float]:
    import torch

    x = torch.ones(1 << 24)
    y = torch.empty_like(x)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        y.copy_(x)
        times.append(time.perf_counter() - t)
    return {"copy_GBps": 2 * x.nbytes / min(times) / 1e9}


def _free_cuda() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _config(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "config.json").read_text())


# -- engines ---------------------------------------------------------------------------------
def start_engine(ckpt: Path, setup: Setup, **options: Any) -> tuple[Any, float]:
    """``LLM`` on ``ckpt`` with the defaults and ``options``; it and its start-up seconds."""
    from raypp import LLM

    started = time.perf_counter()
    llm = LLM(str(ckpt), device=setup.device, dtype=setup.dtype, **options)
    return llm, round(time.perf_counter() - started, 1)


def warm(llm: Any, vocab: int) -> None:
    from raypp import SamplingParams

    llm.generate(random_prompts(2, 64, 1, vocab), SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)


def stage_table(llm: Any) -> dict[str, Any]:
    """The engine's start-up stage table (as ``raypp.executor.stage_pool`` logs it)."""
    from raypp.executor.stage_pool import format_stage_table

    rows = llm.engine.executor.pool.stage_summary
    smallest = min(range(len(rows)), key=lambda i: rows[i]["kv_blocks"])
    return {"rows": rows, "text": format_stage_table(rows, smallest)}


def decode_run(engine: Any, batch: int, setup: Setup, vocab: int, tag: str,
               output_len: int | None = None) -> dict[str, Any]:
    """:func:`benchmarks.gpu.decode_engine.engine_run` on ``batch`` random prompts (seed
    ``100 + batch``, as :mod:`benchmarks.gpu.decode`), ``output_len`` greedy tokens."""
    from benchmarks.gpu.decode_engine import engine_run
    from raypp import SamplingParams

    n = output_len or setup.output_len
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out = engine_run(engine, random_prompts(batch, setup.prompt_len, 100 + batch, vocab), params, tag)
    out["e2e_output_tok_s"] = round(batch * n / out["total_s"], 1)  # engine_run assumes 256
    out["batch"] = batch
    log(f"{tag}: {out['decode_tok_s']} decode tok/s")
    return out


# -- what a decode step reads ------------------------------------------------------------------
@dataclass(frozen=True)
class StepBytes:
    """The bytes a decode step must read, from the checkpoint (its tensors' sizes and
    config.json): every parameter once in the engine's dtype — a tied embedding once, as
    the LM head reads it, however many copies the stages hold (the stage table says) —
    less an untied input embedding, plus the KV cache."""

    params: int  # every checkpoint parameter's bytes in the engine's dtype
    embed: int  # an untied input embedding's bytes (a step reads one row of it), else 0
    kv_per_token: int  # over all layers
    layers: int
    experts: int = 0
    per_token: int = 0
    expert_bytes: int = 0  # one expert of one layer

    @classmethod
    def of(cls, ckpt: Path, itemsize: int) -> StepBytes:
        cfg = _config(ckpt)
        layers = int(cfg["num_hidden_layers"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv = layers * 2 * int(cfg["num_key_value_heads"]) * int(head_dim) * itemsize
        embed = 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * cfg["hidden_size"] * itemsize
        experts = int(cfg.get("num_experts") or 0)
        expert = 3 * cfg["hidden_size"] * int(cfg.get("moe_intermediate_size") or 0) * itemsize
        return cls(_num_params(ckpt) * itemsize, embed, kv, layers,
                   experts, int(cfg.get("num_experts_per_tok") or 0), expert if experts else 0)

    def weights(self, batch: int) -> float:
        """Weight bytes read at ``batch``: for an MoE, the experts ``batch`` tokens touch
        per layer in expectation under uniform routing."""
        read = self.params - self.embed
        if self.experts:
            touched = self.experts * (1 - (1 - self.per_token / self.experts) ** batch)
            read -= self.layers * (self.experts - touched) * self.expert_bytes
        return read

    def roofline(self, batch: int, context: int, copy_gbps: float) -> dict[str, Any]:
        total = self.weights(batch) + batch * context * self.kv_per_token
        seconds = total / (copy_gbps * 1e9)
        return {"bytes_per_step": int(total), "weight_bytes_read": int(self.weights(batch)),
                "kv_context": context, "roofline_ms": round(1e3 * seconds, 4),
                "roofline_tok_s": round(batch / seconds, 1), "copy_GBps": round(copy_gbps, 1)}


def _num_params(ckpt: Path) -> int:
    """Parameters in the checkpoint's safetensors (from their headers)."""
    from safetensors import safe_open

    total = 0
    for file in ckpt.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    return total


def with_roofline(result: dict[str, Any], sb: StepBytes, setup: Setup, bw: float) -> dict[str, Any]:
    roof = sb.roofline(result["batch"], setup.context, bw)
    return {**result, "roofline": roof,
            "roofline_fraction": round(result["decode_tok_s"] / roof["roofline_tok_s"], 4)}


# -- defaults_1b / defaults_8b -------------------------------------------------------------------
def section_defaults(key: str, setup: Setup, run: Run, part: Part) -> None:
    from benchmarks.gpu.decode_engine import raypp_engine_bench

    ckpt = checkpoint(key, setup, part)
    bw = bandwidth(setup, run)
    tuned_batches = (1,) if setup.dry else (1, setup.big_batch)
    try:
        if part.fits("tuned", setup.start_s(key) + 20):
            tuned = raypp_engine_bench(ckpt, tuned_batches, run, device=setup.device,
                                       dtype=setup.dtype)
            tuned.pop("check", None)  # decode.py's bf16 correctness tokens: not a target here
            part.put("tuned", tuned)
        if part.fits("defaults", setup.start_s(key) + 20):
            defaults_and_transformers(ckpt, setup, run, part, bw)
    finally:
        if key != "llama1b":  # the 1B checkpoint serves prefix and async_k32 too
            drop_checkpoint(ckpt, setup)


def throughput_args(ckpt: Path, setup: Setup) -> tuple[argparse.Namespace, list[str]]:
    """``raypp bench throughput`` options for the 64 × (512 + 256) workload (its
    transformers pass is run here, after the engine is down: no ``--compare-hf``)."""
    from raypp.cli import build_parser

    argv = ["--model", str(ckpt), "--device", setup.device, "--dtype", setup.dtype,
            "--num-prompts", str(setup.big_batch), "--input-len", str(setup.prompt_len),
            "--output-len", str(setup.output_len), "--no-progress"]
    return build_parser().parse_args(["bench", "throughput", *argv]), argv


def defaults_and_transformers(ckpt: Path, setup: Setup, run: Run, part: Part, bw: float) -> None:
    """One engine of defaults as ``raypp bench throughput`` builds it: the end-to-end
    run, then decode at batch 1 and 64; then transformers on the same requests."""
    import ray

    from raypp.bench.runner import _requests, make_llm, run_throughput

    args, argv = throughput_args(ckpt, setup)
    vocab = _config(ckpt)["vocab_size"]
    started = time.perf_counter()
    llm = make_llm(args)
    try:
        engine = llm.engine
        part.put("stages", stage_table(llm))
        part.put("startup_s", round(time.perf_counter() - started, 1))
        result = run_throughput(args, llm=llm)
        result["command"] = "raypp bench throughput " + " ".join(argv) + " --compare-hf"
        part.put("throughput", result)
        sb = StepBytes.of(ckpt, setup.itemsize)
        for batch in (1, setup.big_batch):
            res = decode_run(engine, batch, setup, vocab, f"defaults-b{batch}")
            part.put(f"decode_b{batch}", with_roofline(res, sb, setup, bw))
        requests = _requests(args, engine)  # the timed run's requests (same seed)
        model, dtype, device = engine.config.model.model, engine.config.model.torch_dtype, \
            engine.config.device
    finally:
        llm.shutdown()
    ray.shutdown()  # leave transformers the machine, as --compare-hf does
    if part.fits("transformers", setup.hf_s):
        part.put("transformers", transformers_e2e(args, model, dtype, device, requests))
        part.put("vs_transformers", _vs(result, part.data["transformers"]))


def transformers_e2e(args: argparse.Namespace, model: str, dtype: Any, device: str,
                     requests: list[Any]) -> dict[str, Any]:
    """``--compare-hf``'s transformers pass (static cache + compile on CUDA); raypp's
    tokens are not kept by ``run_throughput``, so their agreement is not compared."""
    from raypp.bench.runner import _transformers

    try:
        hf = _transformers(args, model, dtype, device, requests, {})
    finally:
        _reset_compile()
    hf.pop("tokens_match", None)
    return hf


def _vs(result: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    from raypp.bench.engine_report import comparison

    return comparison(result, hf)


def _reset_compile() -> None:
    import torch

    torch._dynamo.reset()  # transformers' compiled static-cache forward and its graphs
    _free_cuda()


# -- families ----------------------------------------------------------------------------------
def section_families(setup: Setup, run: Run, part: Part) -> None:
    bw = bandwidth(setup, run)
    for key in setup.families:
        if not part.fits(key, setup.start_s(key) + (0 if setup.dry else 40)):
            continue
        ckpt = checkpoint(key, setup, part)
        try:
            part.put(key, family_decode(key, ckpt, setup, bw))
        finally:
            drop_checkpoint(ckpt, setup)


def family_decode(key: str, ckpt: Path, setup: Setup, bw: float) -> dict[str, Any]:
    """Defaults, batch-1 decode against the weight-read roofline."""
    cfg = _config(ckpt)
    llm, startup = start_engine(ckpt, setup)
    try:
        stages = stage_table(llm)
        warm(llm, cfg["vocab_size"])
        res = decode_run(llm.engine, 1, setup, cfg["vocab_size"], f"{key}-b1")
    finally:
        llm.shutdown()
    sb = StepBytes.of(ckpt, setup.itemsize)
    return {"model": MODELS[key].title, "startup_s": startup, "stages": stages,
            "decode_b1": with_roofline(res, sb, setup, bw)}


# -- moe ---------------------------------------------------------------------------------------
def section_moe(setup: Setup, run: Run, part: Part) -> None:
    key = "qwen3_30b_a3b"
    shape = setup.shape(key)
    part.put("layers", shape["num_hidden_layers"])
    part.put("layers_note", f"{shape['num_hidden_layers']} of Qwen3-30B-A3B's "
             f"{QWEN3_30B_A3B['num_hidden_layers']} layers (--moe-layers; all 48 are 61 GB in bf16)")
    ckpt = checkpoint(key, setup, part)
    bw = bandwidth(setup, run)
    try:
        for pp in (1, 2):
            if part.fits(f"pp{pp}", setup.start_s(key)):
                part.put(f"pp{pp}", moe_engine(ckpt, pp, setup, bw))
        if part.fits("transformers", setup.hf_s + (0 if setup.dry else 30)):  # 31 GB to load
            part.put("transformers", hf_decode(ckpt, setup, run))
    finally:
        drop_checkpoint(ckpt, setup)


def moe_engine(ckpt: Path, pp: int, setup: Setup, bw: float) -> dict[str, Any]:
    """Defaults at ``pp`` stages (both on the one GPU): decode at batch 1 and 64."""
    cfg = _config(ckpt)
    options: dict[str, Any] = {"pipeline_parallel_size": pp}
    if pp > 1 and setup.device == "cuda":
        options["workers_per_gpu"] = pp
    llm, startup = start_engine(ckpt, setup, **options)
    out: dict[str, Any] = {"options": options, "startup_s": startup}
    try:
        out["stages"] = stage_table(llm)
        log(f"moe pp={pp} stages:\n{out['stages']['text']}")
        sb = StepBytes.of(ckpt, setup.itemsize)
        warm(llm, cfg["vocab_size"])
        for batch in (1, setup.big_batch):
            res = decode_run(llm.engine, batch, setup, cfg["vocab_size"], f"moe-pp{pp}-b{batch}")
            out[f"decode_b{batch}"] = with_roofline(res, sb, setup, bw)
    finally:
        llm.shutdown()
    return out


def hf_decode(ckpt: Path, setup: Setup, run: Run) -> dict[str, Any] | str:
    """transformers ``generate`` (dynamic cache) on ``ckpt``: decode tok/s at batch 1 and
    64 from a full run minus a one-token run (``raypp.bench.hf_baseline``), if the weights
    fit the free GPU memory."""
    import ray
    import torch

    from raypp.bench.hf_baseline import load_hf_model

    ray.shutdown()  # no idle stage workers beside transformers
    need = _dir_bytes(ckpt)
    if setup.device == "cuda":
        free = _free_gpu_bytes(need / 0.85)
        if need > 0.85 * free:
            return f"skipped: {need / 2**30:.1f} GiB of weights, {free / 2**30:.1f} GiB free"
    started = time.perf_counter()
    model = load_hf_model(str(ckpt), getattr(torch, setup.dtype), setup.device)
    out: dict[str, Any] = {"load_s": round(time.perf_counter() - started, 1), "cache": "dynamic",
                           "experts_implementation": getattr(model.config, "_experts_implementation",
                                                             None)}
    try:
        for batch in (1, setup.big_batch):
            if run.left() < (5 if setup.dry else 30):
                out[f"b{batch}"] = "skipped: time"
                continue
            out[f"b{batch}"] = _hf_batch(model, batch, setup, _config(ckpt)["vocab_size"])
            log(f"transformers moe b{batch}: {out[f'b{batch}']}")
    finally:
        del model
        _free_cuda()
    return out


def _free_gpu_bytes(wanted: float, wait_s: float = 30.0) -> int:
    """Free GPU memory, waited for up to ``wait_s`` until ``wanted`` bytes are free (the
    stage workers of an engine just shut down may still be exiting)."""
    import torch

    deadline = time.monotonic() + wait_s
    while True:
        free = torch.cuda.mem_get_info()[0]
        if free >= wanted or time.monotonic() > deadline:
            return free
        time.sleep(1.0)


def _hf_batch(model: Any, batch: int, setup: Setup, vocab: int) -> dict[str, Any]:
    from raypp.bench.hf_baseline import run_hf_generate
    from raypp.bench.workload import BenchRequest

    n = 8 if setup.dry else 64  # eager transformers: a near-constant, host-bound step
    ps = random_prompts(batch, setup.prompt_len, 100 + batch, vocab)

    def seconds(tokens: int) -> float:  # each call warms up on the batch first
        return run_hf_generate(model, [BenchRequest(p, tokens) for p in ps], "dynamic", batch,
                               setup.device).elapsed_s

    first = min(seconds(1) for _ in range(2))  # prefill and the first token
    full = seconds(n)
    decode_s = full - first
    return {"output_tokens": n, "total_s": round(full, 3), "prefill_s": round(first, 3),
            "decode_tok_s": round(batch * (n - 1) / decode_s, 1) if decode_s > 0 else None}


# -- prefix --------------------------------------------------------------------------------------
def section_prefix(setup: Setup, run: Run, part: Part) -> None:
    """:mod:`benchmarks.prefix_caching`'s rounds (its ``main`` loop), results also under
    ``OUT/prefix/``."""
    from benchmarks import prefix_caching as pc
    from benchmarks.prefix_caching_driver import driver_cost

    ckpt = str(checkpoint("llama1b", setup, part))
    a = argparse.Namespace(
        num_prompts=8 if setup.dry else 64, shared_prefix_len=512 if setup.dry else 1024,
        input_len=16 if setup.dry else 64, output_len=8 if setup.dry else 64, seed=0,
        engine_args=f"--device {setup.device} --dtype {setup.dtype} --max-model-len 2048")
    sub = Run(run.out / "prefix", run.left(), {"argv": vars(a), "model": ckpt, "runs": {}},
              summaries={"summary.md": pc.summary})
    part.put("settings", vars(a))
    sub.section("driver", lambda: sub.results.update(driver=driver_cost(
        a.num_prompts, a.shared_prefix_len + a.input_len, a.output_len, 2 if setup.dry else 7)))
    part.put("driver", sub.results.get("driver"))
    for r in range(setup.prefix_rounds):
        for caching in ((True, False) if r % 2 == 0 else (False, True)):
            need = max([t for k, t in sub.results["timings_s"].items() if k != "driver"], default=0.0)
            sub.section(f"round{r}-{'on' if caching else 'off'}",
                        lambda caching=caching: pc._section(sub, a, ckpt, caching), need_s=need)
            part.put("runs", sub.results["runs"])
    part.put("errors", sub.results["errors"])
    part.put("skipped", sub.results["skipped"])
    part.put("ratios", prefix_ratios(sub.results["runs"]))
    part.put("summary_md", pc.summary(sub.results))


def prefix_ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, float | None]:
    """The two targets' ratios, medians over rounds (``None`` where a side is missing)."""
    from benchmarks.prefix_caching import _median

    def ratio(num: str, den: str, *path: str) -> float | None:
        if not runs.get(num) or not runs.get(den):
            return None
        return round(_median(runs[num], *path) / _median(runs[den], *path), 4)

    return {"ttft_p50_off_over_on": ratio("shared/off", "shared/on", "ttft_ms", "p50"),
            "no_shared_throughput_on_over_off": ratio("no_shared/on", "no_shared/off",
                                                      "output_tokens_per_s")}


# -- async_k32 -----------------------------------------------------------------------------------
def section_async(setup: Setup, run: Run, part: Part) -> None:
    """Batch 1, k=32, asynchronous scheduling on vs off on :mod:`benchmarks.gpu.decode`'s
    engine, in alternating order, after one k=1 run (run 11's order)."""
    from benchmarks.gpu.decode_engine import _llm, _set_rounds
    from benchmarks.gpu.decode_workload import BATCHES

    ckpt = checkpoint("llama1b", setup, part)
    vocab = _config(ckpt)["vocab_size"]
    n = 48 if setup.dry else setup.output_len
    started = time.perf_counter()
    llm = _llm(ckpt, setup.dtype, setup.big_batch if setup.dry else max(BATCHES), 32,
               device=setup.device)
    part.put("startup_s", round(time.perf_counter() - started, 1))
    runs: list[dict[str, Any]] = []
    try:
        engine = llm.engine
        warm(llm, vocab)
        _set_rounds(engine, num_decode_steps=1)
        part.put("k1_before", decode_run(engine, 1, setup, vocab, "async-k1", n))
        _set_rounds(engine, num_decode_steps=32)
        for rep in range(setup.async_reps):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                if run.left() < (3 if setup.dry else 10):
                    break
                _set_rounds(engine, async_scheduling=on)
                res = decode_run(engine, 1, setup, vocab, f"async-{'on' if on else 'off'}{rep}", n)
                runs.append({"rep": rep, "async": on, **res})
                part.put("runs", runs)
        _set_rounds(engine, async_scheduling=True)
    finally:
        llm.shutdown()
    part.put("ratios", async_ratios(runs))


def async_ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of on and off, and of each repetition's on / off."""
    on = {r["rep"]: r["decode_tok_s"] for r in runs if r["async"]}
    off = {r["rep"]: r["decode_tok_s"] for r in runs if not r["async"]}
    pairs = [round(on[k] / off[k], 4) for k in sorted(on) if k in off]
    return {"on_tok_s": sorted(on.values()), "off_tok_s": sorted(off.values()),
            "on_median": round(statistics.median(on.values()), 1) if on else None,
            "off_median": round(statistics.median(off.values()), 1) if off else None,
            "pair_ratios": pairs,
            "median_ratio": round(statistics.median(pairs), 4) if pairs else None}


# -- summary.md --------------------------------------------------------------------------------
Row = tuple[str, str, str, str]  # figure, target, measured, met


def _get(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _met(value: float | None, target: float) -> str:
    return "not measured" if value is None else ("yes" if value >= target else "no")


def _rows_defaults(name: str, r: dict[str, Any]) -> list[Row]:
    size = name.split("_")[1].upper()
    tuned = _get(r, "tuned") or {}
    best = max([v["decode_tok_s"] for k, v in tuned.items()  # b1, b1_k8, b1_k32, b1_k64
                if (k == "b1" or k.startswith("b1_k")) and not k.endswith("_sync")
                and isinstance(v, dict) and "decode_tok_s" in v] or [0.0]) or None
    b1 = _get(r, "decode_b1", "decode_tok_s")
    frac = b1 / best if b1 and best else None
    e2e = _get(r, "vs_transformers", "output_tokens_per_s", "ratio")
    rows = [(f"{size} batch-1 decode, defaults / best tuned (decode.py)", f"≥ {_pct(B1_VS_TUNED)}",
             f"{b1} / {best} tok/s = {100 * frac:.1f} %" if frac else "-", _met(frac, B1_VS_TUNED)),
            (f"{size} 64 × (512 + 256) end to end, defaults / transformers static",
             f"≥ {E2E_VS_HF:.0f}×", f"{e2e:.2f}×" if e2e else "-", _met(e2e, E2E_VS_HF))]
    if name == "defaults_8b":  # the largest batch: 64 (4 in a dry run)
        big = max((k for k in r if k.startswith("decode_b")), key=lambda k: int(k[8:]),
                  default="decode_b64")
        frac64 = _get(r, big, "roofline_fraction")
        rows.append(("8B batch-64 decode, defaults / weights + KV roofline", f"≥ {_pct(B64_ROOFLINE)}",
                     f"{_get(r, big, 'decode_tok_s')} tok/s = {100 * frac64:.1f} %" if frac64
                     else "-", _met(frac64, B64_ROOFLINE)))
    return rows


def _rows_families(r: dict[str, Any], selected: tuple[str, ...]) -> list[Row]:
    rows = []
    for key in (k for k in FAMILIES if k in r or k in selected):
        frac = _get(r, key, "decode_b1", "roofline_fraction")
        tok = _get(r, key, "decode_b1", "decode_tok_s")
        rows.append((f"{MODELS[key].title} batch-1 decode, defaults / weight-read roofline",
                     f"≥ {_pct(FAMILY_ROOFLINE)}", f"{tok} tok/s = {100 * frac:.1f} %" if frac else "-",
                     _met(frac, FAMILY_ROOFLINE)))
    return rows


def _rows_moe(r: dict[str, Any]) -> list[Row]:
    rows = []
    for pp in (1, 2):
        runs = _get(r, f"pp{pp}") or {}
        keys = sorted((k for k in runs if k.startswith("decode_b")), key=lambda k: int(k[8:]))
        for key in keys or ["decode_b1"]:
            tok = _get(runs, key, "decode_tok_s")
            hf = _get(r, "transformers", key[len("decode_"):], "decode_tok_s")
            vs = f", {tok / hf:.2f}× transformers ({hf})" if tok and hf else ""
            rows.append((f"Qwen3-30B-A3B shape, {r.get('layers')} of 48 layers: pp={pp} "
                         f"batch-{key[8:]} decode, defaults",
                         "none (vs transformers)", f"{tok} tok/s{vs}" if tok else "-",
                         "n/a" if tok else "not measured"))
    return rows


def _rows_prefix(r: dict[str, Any]) -> list[Row]:
    ttft = _get(r, "ratios", "ttft_p50_off_over_on")
    tput = _get(r, "ratios", "no_shared_throughput_on_over_off")
    return [("shared prefix: TTFT p50 caching off / on", f"≥ {PREFIX_TTFT:.0f}×",
             f"{ttft:.2f}×" if ttft else "-", _met(ttft, PREFIX_TTFT)),
            ("0 % hits: output tok/s caching on / off", f"≥ {_pct(PREFIX_NO_HIT)}",
             f"{tput:.3f}" if tput else "-", _met(tput, PREFIX_NO_HIT))]


def _rows_async(r: dict[str, Any]) -> list[Row]:
    ratio = _get(r, "ratios", "median_ratio")
    on, off = _get(r, "ratios", "on_median"), _get(r, "ratios", "off_median")
    return [("1B batch-1 k=32: async scheduling on / off (median of pairs)",
             f"≥ {_pct(ASYNC_VS_SYNC)}", f"{on} / {off} tok/s, {ratio:.3f}" if ratio else "-",
             _met(ratio, ASYNC_VS_SYNC))]


def summary(results: dict[str, Any]) -> str:
    rows: list[Row] = []
    for name in ("defaults_1b", "defaults_8b"):
        if name in results:
            rows += _rows_defaults(name, results[name])
    if "families" in results:
        rows += _rows_families(results["families"], tuple(_get(results, "settings", "families")
                                                          or FAMILIES))
    if "moe" in results:
        rows += _rows_moe(results["moe"])
    if "prefix" in results:
        rows += _rows_prefix(results["prefix"])
    if "async_k32" in results:
        rows += _rows_async(results["async_k32"])
    dry = " (DRY RUN: CPU, tiny shapes; the figures mean nothing)" if _get(
        results, "settings", "dry_run") else ""
    env = results.get("env") or {}
    bw = _get(results, "bandwidth", "copy_GBps")
    lines = [f"# Issue 35: GPU targets{dry}", "",
             (f"{env.get('gpu', 'no GPU')}; commit {env.get('commit')}; copy bandwidth "
              + (f"{bw:.0f} GB/s" if bw else "not measured in this call")) if env
             else "Merged from the section files of this folder (--summarize).", "",
             "| figure | target | measured | met |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    earlier = results.get("earlier_calls") or {}
    if earlier:
        lines += ["", "From earlier calls into this folder: " + "; ".join(
            f"{name} ({doc.get('gpu') or 'no GPU'}, commit {doc.get('commit')}"
            f"{', FAILED: see its error' if doc.get('error') else ''})"
            for name, doc in earlier.items())]
    if results.get("errors"):
        lines += ["", "errors in: " + ", ".join(results["errors"])]
    if results.get("skipped"):
        lines += ["", "skipped: " + "; ".join(results["skipped"])]
    return "\n".join(lines) + "\n"


# -- main ----------------------------------------------------------------------------------------
def _commit() -> dict[str, Any]:
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty_files": len(git("status", "--porcelain").splitlines())}


def section_files(out: Path, skip: list[str] | None) -> dict[str, Any]:
    """The results of the sections (but ``skip``) that ``out`` holds a ``<name>.json`` of,
    and under ``"earlier_calls"`` where each came from."""
    found: dict[str, Any] = {}
    earlier: dict[str, Any] = {}
    for name in SECTIONS:
        path = out / f"{name}.json"
        if name in (skip or ()) or not path.is_file():
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found[name] = doc.get("result") or {}
        env = doc.get("env") or {}
        earlier[name] = {"gpu": env.get("gpu"), "commit": env.get("commit"),
                         "error": doc.get("error"), "timing_s": doc.get("timing_s")}
    return {**found, "earlier_calls": earlier} if found else {}


def build_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.debt_targets",
                                 description=__doc__.split("\n\n")[0])
    add_run_args(ap, out_default=None, budget_s=540.0, sections=True)
    ap.add_argument("--ckpt-root", default=None,
                    help="checkpoints folder (default /tmp/raypp_debt, dry run /tmp/raypp_debt_dry)")
    ap.add_argument("--moe-layers", type=int, default=24, help="layers of the MoE checkpoint (of 48)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="the families section's models")
    ap.add_argument("--prefix-rounds", type=int, default=2, help="prefix caching on/off pairs")
    ap.add_argument("--async-reps", type=int, default=6, help="async on/off pairs at k=32")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep the 8B, family and MoE checkpoints after their sections")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, fp32, few tokens")
    ap.add_argument("--summarize", action="store_true",
                    help="run nothing: write OUT/summary.md from the <section>.json files in OUT")
    return ap


def _setup(args: argparse.Namespace) -> Setup:
    families = tuple(parse_sections(args.families) or ())
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown --families {unknown}; known: {', '.join(FAMILIES)}")
    root = Path(args.ckpt_root or ("/tmp/raypp_debt_dry" if args.dry_run else "/tmp/raypp_debt"))
    root.mkdir(parents=True, exist_ok=True)
    return Setup(dry=args.dry_run, root=root, keep=args.keep_checkpoints, moe_layers=args.moe_layers,
                 families=families, prefix_rounds=args.prefix_rounds, async_reps=args.async_reps)


def _sections(setup: Setup) -> dict[str, Callable[[Run, Part], None]]:
    return {
        "defaults_1b": lambda run, part: section_defaults("llama1b", setup, run, part),
        "defaults_8b": lambda run, part: section_defaults("llama8b", setup, run, part),
        "families": lambda run, part: section_families(setup, run, part),
        "moe": lambda run, part: section_moe(setup, run, part),
        "prefix": lambda run, part: section_prefix(setup, run, part),
        "async_k32": lambda run, part: section_async(setup, run, part),
    }


def _run_section(run: Run, name: str, fn: Callable[[Run, Part], None], need_s: float) -> None:
    """``fn`` as :meth:`Run.section` ``name``; its ``OUT/<name>.json`` is written only if it
    began (one skipped for time leaves an earlier call's file alone)."""
    made: list[Part] = []

    def body() -> None:
        made.append(Part(run, name))
        fn(run, made[0])

    run.section(name, body, need_s)
    for part in made:
        part.flush()  # now with the section's error and time


def main(argv: list[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    only = parse_sections(args.sections)
    unknown = [s for s in only or () if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    if args.summarize:  # e.g. after copying several device calls' files into one folder
        text = summary(section_files(Path(args.out), None))
        (Path(args.out) / "summary.md").write_text(text)
        print(text, flush=True)
        return
    setup = _setup(args)
    run = Run(Path(args.out), args.budget_s, cleanup=_free_cuda, summaries={"summary.md": summary})
    run.results["settings"] = {**{k: str(v) if isinstance(v, Path) else v
                                  for k, v in vars(setup).items()}, "dry_run": setup.dry,
                               "sections": only or list(SECTIONS), "budget_s": args.budget_s}
    run.results["env"] = {**machine_info(setup.device), **software_versions(), **_commit(),
                          **({} if setup.dry else cuda_card())}
    if only is not None:  # what earlier calls into this folder measured, for summary.md
        run.results.update(section_files(run.out, only))
    sections = _sections(setup)
    for name in only or SECTIONS:  # in the order --sections names them
        _run_section(run, name, sections[name], 10.0 if setup.dry else NEED_S[name])
    run.results["wall_s"] = round(run.elapsed(), 1)
    run.save()
    print("\n" + summary(run.results), flush=True)


if __name__ == "__main__":
    main()
