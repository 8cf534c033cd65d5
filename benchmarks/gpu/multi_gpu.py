"""One-call multi-GPU benchmark suites for issues 8 (PP=2) and 9 (TP × PP).

    python -m benchmarks.gpu.multi_gpu --suite pp2|tp2pp2 --out DIR [--device cuda|cpu]
        [--model DIR | --make-model tiny|small|1b|8b] [--budget-s S]

(from the repository root, with raypp importable). Everything lands in ``DIR`` (flat,
at most 4 files, so it all comes back from a device call): ``results.json`` and
``summary.md`` (both rewritten after every section), and one pipeline timeline as
``timeline_*.png`` + ``timeline_*.json`` (Chrome trace).

``--suite pp2`` (issue 8, 2 GPUs):

1. correctness: PP=2 greedy tokens == PP=1 on the same checkpoint, with
   ``use_ray_wrapped_pp_comm`` on and off; fp32 exact on the check model, bf16 within
   tolerance (top-5 logprobs) on the main model (:mod:`~benchmarks.gpu.multi_gpu_checks`);
2. communicators: per worker process, the NCCL communicators NCCL itself reports
   (``NCCL_DEBUG=INFO`` "Init COMPLETE" lines in the Ray worker logs, by pid; CUDA
   only), the torch.distributed process groups, the communicators Ray's channels
   use and any Ray created for the graph; GPU memory in use after start-up
   (:mod:`~benchmarks.gpu.multi_gpu_comms`);
3. hop latency: a compiled-graph hop carrying decode- and prefill-sized tensors,
   RayPPCommunicator vs Ray's own transport vs raw torch.distributed send/recv
   between the same two processes (and a one-stage graph as the fixed cost)
   (:mod:`~benchmarks.gpu.multi_gpu_hop`);
4. throughput (``raypp bench throughput``'s runner): PP=2 at max_inflight 1 and 2,
   wrapped and native, plus the PP=1 baseline; one timeline (PP=2, wrapped, 2 in
   flight) (:mod:`~benchmarks.gpu.multi_gpu_throughput`).

``--suite tp2pp2`` (issue 9, 4 GPUs): (tp, pp) = (2, 2), (1, 4), (4, 1) equal
(1, 1) (fp32 exact, bf16 within tolerance), communicator counts per worker, and
throughput with ``max_inflight = pp`` plus the (2, 2) timeline.

Sections run under :mod:`benchmarks.harness`: each records its errors and the script
carries on; sections that would not fit ``--budget-s`` are skipped and listed; the
exit code is 1 if any section failed. ``--device cpu`` runs the same code over gloo
with tiny models (the CPU dry run, ``tests/test_multi_gpu_script.py``).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any

from benchmarks.gpu.multi_gpu_checks import correctness_fp32
from benchmarks.gpu.multi_gpu_engines import start_ray
from benchmarks.gpu.multi_gpu_hop import hop_latency
from benchmarks.gpu.multi_gpu_models import SHAPES, model_dir
from benchmarks.gpu.multi_gpu_suites import SUITES, SuiteRun
from benchmarks.gpu.multi_gpu_summary import targets
from benchmarks.gpu.multi_gpu_throughput import bench_engines
from benchmarks.harness import add_run_args, log, machine_info


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.suite``; returns the results (also written to ``args.out``)."""
    from raypp.bench.report import run_context

    suite = SUITES[args.suite]
    run = SuiteRun(args)
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
    run.results["total_s"] = round(run.elapsed(), 1)
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
    add_run_args(ap, out_default=None, budget_s=540.0)
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
                    help="compile_decode for the bf16 engines (default: the engine's, 1); "
                         "0 captures the eager forward, which starts faster")
    ap.add_argument("--hop-steps", type=int, default=None,
                    help="timed steps per hop row (default 200 on CUDA, 20 on CPU)")
    ap.add_argument("--only", default=None,
                    help="comma-separated substrings of section names to run (e.g. "
                         "'fp32,hop,engine tp1pp1'); default: all")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    results = run_suite(args)
    print((Path(args.out) / "summary.md").read_text())
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
