"""One-call multi-GPU benchmark suites for issues 8 (PP=2) and 9 (TP × PP).

    python -m benchmarks.gpu.multi_gpu --suite pp2|tp2pp2 --out DIR [--device cuda|cpu]
        [--model DIR | --make-model tiny|small|1b|8b] [--budget-s S]

Everything lands in ``DIR`` (flat, at most 4 files, so it all comes back from a
device call): ``results.json`` (rewritten after every section), ``summary.md``,
and one pipeline timeline as ``timeline_*.png`` + ``timeline_*.json`` (Chrome trace).

``--suite pp2`` (issue 8, 2 GPUs):

1. correctness: PP=2 greedy tokens == PP=1 on the same checkpoint, with
   ``RAYPP_USE_RAY_WRAPPED_PP_COMM=1`` and ``=0``; fp32 exact on the check model,
   bf16 within tolerance (top-5 logprobs) on the main model;
2. communicators: per worker process, the NCCL communicators NCCL itself reports
   (``NCCL_DEBUG=INFO`` "Init COMPLETE" lines in the Ray worker logs, by pid; CUDA
   only), the torch.distributed process groups, the communicators Ray's channels
   use and any Ray created for the graph; GPU memory in use after start-up;
3. hop latency: a compiled-graph hop carrying decode- and prefill-sized tensors,
   RayPPCommunicator vs Ray's own transport vs raw torch.distributed send/recv
   between the same two processes (and a one-stage graph as the fixed cost);
4. throughput (``raypp bench throughput``'s runner): PP=2 at max_inflight 1 and 2,
   wrapped and native, plus the PP=1 baseline; one timeline (PP=2, wrapped, 2 in flight).

``--suite tp2pp2`` (issue 9, 4 GPUs): (tp, pp) = (2, 2), (1, 4), (4, 1) equal
(1, 1) (fp32 exact, bf16 within tolerance), communicator counts per worker, and
throughput with ``max_inflight = pp`` plus the (2, 2) timeline.

Each section records its errors and the script carries on; sections that would
not fit ``--budget-s`` are skipped and listed. ``--device cpu`` runs the same
code over gloo with tiny models (the CPU dry run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import random
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from raypp.bench.report import summarize

# -- what each suite runs ---------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """One engine layout; ``wrapped`` picks RAYPP_USE_RAY_WRAPPED_PP_COMM."""

    tp: int
    pp: int
    wrapped: bool = True
    inflight: int | None = None  # default: pp

    @property
    def max_inflight(self) -> int:
        return self.inflight or self.pp

    @property
    def name(self) -> str:
        comm = "" if self.pp == 1 else ("_wrapped" if self.wrapped else "_native")
        return f"tp{self.tp}pp{self.pp}{comm}_inflight{self.max_inflight}"


REFERENCE = Layout(1, 1)
SUITES: dict[str, dict[str, Any]] = {
    "pp2": {
        "gpus": 2,
        "check": [Layout(1, 2, True), Layout(1, 2, False)],
        # bf16 engines: each checks against the reference, then runs the throughput bench
        "bench": [REFERENCE, Layout(1, 2, True, 2), Layout(1, 2, False, 2),
                  Layout(1, 2, True, 1), Layout(1, 2, False, 1)],
        "timeline": Layout(1, 2, True, 2),
        "hop": True,
    },
    "tp2pp2": {
        "gpus": 4,
        "check": [Layout(2, 2), Layout(1, 4), Layout(4, 1)],
        "bench": [REFERENCE, Layout(2, 2), Layout(1, 4), Layout(4, 1)],
        "timeline": Layout(2, 2),
        "hop": False,
    },
}

# Model shapes. "tiny"/"small" use raypp.testing's sharp random init on the CPU (BPE
# tokenizer); "1b"/"8b" are Llama-3.2-1B / Llama-3-8B shapes built on the GPU with
# the same init recipe (so greedy argmaxes are decisive, not near-ties).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": dict(hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                  num_kv_heads=8, max_position_embeddings=2048),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, max_position_embeddings=2048, rope_theta=500000.0,
               tie_word_embeddings=True),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, max_position_embeddings=2048, rope_theta=500000.0,
               tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Workload:
    """Sizes that differ between the GPU run and the CPU dry run."""

    check_prompt_lens: tuple[int, ...]
    check_tokens: int
    num_prompts: int
    input_len: int
    output_len: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    hop_hidden: int
    hop_rows: tuple[int, ...]
    hop_steps: int
    hop_warmup: int


CUDA_WORKLOAD = Workload((7, 64, 200, 512), 32, 64, 128, 128, 1024, 64, 4096,
                         4096, (1, 64, 8192), 200, 30)
CPU_WORKLOAD = Workload((3, 9, 17), 6, 8, 8, 8, 64, 8, 256, 256, (1, 64, 512), 20, 3)
BF16_TOLERANCE = 0.15  # nats: |Δ logprob| of a token both runs rank, and a tie's width
LOGPROBS = 5


# -- the run: sections under one time budget ----------------------------------------------------
class Run:
    """Results, output folder and deadline of one suite run."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + args.budget_s
        work = CUDA_WORKLOAD if args.device == "cuda" else CPU_WORKLOAD
        if args.hop_steps:
            work = replace(work, hop_steps=args.hop_steps,
                           hop_warmup=min(work.hop_warmup, args.hop_steps))
        self.work = work
        self.results: dict[str, Any] = {
            "suite": args.suite, "device": args.device,
            "kind": "GPU run" if args.device == "cuda" else "CPU dry run (gloo, not a GPU result)",
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.gpu.multi_gpu",
                                 *sys.argv[1:]]),
            "errors": {}, "skipped": [], "timings_s": {},
            "engines": {}, "correctness": {}, "hop": None, "throughput": {},
        }

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        """Rewrite results.json and summary.md (so a run cut short still reports)."""
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        try:
            (self.out / "summary.md").write_text(summary_markdown(self.results))
        except Exception as e:  # noqa: BLE001 - a partial result must not stop the run
            log(f"!! summary: {type(e).__name__}: {e}")

    def section(self, name: str, fn: Callable[[], Any], need_s: float = 0.0) -> Any:
        """Run ``fn``; record its error instead of raising; skip it when time is short
        or when ``--only`` does not select it."""
        only = [x.strip() for x in (self.args.only or "").split(",") if x.strip()]
        if only and "model" not in name and not any(x in name for x in only):
            self.results["skipped"].append(f"{name}: not selected by --only")
            return None
        if self.left() < need_s:
            self.results["skipped"].append(f"{name}: {self.left():.0f} s left, needs ~{need_s:.0f}")
            log(f"== {name}: skipped ({self.left():.0f} s left)")
            self.save()
            return None
        log(f"== {name} ({self.left():.0f} s left)")
        started = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - record and go on with the next section
            self.results["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            log(f"!! {name} failed: {type(e).__name__}: {e}")
            return None
        finally:
            self.results["timings_s"][name] = round(time.perf_counter() - started, 1)
            gc.collect()
            self.save()


def machine_info(device: str) -> dict[str, Any]:
    """CPUs, and on CUDA the GPUs (nvidia-smi; the driver never touches CUDA itself), their
    topology and the NCCL / multicast settings in force."""
    import subprocess

    info: dict[str, Any] = {"cpus": os.cpu_count()}
    if device != "cuda":
        return info
    for key, cmd in (("gpus", ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                               "--format=csv,noheader"]), ("topology", ["nvidia-smi", "topo", "-m"])):
        try:
            info[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            info[key] = f"{type(e).__name__}: {e}"
    info["env"] = {k: v for k, v in os.environ.items()
                   if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM_", "CUDA_VISIBLE"))}
    return info


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def env(**values: str | None) -> Iterator[None]:
    """Set (or, for None, unset) environment variables inside the block."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- checkpoints --------------------------------------------------------------------------------
def model_dir(spec: str | None, size: str, device: str, root: Path) -> Path:
    """``spec`` if given, else a checkpoint of ``size`` under ``root`` (built once, reused)."""
    if spec:
        return Path(spec)
    path = root / f"raypp-multi-gpu-{size}"
    if (path / "config.json").is_file():
        return path
    if size in ("1b", "8b") and device != "cuda":
        raise ValueError(f"--make-model {size} is built on a GPU; use tiny or small on CPU")
    log(f"building the {size} checkpoint in {path}")
    # in a child process: the driver must not hold a CUDA context on a stage's GPU
    proc = multiprocessing.get_context("spawn").Process(target=build_checkpoint,
                                                        args=(size, str(path)))
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not (path / "config.json").is_file():
        raise RuntimeError(f"building the {size} checkpoint failed (exit {proc.exitcode})")
    return path


def build_checkpoint(size: str, path: str) -> None:
    """Write a random-weight Llama checkpoint of ``size`` (see ``SHAPES``) to ``path``."""
    from raypp.testing.tiny_model import make_tiny_model

    if size in ("tiny", "small"):
        make_tiny_model(path, architecture="llama", seed=0, **SHAPES[size])
    else:
        _build_large(SHAPES[size], Path(path))


def _build_large(shape: dict[str, Any], path: Path, shard_bytes: int = 4 << 30) -> None:
    """Sharded bf16 safetensors drawn (on the GPU when there is one) with raypp.testing's
    init recipe; each shard is written as soon as it is full."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from benchmarks.gpu.decode import _word_tokenizer

    config = transformers.LlamaConfig(**shape, rms_norm_eps=1e-5, bos_token_id=0,
                                      eos_token_id=1, pad_token_id=2, dtype="bfloat16")
    with torch.device("meta"):
        names = [(n, tuple(p.shape)) for n, p in transformers.LlamaForCausalLM(config)
                 .named_parameters()]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    index: dict[str, str] = {}
    shard: dict[str, Any] = {}
    total = 0

    def flush() -> None:
        fname = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        index.update({n: fname for n in shard})
        shard.clear()

    for name, dims in names:
        x = torch.randn(dims, generator=gen, device=device, dtype=torch.float32)
        if "norm" in name:
            x = 1 + 0.1 * x
        elif "embed_tokens" not in name:  # lm_head 4× sharper: fewer bf16 near-ties
            x *= (6.0 if name == "lm_head.weight" else 1.5) / dims[-1] ** 0.5
        t = x.to(torch.bfloat16).cpu()
        if shard and sum(v.nbytes for v in shard.values()) + t.nbytes > shard_bytes:
            flush()
        shard[name] = t
        total += t.nbytes
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}))
    _word_tokenizer(shape["vocab_size"]).save_pretrained(path)


def check_prompts(work: Workload, vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in work.check_prompt_lens]


# -- engines and what we read from them ---------------------------------------------------------
def start_ray(device: str) -> None:
    """A private local cluster (unless one is up; Ray counts the GPUs), with NCCL's INIT
    logging on CUDA."""
    import ray

    if ray.is_initialized():
        return
    if device == "cuda":  # inherited by the raylet and so by every worker
        os.environ.setdefault("NCCL_DEBUG", "INFO")
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2),
             num_gpus=None if device == "cuda" else 0, object_store_memory=512 * 2**20,
             include_dashboard=False, log_to_driver=False)


def make_llm(args: argparse.Namespace, work: Workload, model: Path, layout: Layout,
             dtype: str, eager: bool = False, trace_comm: bool = False) -> Any:
    from raypp import LLM

    extra: dict[str, Any] = {}
    if args.device == "cuda":
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        extra["kv_cache_memory_bytes"] = 64 * 2**20
    overrides = {"RAYPP_USE_RAY_WRAPPED_PP_COMM": "1" if layout.wrapped else "0",
                 "RAYPP_TRACE_COMM": "1" if trace_comm else None}
    if eager:
        overrides["RAYPP_ENFORCE_EAGER"] = "1"
    if args.compile_decode is not None:
        overrides["RAYPP_COMPILE_DECODE"] = args.compile_decode
    with env(**overrides):
        return LLM(str(model), pipeline_parallel_size=layout.pp,
                   tensor_parallel_size=layout.tp, dtype=dtype, device=args.device,
                   max_model_len=work.max_model_len, max_num_seqs=work.max_num_seqs,
                   max_num_batched_tokens=work.max_num_batched_tokens,
                   max_inflight=layout.max_inflight, **extra)


def _worker_probe(worker: Any) -> dict[str, Any]:
    """Runs inside a stage actor: pid, process groups, channel communicators, memory."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    groups = []
    if dist.is_initialized():
        for pg, (backend, _store) in list(c10d._world.pg_map.items()):
            ranks = c10d._world.pg_group_ranks.get(pg, {})
            groups.append({"backend": str(backend), "ranks": sorted(ranks)})
    mem: dict[str, Any]
    if torch.cuda.is_available() and worker.device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        mem = {"gpu_used_gib": round((total - free) / 2**30, 3),
               "torch_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
               "torch_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 3)}
    else:
        rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
        mem = {"rss_gib": round(rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 3)}
    return {"pp_rank": worker.pp_rank, "tp_rank": worker.tp_rank, "pid": os.getpid(),
            "process_groups": groups, "channel_communicators": worker.channel_communicators(),
            "memory": mem}


def probe_workers(llm: Any) -> list[dict[str, Any]]:
    import ray

    executor = llm.engine.executor
    return ray.get([w.__ray_call__.remote(_worker_probe) for w in executor.all_workers],
                   timeout=120)


# "host:pid:tid [dev] NCCL INFO [caller] comm 0x.. rank 0 nranks 2 ... commId 0x.. - Init COMPLETE"
_NCCL_PREFIX = re.compile(r"(\S+):(\d+):\d+ \[\d+\] NCCL INFO ")
_NCCL_FIELDS = {k: re.compile(p, re.IGNORECASE) for k, p in (
    ("comm", r"\bcomm (0x[0-9a-f]+)"), ("rank", r"\brank (\d+)"),
    ("nranks", r"\bnranks (\d+)"), ("comm_id", r"\bcommId (0x[0-9a-f]+)"))}


def ray_logs_dir() -> Path:
    try:
        import ray._private.worker as ray_worker

        return Path(ray_worker._global_node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 - fall back to Ray's default location
        return Path("/tmp/ray/session_latest/logs")


def nccl_inits(pids: list[int], logs: Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """pid → the NCCL communicators whose init completed in that process, read from the
    "Init COMPLETE" lines (``NCCL_DEBUG=INFO``) in the Ray worker logs."""
    logs = logs or ray_logs_dir()
    wanted = {str(p) for p in pids}
    found: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in wanted}
    for path in sorted(logs.glob("worker-*")):
        if not path.name.endswith((".out", ".err")):
            continue
        with contextlib.suppress(OSError), path.open(errors="replace") as f:
            for number, line in enumerate(f):
                prefix = _NCCL_PREFIX.search(line)
                if "Init COMPLETE" not in line or not prefix or prefix.group(2) not in wanted:
                    continue
                fields = {k: m.group(1) for k, p in _NCCL_FIELDS.items()
                          if (m := p.search(line, prefix.end()))}
                for k in ("rank", "nranks"):
                    if k in fields:
                        fields[k] = int(fields[k])
                key = fields.get("comm") or f"{path.name}:{number}"
                found[prefix.group(2)][key] = fields
    return {pid: list(comms.values()) for pid, comms in found.items()}


def comm_report(llm: Any, device: str, stage: str) -> dict[str, Any]:
    """What communicators exist right now: per worker, and in the compiled graph."""
    executor = llm.engine.executor
    workers = probe_workers(llm)
    report: dict[str, Any] = {"when": stage, "graph": executor.graph_communicators(),
                              "workers": workers}
    if device == "cuda":
        inits = nccl_inits([w["pid"] for w in workers])
        for w in workers:
            w["nccl_comms"] = inits[str(w["pid"])]
        report["nccl_comms_per_worker"] = [len(w["nccl_comms"]) for w in workers]
        report["nccl_distinct_comm_ids"] = len({c["comm_id"] for w in workers
                                                for c in w["nccl_comms"]})
    else:  # gloo: every torch.distributed group is a communicator
        report["gloo_groups_per_worker"] = [
            sum(g["backend"] == "gloo" for g in w["process_groups"]) for w in workers]
    return report


def shutdown(llm: Any) -> None:
    """Shut the engine down and wait until its worker processes are gone (GPU memory free)."""
    pids = []
    with contextlib.suppress(Exception):
        pids = [w["pid"] for w in probe_workers(llm)]
    llm.shutdown()
    deadline = time.time() + 30
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)


# -- correctness --------------------------------------------------------------------------------
def generate_check(llm: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Greedy tokens and top-``LOGPROBS`` logprobs per generated position."""
    from raypp import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            logprobs=LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[{int(t): lp.logprob for t, lp in pos.items()}
                          for pos in o.outputs[0].logprobs] for o in outs]}


def compare(ref: dict[str, Any], got: dict[str, Any], exact: bool,
            tol: float = BF16_TOLERANCE) -> dict[str, Any]:
    """Tokens equal (``exact``), or equal up to near-ties with logprobs within ``tol``.

    Before the first differing token, every token both runs rank in their top-k
    must have logprobs within ``tol``; at a differing token, the reference must
    rank the other run's token within ``tol`` of its own (a near-tie).
    """
    first_diff, max_diff, ties = [], 0.0, []
    for ref_t, got_t, ref_lp, got_lp in zip(ref["tokens"], got["tokens"], ref["logprobs"],
                                           got["logprobs"], strict=True):
        d = next((i for i, (a, b) in enumerate(zip(ref_t, got_t)) if a != b),
                 None if len(ref_t) == len(got_t) else min(len(ref_t), len(got_t)))
        first_diff.append(d)
        for i in range(len(ref_t) if d is None else d):
            common = ref_lp[i].keys() & got_lp[i].keys()
            max_diff = max([max_diff, *(abs(ref_lp[i][t] - got_lp[i][t]) for t in common)])
        if d is not None and d < min(len(ref_t), len(got_t)):
            own = ref_lp[d].get(ref_t[d], float("nan"))
            other = ref_lp[d].get(got_t[d])
            ties.append(float("inf") if other is None else own - other)
    equal = all(d is None for d in first_diff)
    ok = equal if exact else (max_diff <= tol and all(g <= tol for g in ties))
    return {"equal": equal, "ok": ok, "first_diff": first_diff,
            "max_abs_logprob_diff": round(max_diff, 6),
            "tie_gaps": [round(g, 4) for g in ties], "tolerance": None if exact else tol}


# -- sections -----------------------------------------------------------------------------------
def correctness_fp32(run: Run, model: Path, layouts: list[Layout]) -> None:
    """fp32, eager (no CUDA graphs: a short run): each layout against (1, 1)."""
    work, res = run.work, run.results["correctness"]
    prompts = None
    ref = None
    for layout in [REFERENCE, *layouts]:
        def one(layout: Layout = layout) -> None:
            nonlocal prompts, ref
            llm = make_llm(run.args, work, model, layout, "float32", eager=True)
            try:
                if prompts is None:
                    prompts = check_prompts(work, llm.engine.config.model.vocab_size)
                started = comm_report(llm, run.args.device, "after start-up")
                out = generate_check(llm, prompts, work.check_tokens)
                entry = {"layout": layout.name, "dtype": "float32",
                         "tokens": out["tokens"],
                         "communicators": [started, comm_report(llm, run.args.device,
                                                                "after generation")]}
                if layout == REFERENCE:
                    ref = out
                elif ref is not None:
                    entry["vs_reference"] = compare(ref, out, exact=True)
                res[f"fp32/{layout.name}"] = entry
            finally:
                shutdown(llm)
        run.section(f"correctness fp32 {layout.name}", one, need_s=30)


def engine_bench(run: Run, model: Path, layout: Layout, timeline: bool,
                 refs: dict[str, Any]) -> None:
    """One bf16 engine: start-up state, bf16 check against (1, 1), throughput, state after.

    Fills ``run.results["engines"][layout.name]`` as it goes (partial results survive
    an error); the reference layout's check output goes to ``refs["bf16"]``.
    """
    from raypp.bench.runner import run_throughput
    from raypp.entrypoints.cli import build_parser

    work, args = run.work, run.args
    info: dict[str, Any] = {"layout": layout.name, "tp": layout.tp, "pp": layout.pp,
                            "dtype": args.dtype}
    run.results["engines"][layout.name] = info
    started = time.perf_counter()
    llm = make_llm(args, work, model, layout, args.dtype, trace_comm=timeline)
    try:
        info["startup_s"] = round(time.perf_counter() - started, 1)
        info["num_kv_blocks"] = llm.engine.executor.num_kv_blocks
        info["communicators"] = [comm_report(llm, args.device, "after start-up")]
        prompts = check_prompts(work, llm.engine.config.model.vocab_size)
        out = generate_check(llm, prompts, work.check_tokens)
        info["check_tokens"] = out["tokens"]
        if layout == REFERENCE:
            refs["bf16"] = out
        elif "bf16" in refs:
            info["vs_reference"] = compare(refs["bf16"], out, exact=False)
        argv = ["bench", "throughput", "--num-prompts", str(work.num_prompts),
                "--input-len", str(work.input_len), "--output-len", str(work.output_len),
                "--num-warmup", "2", "--no-progress"]
        if timeline:
            argv += ["--timeline", str(run.out / f"timeline_{layout.name}")]
        tp = run_throughput(build_parser().parse_args(argv), llm=llm)
        tp.pop("context", None)
        tp["stage_bound"] = stage_bound(tp)
        info["throughput"] = tp
        info["communicators"].append(comm_report(llm, args.device, "after the benchmark"))
        log(f"   {layout.name}: {tp['output_tokens_per_s']:.1f} output tok/s, "
            f"{tp['mean_step_ms']:.2f} ms/step, start-up {info['startup_s']} s, "
            f"vs (1,1): {info.get('vs_reference', {}).get('ok', '-')}")
    finally:
        shutdown(llm)


def stage_bound(tp: dict[str, Any]) -> dict[str, Any]:
    """Throughput if the slowest stage never idled: steps × its mean micro-batch time."""
    means = [s["mean"] for s in tp.get("stage_compute_ms", [])]
    if not means or not tp.get("engine_steps"):
        return {}
    ideal_s = tp["engine_steps"] * max(means) / 1e3
    ideal = tp["num_output_tokens"] / ideal_s if ideal_s > 0 else float("nan")
    return {"ideal_output_tokens_per_s": round(ideal, 2),
            "share_of_ideal": round(tp["output_tokens_per_s"] / ideal, 4) if ideal else None,
            "slowest_stage_mean_ms": max(means)}


def bench_engines(run: Run, model: Path, layouts: list[Layout], timeline: Layout) -> None:
    refs: dict[str, Any] = {}
    need = 60 if run.args.device == "cuda" else 10
    for layout in layouts:
        run.section(f"engine {layout.name}",
                    lambda layout=layout: engine_bench(run, model, layout, layout == timeline,
                                                       refs), need_s=need)


# -- hop latency ---------------------------------------------------------------------------------
def _hop_dag(stages: list[Any], transport: Any, buffer_bytes: int) -> Any:
    from ray.dag import InputNode

    with InputNode() as inp:
        if len(stages) == 1:
            node = stages[0].only.bind(inp)
        else:
            node = stages[0].first.bind(inp)
            if transport is not None:
                node = node.with_tensor_transport(transport=transport)
            node = stages[1].last.bind(node)
    return node.experimental_compile(_buffer_size_bytes=buffer_bytes,
                                     _max_inflight_executions=2)


def _ms(times: list[float]) -> dict[str, float]:
    s = summarize(times)
    return {"p50_ms": round(1e3 * s["p50"], 4), "p90_ms": round(1e3 * s["p90"], 4),
            "mean_ms": round(1e3 * s["mean"], 4), "n": s["n"]}


def hop_latency(run: Run) -> dict[str, Any]:
    """Per-step time of a 1-hop graph per transport, the 1-stage graph, raw send/recv."""
    import ray

    from raypp import envs
    from raypp.bench.hop import _time_steps
    from raypp.distributed.ray_communicator import RayPPCommunicator

    work, device = run.work, run.args.device
    env_vars = {k: v for k, v in os.environ.items() if k.startswith(("RAYPP_", "RAY_CGRAPH_"))}
    env_vars["RAYPP_TRACE_COMM"] = "1"  # send/recv intervals inside RayPPCommunicator
    from raypp.bench.hop import HopStage

    actor = ray.remote(num_cpus=0, num_gpus=1 if device == "cuda" else 0)(HopStage)
    stages = [actor.options(runtime_env={"env_vars": env_vars}).remote(
        r, 2, work.hop_hidden, device, "bfloat16") for r in range(2)]
    result: dict[str, Any] = {"hidden": work.hop_hidden, "dtype": "bfloat16",
                              "steps": work.hop_steps, "warmup": work.hop_warmup, "rows": {},
                              "errors": {}}
    try:
        pids = ray.get([s.pid.remote() for s in stages], timeout=300)
        init = ray.get(stages[0].rendezvous_address.remote())
        ray.get([s.init_group.remote(init, envs.RAYPP_DIST_TIMEOUT_S) for s in stages],
                timeout=300)
        item = 2  # bf16
        biggest = max(work.hop_rows) * work.hop_hidden * item
        buffer_bytes = 8_000_000 if device == "cuda" else max(8_000_000, 2 * biggest + 2**20)
        native = "accelerator" if device == "cuda" else "shm"
        for label, transport in (("wrapped", RayPPCommunicator(stages)), ("raw", None),
                                 ("native", native), ("one_stage", None)):
            try:
                result["rows"][label] = _hop_rows(stages, label, transport, buffer_bytes, work,
                                                  _time_steps)
            except Exception as e:  # noqa: BLE001 - e.g. Ray's NCCL needs cupy: record, go on
                result["errors"][label] = f"{type(e).__name__}: {e}"
                log(f"!! hop {label}: {type(e).__name__}: {e}")
        if device == "cuda":
            result["nccl_comms"] = nccl_inits(pids)
    finally:
        for s in stages:
            with contextlib.suppress(Exception):
                ray.get(s.shutdown.remote(), timeout=30)
            ray.kill(s, no_restart=True)
    result["derived"] = hop_derived(result["rows"])
    return result


def _hop_rows(stages: list[Any], label: str, transport: Any, buffer_bytes: int,
              work: Workload, time_steps: Callable[..., list[float]]) -> dict[str, Any]:
    import ray

    rows: dict[str, Any] = {}
    if label == "raw":
        for n in work.hop_rows:
            times = ray.get([s.raw_pingpong.remote(n, work.hop_steps, work.hop_warmup)
                             for s in stages], timeout=600)[0]
            rows[str(n)] = {"one_way": _ms(times)}
        return rows
    dag = _hop_dag(stages[:1] if label == "one_stage" else stages, transport, buffer_bytes)
    try:
        for n in work.hop_rows:
            time_steps(dag.execute, n, work.hop_warmup, 0, 1)  # warm-up (NCCL set-up)
            ray.get([s.drain_comm_trace.remote() for s in stages])
            rows[str(n)] = {"step": _ms(time_steps(dag.execute, n, work.hop_steps, 0, 1))}
            events = [e for t in ray.get([s.drain_comm_trace.remote() for s in stages])
                      for e in t]
            for op in ("send", "recv"):
                spans = [e[3] - e[2] for e in events if e[0] == op]
                if spans:
                    rows[str(n)][op] = _ms(spans)
            log(f"   hop {label} {n}x{work.hop_hidden}: p50 {rows[str(n)]['step']['p50_ms']} ms")
    finally:
        dag.teardown()
    return rows


def hop_derived(rows: dict[str, Any]) -> dict[str, Any]:
    """Per size: hop = step − one-stage step; overhead = hop − raw one-way (µs)."""
    out: dict[str, Any] = {}
    base = rows.get("one_stage", {})
    raw = rows.get("raw", {})
    for label in ("wrapped", "native"):
        for n, r in rows.get(label, {}).items():
            d = out.setdefault(n, {})
            step = r["step"]["p50_ms"]
            d[f"{label}_step_p50_us"] = round(1e3 * step, 1)
            if n in base:
                hop = step - base[n]["step"]["p50_ms"]
                d[f"{label}_hop_us"] = round(1e3 * hop, 1)
                if n in raw:
                    d[f"{label}_over_raw_us"] = round(1e3 * (hop - raw[n]["one_way"]["p50_ms"]), 1)
    for d in out.values():
        if "wrapped_step_p50_us" in d and "native_step_p50_us" in d:
            d["wrapped_le_native"] = d["wrapped_step_p50_us"] <= d["native_step_p50_us"]
    return out


# -- targets and the markdown summary ---------------------------------------------------------
def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met?) rows for the summary."""
    rows: list[tuple[str, str, bool | None]] = []
    corr = results["correctness"]
    engines = results["engines"]
    fp32 = [(k, v["vs_reference"]) for k, v in corr.items() if "vs_reference" in v]
    if fp32:
        rows.append(("fp32 greedy == (1,1)", ", ".join(f"{k.split('/')[1]}: "
                     f"{'equal' if c['equal'] else 'DIFF at ' + str(c['first_diff'])}"
                     for k, c in fp32), all(c["ok"] for _, c in fp32)))
    bf16 = [(k, v["vs_reference"]) for k, v in engines.items() if "vs_reference" in v]
    if bf16:
        rows.append(("bf16 within tolerance of (1,1)", ", ".join(
            f"{k}: {'equal' if c['equal'] else 'max |Δlp| ' + str(c['max_abs_logprob_diff'])}"
            for k, c in bf16), all(c["ok"] for _, c in bf16)))
    hop = results.get("hop") or {}
    for n, d in (hop.get("derived") or {}).items():
        if "wrapped_le_native" in d:
            rows.append((f"hop {n} rows: wrapped ≤ native", f"{d['wrapped_step_p50_us']} vs "
                         f"{d['native_step_p50_us']} µs/step", d["wrapped_le_native"]))
        if "wrapped_over_raw_us" in d:
            rows.append((f"hop {n} rows: wrapped − raw ≤ 40 µs", f"{d['wrapped_over_raw_us']} µs",
                         d["wrapped_over_raw_us"] <= 40))
    tp = {k: v["throughput"] for k, v in engines.items() if "throughput" in v}
    for name, t in tp.items():
        if "pp2" in name and "inflight2" in name and t.get("stage_bound"):
            share = t["stage_bound"]["share_of_ideal"]
            rows.append((f"{name}: ≥ 0.9 × stage-bound ideal", f"{share}", share >= 0.9))
    if results["suite"] == "tp2pp2" and {"tp2pp2_wrapped_inflight2", "tp4pp1_inflight1",
                                         "tp1pp4_wrapped_inflight4"} <= tp.keys():
        best = max(tp["tp4pp1_inflight1"]["output_tokens_per_s"],
                   tp["tp1pp4_wrapped_inflight4"]["output_tokens_per_s"])
        mine = tp["tp2pp2_wrapped_inflight2"]["output_tokens_per_s"]
        rows.append(("(2,2) ≥ 0.9 × best of (4,1), (1,4)", f"{mine:.1f} vs {best:.1f} tok/s",
                     mine >= 0.9 * best))
    rows += _comm_targets(results)
    return rows


def _startup_comms(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """layout → its last communicator report (fp32 correctness or bf16 engine)."""
    out = {}
    for v in results["correctness"].values():
        if v.get("communicators"):
            out[f"fp32 {v['layout']}"] = v["communicators"][-1]
    for v in results["engines"].values():
        if v.get("communicators"):
            out[f"{v['dtype']} {v['layout']}"] = v["communicators"][-1]
    return out


def _comm_targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    rows: list[tuple[str, str, bool | None]] = []
    for name, rep in _startup_comms(results).items():
        if "pp1" in name:
            continue
        ray_created = rep["graph"]["ray_created"]
        if "native" not in name:
            rows.append((f"{name}: Ray created no communicator", str(ray_created) or "[]",
                         not ray_created))
    engines = results["engines"]
    w, n = engines.get("tp1pp2_wrapped_inflight2"), engines.get("tp1pp2_native_inflight2")
    if w and n and w.get("communicators") and n.get("communicators") \
            and results["device"] == "cuda":
        cw = sum(w["communicators"][-1]["nccl_comms_per_worker"])
        cn = sum(n["communicators"][-1]["nccl_comms_per_worker"])
        rows.append(("wrapped: fewer NCCL communicators than native", f"{cw} vs {cn}", cw < cn))
        mw = max(x["memory"]["gpu_used_gib"] for x in w["communicators"][0]["workers"])
        mn = max(x["memory"]["gpu_used_gib"] for x in n["communicators"][0]["workers"])
        rows.append(("wrapped: no more GPU memory after start-up", f"{mw} vs {mn} GiB",
                     mw <= mn))
    return rows


def summary_markdown(results: dict[str, Any]) -> str:
    ctx, machine = results.get("context", {}), results.get("machine", {})
    lines = [f"# raypp multi-GPU suite `{results['suite']}` — {results['kind']}", "",
             f"- command: `{results['command']}`",
             f"- machine: {machine.get('cpus')} CPUs; GPUs: "
             f"{machine.get('gpus', 'none').replace(chr(10), '; ')}",
             f"- software: Ray {ctx.get('ray')}, torch {ctx.get('torch')}, "
             f"Python {ctx.get('python')}; {ctx.get('time', '')}",
             f"- models: {results.get('models', {})}",
             f"- total {results.get('total_s', '?')} s; section times {results['timings_s']}", ""]
    if results["device"] != "cuda":
        lines += ["> **CPU dry run** over gloo with tiny models: it proves the script and the "
                  "checks, not GPU performance. Numbers below are not GPU results.", ""]
    lines += ["## Targets", "", "| target | measured | met? |", "| --- | --- | --- |"]
    for target, measured, ok in targets(results):
        lines.append(f"| {target} | {measured} | {'yes' if ok else 'no' if ok is False else '–'} |")
    lines += ["", "## Communicators (last report per engine)", "",
              "| engine | Ray-created | channel communicators per worker | "
              "NCCL comms / gloo groups per worker | memory per worker after start-up |",
              "| --- | --- | --- | --- | --- |"]
    for name, rep in _startup_comms(results).items():
        per = rep.get("nccl_comms_per_worker", rep.get("gloo_groups_per_worker"))
        chans = [w["channel_communicators"] for w in rep["workers"]]
        mem = [next(iter(w["memory"].values())) for w in rep["workers"]]
        lines.append(f"| {name} | {rep['graph']['ray_created']} | {chans} | {per} | {mem} |")
    lines += _throughput_lines(results) + _hop_lines(results)
    if results["errors"] or results["skipped"]:
        lines += ["", "## Errors and skipped sections", ""]
        lines += [f"- **{k}**: `{v.splitlines()[0]}`" for k, v in results["errors"].items()]
        lines += [f"- skipped: {s}" for s in results["skipped"]]
    return "\n".join(lines) + "\n"


def _throughput_lines(results: dict[str, Any]) -> list[str]:
    lines = ["", "## Throughput (`raypp bench throughput` runner)", "",
             "| engine | output tok/s | ms/step | steps | stage busy (per worker) | "
             "share of stage-bound "
             "ideal | start-up s |", "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for name, e in results["engines"].items():
        if "throughput" not in e:
            continue
        t = e["throughput"]
        # the timeline sums a stage's TP ranks; per worker is that over tp
        busy = [round(b / e["tp"], 3) for b in t.get("stage_busy_share", [])]
        lines.append(f"| {name} | {t['output_tokens_per_s']:.1f} | {t['mean_step_ms']:.2f} | "
                     f"{t['engine_steps']} | {busy} | "
                     f"{t['stage_bound'].get('share_of_ideal')} | {e['startup_s']} |")
    tl = [e["throughput"].get("timeline") for e in results["engines"].values()
          if "throughput" in e]
    lines += [f"\nTimeline: `{Path(t['png']).name}` (Chrome trace `{Path(t['chrome_trace']).name}`)"
              for t in tl if t]
    return lines


def _hop_lines(results: dict[str, Any]) -> list[str]:
    hop = results.get("hop")
    if not hop:
        return []
    lines = ["", f"## Hop latency ({hop['hidden']} wide, bf16; p50 / p90 ms per step)", "",
             "| rows | wrapped | native | one-stage graph | raw send/recv one-way | "
             "wrapped hop − raw (µs) | native hop − raw (µs) |",
             "| ---: | --- | --- | --- | --- | ---: | ---: |"]
    rows = hop["rows"]

    def cell(label: str, n: str, key: str) -> str:
        r = rows.get(label, {}).get(n, {}).get(key)
        return f"{r['p50_ms']:.3f} / {r['p90_ms']:.3f}" if r else "–"

    for n in sorted({n for r in rows.values() for n in r}, key=int):
        d = hop["derived"].get(n, {})
        lines.append(f"| {n} | {cell('wrapped', n, 'step')} | {cell('native', n, 'step')} | "
                     f"{cell('one_stage', n, 'step')} | {cell('raw', n, 'one_way')} | "
                     f"{d.get('wrapped_over_raw_us', '–')} | {d.get('native_over_raw_us', '–')} |")
    if hop["errors"]:
        lines += [f"\nHop errors: {hop['errors']}"]
    return lines


# -- main ---------------------------------------------------------------------------------------
def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.suite``; returns the results (also written to ``args.out``)."""
    # A suspended graph is recompiled on the next step; on CUDA each recompile would make
    # Ray's native transport build a new NCCL communicator and skew the counts.
    with env(RAYPP_IDLE_SUSPEND_S="0"):
        return _run_suite(args)


def _run_suite(args: argparse.Namespace) -> dict[str, Any]:
    from raypp.bench.report import run_context

    suite = SUITES[args.suite]
    run = Run(args)
    run.results["machine"] = machine_info(args.device)
    start_ray(args.device)
    if args.device == "cuda":
        import ray

        gpus = int(ray.cluster_resources().get("GPU", 0))
        run.results["gpus_seen"] = gpus
        if gpus < suite["gpus"]:
            run.results["errors"]["gpus"] = f"suite {args.suite} needs {suite['gpus']} GPUs, " \
                                            f"Ray sees {gpus}"
    root = Path(args.model_root)
    default_main = "tiny" if args.device == "cpu" else ("1b" if args.suite == "pp2" else "8b")
    default_check = "tiny" if args.device == "cpu" else "small"
    main = run.section("model", lambda: model_dir(args.model, args.make_model or default_main,
                                                  args.device, root))
    check = run.section("check model", lambda: model_dir(
        args.check_model, args.make_check_model or default_check, args.device, root))
    run.results["models"] = {"main": str(main), "check": str(check), "dtype": args.dtype}
    if check is not None:
        correctness_fp32(run, check, suite["check"])
    if suite["hop"]:
        run.results["hop"] = run.section("hop latency", lambda: hop_latency(run), need_s=60)
    if main is not None:
        bench_engines(run, main, suite["bench"], suite["timeline"])
    run.results["context"] = run_context()
    run.results["total_s"] = round(time.perf_counter() - run.t0, 1)
    try:
        run.results["targets"] = [list(t) for t in targets(run.results)]
    except Exception as e:  # noqa: BLE001 - the measurements are still worth saving
        run.results["errors"]["targets"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    run.save()  # also writes summary.md
    log(f"done in {run.results['total_s']} s: {run.out / 'results.json'}, "
        f"{run.out / 'summary.md'}")
    return run.results


def build_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.multi_gpu",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--suite", required=True, choices=sorted(SUITES))
    ap.add_argument("--out", required=True, help="folder for results.json, summary.md, timeline")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default=None, help="main checkpoint (bf16 check, throughput)")
    ap.add_argument("--make-model", default=None, choices=sorted(SHAPES),
                    help="build the main checkpoint (default: 1b for pp2, 8b for tp2pp2; "
                         "tiny on CPU)")
    ap.add_argument("--check-model", default=None, help="checkpoint for the fp32 check")
    ap.add_argument("--make-check-model", default=None, choices=sorted(SHAPES),
                    help="build the fp32 check checkpoint (default: small; tiny on CPU)")
    ap.add_argument("--model-root", default="/tmp", help="where built checkpoints go")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the main engines")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--compile-decode", default=None, choices=["0", "1"],
                    help="RAYPP_COMPILE_DECODE for the bf16 engines (default: the engine's, 1); "
                         "0 captures the eager forward, which starts faster")
    ap.add_argument("--hop-steps", type=int, default=None,
                    help="timed steps per hop row (default 200 on CUDA, 20 on CPU)")
    ap.add_argument("--only", default=None,
                    help="comma-separated substrings of section names to run (e.g. "
                         "'fp32,hop,engine tp1pp1'); default: all")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="skip sections that would not finish within this many seconds")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    results = run_suite(args)
    print((Path(args.out) / "summary.md").read_text())
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
