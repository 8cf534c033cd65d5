"""Start-up of the demo model as a new user meets it (issue 30): how long each command
takes, end to end, from launching the process.

- ``help``: ``raypp --help`` until it exits.
- ``generate``: ``raypp generate --demo --max-tokens 1 --prompt Q`` until its answer line
  appears on stdout (the first token: one token is all it generates), and until it exits.
- ``serve``: ``raypp serve --demo --port P`` until ``GET /health`` answers 200 (polled
  every 50 ms), then SIGINT and the time to exit.
- ``llm_pp2``: ``LLM(<demo GGUF file>, pipeline_parallel_size=2)`` in a fresh Python
  until the constructor returns (the Python API's start-up), then shutdown.

Every command runs in a fresh process with ``PYTHONPATH=<--src>`` (so the same script
measures an older tree exported with ``git archive``), the demo model already fetched
(a warm cache: ``--warm`` runs each command once first, unrecorded, so whatever the tree
caches on first use is cached). The 1-minute load average is recorded before each run.

    python -m benchmarks.startup --src src --runs 3 --json benchmarks/startup/after.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

QUESTION = "What is the capital of France?"


def _env(src: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), RAY_AUTH_MODE="disabled",
               TOKENIZERS_PARALLELISM="false")
    env.pop("RAY_ADDRESS", None)
    return env


def _raypp(*args: str) -> list[str]:
    return [sys.executable, "-m", "raypp", *args]


def time_help(src: str) -> dict[str, float]:
    start = time.perf_counter()
    subprocess.run(_raypp("--help"), env=_env(src), check=True, capture_output=True)
    return {"exit_s": time.perf_counter() - start}


def time_generate(src: str) -> dict[str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(_raypp("generate", "--demo", "--max-tokens", "1", "--prompt", QUESTION),
                            env=_env(src), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    answer = None
    for line in proc.stdout:
        if line.startswith("assistant:") and answer is None:
            answer = time.perf_counter() - start
    if proc.wait() != 0 or answer is None:
        raise RuntimeError(f"raypp generate failed (exit {proc.returncode})")
    return {"first_token_s": answer, "exit_s": time.perf_counter() - start}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_serve(src: str) -> dict[str, float]:
    port = _free_port()
    start = time.perf_counter()
    proc = subprocess.Popen(_raypp("serve", "--demo", "--port", str(port)), env=_env(src),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    healthy = None
    try:
        while healthy is None:
            if proc.poll() is not None:
                raise RuntimeError(f"raypp serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        healthy = time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
    finally:
        stop = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"healthy_s": healthy, "stop_s": time.perf_counter() - stop}


_LLM_PP2 = """
import sys, time
start = time.perf_counter()
from raypp import LLM
llm = LLM(sys.argv[1], pipeline_parallel_size=2)
print(f"READY {time.perf_counter() - start}", flush=True)
llm.shutdown()
"""


def time_llm_pp2(src: str, model: str) -> dict[str, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _LLM_PP2, model], env=_env(src), check=True,
                          capture_output=True, text=True)
    ready = next(float(line.split()[1]) for line in done.stdout.splitlines()
                 if line.startswith("READY"))
    return {"constructed_s": ready, "exit_s": time.perf_counter() - start}


def _demo_file(src: str) -> str:
    """The demo GGUF's path as the measured tree resolves it (old and new trees alike)."""
    code = ("import raypp.demo as d, inspect\n"
            "f = d.demo_model_path\n"
            "if 'cache_dir' in inspect.signature(f).parameters:\n"
            "    from raypp.config import cache_dir; print(f(cache_dir()))\n"
            "else:\n"
            "    print(f())\n")
    return subprocess.run([sys.executable, "-c", code], env=_env(src), check=True,
                          capture_output=True, text=True).stdout.strip()


def _load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default="src", help="the tree to measure (its src/ folder)")
    parser.add_argument("--runs", type=int, default=3, help="recorded runs of each command")
    parser.add_argument("--only", default="help,generate,serve,llm_pp2",
                        help="comma-separated commands to time")
    parser.add_argument("--no-warm", dest="warm", action="store_false",
                        help="skip the unrecorded first run of each command")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    model = _demo_file(args.src)
    timers = {"help": lambda: time_help(args.src), "generate": lambda: time_generate(args.src),
              "serve": lambda: time_serve(args.src),
              "llm_pp2": lambda: time_llm_pp2(args.src, model)}
    results: dict[str, Any] = {
        "src": str(Path(args.src).resolve()), "python": platform.python_version(),
        "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commands": {},
    }
    for name in args.only.split(","):
        if args.warm:
            timers[name]()
        runs = []
        for _ in range(args.runs):
            load = _load()
            runs.append({"load_avg_1m_before": load, **timers[name]()})
            print(name, json.dumps(runs[-1]), flush=True)
        keys = [k for k in runs[0] if k != "load_avg_1m_before"]
        results["commands"][name] = {
            "runs": runs, "median": {k: statistics.median(r[k] for r in runs) for k in keys}}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v["median"] for k, v in results["commands"].items()}, indent=2))


if __name__ == "__main__":
    main()
