"""What each multi-GPU suite runs (engine layouts, sizes per device) and the run that
carries a suite's arguments and results through its sections."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.gpu.multi_gpu_summary import summary_markdown
from benchmarks.harness import Run


@dataclass(frozen=True)
class Layout:
    """One engine layout; ``wrapped`` picks ``use_ray_wrapped_pp_comm`` (PP tensors through
    RayPPCommunicator, else Ray's own transport)."""

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


class SuiteRun(Run):
    """One suite's run: the harness's sections, budget and ``results.json`` (plus
    ``summary.md``, rewritten with it), the parsed arguments, and the workload of
    ``args.device``.

    ``--only`` selects sections whose name contains one of its substrings; sections
    that build a model always run; the others are listed as not selected.
    """

    def __init__(self, args: argparse.Namespace):
        work = CUDA_WORKLOAD if args.device == "cuda" else CPU_WORKLOAD
        if args.hop_steps:
            work = replace(work, hop_steps=args.hop_steps,
                           hop_warmup=min(work.hop_warmup, args.hop_steps))
        only = [x.strip() for x in (args.only or "").split(",") if x.strip()]
        results: dict[str, Any] = {
            "suite": args.suite, "device": args.device,
            "kind": "GPU run" if args.device == "cuda" else "CPU dry run (gloo, not a GPU result)",
            "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.gpu.multi_gpu",
                                 *sys.argv[1:]]),
            "errors": {}, "skipped": [], "timings_s": {},
            "engines": {}, "correctness": {}, "hop": None, "throughput": {},
        }
        super().__init__(
            Path(args.out), args.budget_s, results,
            select=lambda name: not only or "model" in name or any(x in name for x in only),
            note_unselected=True, summaries={"summary.md": summary_markdown})
        self.args = args
        self.work = work
