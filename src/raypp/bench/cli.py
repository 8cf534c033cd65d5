"""``raypp bench hop | throughput | latency | make-model | serve``."""

from __future__ import annotations

import argparse
import logging


def _run_hop(args: argparse.Namespace) -> int:
    from raypp.bench.hop import run_hop_bench

    run_hop_bench(args)
    return 0


def _run_throughput(args: argparse.Namespace) -> int:
    from raypp.bench.runner import run_throughput

    _quiet_ray_logs()
    run_throughput(args)
    return 0


def _run_latency(args: argparse.Namespace) -> int:
    from raypp.bench.runner import run_latency

    _quiet_ray_logs()
    run_latency(args)
    return 0


def _run_make_model(args: argparse.Namespace) -> int:
    from raypp.bench.make_model import run_make_model

    return run_make_model(args)


def _quiet_ray_logs() -> None:
    """Ray's per-compile INFO lines would interleave with the progress bar."""
    for name in ("ray.dag", "ray.experimental"):
        logging.getLogger(name).setLevel(logging.WARNING)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``raypp bench`` and its subcommands on the top-level CLI."""
    from raypp.bench.hop import add_hop_args
    from raypp.bench.make_model import add_make_model_args
    from raypp.bench.runner import add_latency_args, add_throughput_args

    bench = subparsers.add_parser("bench", help="benchmarks: hop, throughput, latency, ...")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    p = sub.add_parser("hop", help="per-step latency of one compiled-graph hop per transport")
    add_hop_args(p)
    p.set_defaults(func=_run_hop)

    p = sub.add_parser("throughput", help="offline throughput of the engine")
    add_throughput_args(p)
    p.set_defaults(func=_run_throughput)

    p = sub.add_parser("latency", help="end-to-end latency of one batch")
    add_latency_args(p)
    p.set_defaults(func=_run_latency)

    p = sub.add_parser("make-model", help="write a random-weight Llama checkpoint for benchmarks")
    add_make_model_args(p)
    p.set_defaults(func=_run_make_model)

    try:
        from raypp.bench.serve import add_serve_bench_args, run_serve_bench
    except ImportError:
        return
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible raypp server")
    add_serve_bench_args(p)
    p.set_defaults(func=run_serve_bench)
