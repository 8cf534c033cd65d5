"""``raypp bench serve``: load-test a running OpenAI-compatible server over real HTTP streaming.

Two modes:

- **request rate** (``--request-rate 1,2,4,inf``): open loop. For each rate, one
  measured run of ``num_requests`` requests sent at seeded Poisson arrival times
  (:func:`raypp.bench.arrivals.poisson_offsets`; ``inf`` sends them all at once),
  whatever the server's backlog; ``--max-concurrency`` optionally caps the requests
  outstanding (later arrivals wait for a slot, and their TTFT includes the wait).
- **concurrency** (the default, ``--concurrency N``): closed loop. ``N`` clients each
  send requests back to back until ``num_requests`` are done.

Per run (:mod:`raypp.bench.serve_metrics`): TTFT, TPOT, inter-token latency and
end-to-end latency p50/p99, errors, request and output-token throughput, and goodput
(requests/s meeting ``--slo-ttft-ms`` / ``--slo-tpot-ms``). Unmeasured warm-up requests
go first. A closed-loop result is one run's summary at the top level; a request-rate
result holds one summary per rate under ``runs`` (with ``request_rate`` and the
scheduled ``arrival_offsets_s``), and the totals ``requests`` and ``failed``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from tqdm import tqdm

from raypp.bench.arrivals import parse_rates, poisson_offsets
from raypp.bench.report import format_table, run_context, write_json
from raypp.bench.serve_client import RequestResult, request_body, stream_request
from raypp.bench.serve_metrics import summarize_run


@dataclass
class ServeBenchConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None  # default: the server's first model
    concurrency: int = 8
    num_requests: int = 64
    max_tokens: int = 32
    endpoint: str = "completions"  # or "chat"
    temperature: float = 0.0
    api_key: str | None = None
    warmup: int = 2
    timeout_s: float = 300.0
    request_rates: list[float] | None = None  # set: open loop, one run per rate
    max_concurrency: int | None = None  # open loop: cap on requests outstanding
    seed: int = 0  # open loop: the arrival times' seed
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    progress: bool = False


class _Load:
    """The client, the model name and the request body of one benchmark."""

    def __init__(self, cfg: ServeBenchConfig, client: httpx.AsyncClient, model: str):
        self.cfg, self.client, self.model = cfg, client, model

    async def send(self, i: int, run_start: float) -> RequestResult:
        cfg = self.cfg
        sent = time.perf_counter() - run_start
        body = request_body(self.model, i, cfg.max_tokens, cfg.temperature, cfg.endpoint == "chat")
        result = await stream_request(self.client, body, cfg.endpoint == "chat")
        result.sent_s = sent
        return result

    def summary(self, results: list[RequestResult], duration: float) -> dict[str, Any]:
        return summarize_run(results, duration, self.cfg.slo_ttft_ms, self.cfg.slo_tpot_ms)

    def bar(self, desc: str) -> tqdm:
        return tqdm(total=self.cfg.num_requests, desc=desc, dynamic_ncols=True,
                    disable=not self.cfg.progress)


async def _closed_loop(load: _Load) -> dict[str, Any]:
    todo = iter(range(load.cfg.num_requests))
    results: list[RequestResult] = []
    with load.bar(f"bench serve c={load.cfg.concurrency}") as bar:
        async def worker() -> None:
            for i in todo:  # shared iterator: each index is taken once
                results.append(await load.send(i, start))
                bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(load.cfg.concurrency)])
        duration = time.perf_counter() - start
    return {"concurrency": load.cfg.concurrency, **load.summary(results, duration)}


async def _open_loop(load: _Load, rate: float) -> dict[str, Any]:
    cfg = load.cfg
    offsets = poisson_offsets(cfg.num_requests, rate, cfg.seed)
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    with load.bar(f"bench serve rate={rate:g}/s") as bar:
        async def one(i: int, at: float) -> RequestResult:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots or contextlib.nullcontext():
                result = await load.send(i, start)
            bar.update(1)
            return result

        start = time.perf_counter()
        results = await asyncio.gather(*[one(i, at) for i, at in enumerate(offsets)])
        duration = time.perf_counter() - start
    return {"request_rate": json_rate(rate), "arrival_offsets_s": [round(t, 6) for t in offsets],
            **load.summary(list(results), duration)}


async def _run(cfg: ServeBenchConfig) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # never make a request queue for a connection on the client: that would count as TTFT
    conns = cfg.concurrency if not cfg.request_rates else (cfg.max_concurrency or cfg.num_requests)
    limits = httpx.Limits(max_connections=conns + 1, max_keepalive_connections=conns + 1)
    async with httpx.AsyncClient(base_url=cfg.url, headers=headers, limits=limits,
                                 timeout=cfg.timeout_s) as client:
        model = cfg.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        load = _Load(cfg, client, model)
        for i in range(cfg.warmup):
            await load.send(i, time.perf_counter())
        rates = None if cfg.request_rates is None else [json_rate(r) for r in cfg.request_rates]
        head = {"config": asdict(cfg) | {"model": model, "api_key": None, "request_rates": rates},
                "slo": {"ttft_ms": cfg.slo_ttft_ms, "tpot_ms": cfg.slo_tpot_ms}}
        if not cfg.request_rates:
            return {**head, "mode": "concurrency", **await _closed_loop(load)}
        runs = [await _open_loop(load, rate) for rate in cfg.request_rates]
    return {**head, "mode": "request-rate", "requests": sum(r["requests"] for r in runs),
            "failed": sum(r["failed"] for r in runs),
            "errors": sorted({e for r in runs for e in r["errors"]})[:5], "runs": runs}


def json_rate(rate: float) -> float | str:
    """A rate as JSON can hold it: ``inf`` becomes the string ``"inf"``."""
    return rate if math.isfinite(rate) else "inf"


def serve_bench(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Run the load against ``cfg.url`` and return the result (see module docstring)."""
    if cfg.request_rates is not None and not cfg.request_rates:
        raise ValueError("request_rates is empty")
    return asyncio.run(_run(cfg))


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    d = ServeBenchConfig()
    parser.add_argument("--url", default=d.url, help="server base URL")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--request-rate", type=_rates, default=None, metavar="R,R,...",
                        help="open loop: one run per rate (req/s; inf = all at once), Poisson "
                             "arrivals seeded by --seed (default: closed loop, --concurrency)")
    parser.add_argument("--concurrency", "-c", type=int, default=d.concurrency,
                        help="closed loop: clients streaming back to back")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="open loop: most requests outstanding (default: no cap)")
    parser.add_argument("--num-requests", "-n", type=int, default=d.num_requests,
                        help="measured requests (per rate)")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens,
                        help="max_tokens of each request")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default=d.endpoint,
                        help="the endpoint requests go to")
    parser.add_argument("--temperature", type=float, default=d.temperature,
                        help="temperature of each request")
    parser.add_argument("--seed", type=int, default=d.seed, help="arrival times' seed")
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="goodput counts requests with TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help="goodput counts requests with TPOT at most this")
    parser.add_argument("--api-key", default=None,
                        help="sent as 'Authorization: Bearer KEY' (default: none)")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured requests first")
    parser.add_argument("--json", default=None, metavar="OUT", help="write results as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="TTFT/TPOT p50/p99 and goodput against request rate (PNG)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _rates(text: str) -> list[float]:
    try:
        return parse_rates(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _print(result: dict[str, Any]) -> None:
    from raypp.bench.plots import run_label

    rows = [[run_label(r), f"{r['requests'] - r['failed']}/{r['requests']}",
             r["ttft_ms"].get("p50", float("nan")), r["ttft_ms"].get("p99", float("nan")),
             r["tpot_ms"].get("p50", float("nan")), r["tpot_ms"].get("p99", float("nan")),
             r["itl_ms"].get("p50", float("nan")), r["itl_ms"].get("p99", float("nan")),
             r["requests_per_s"], r["goodput_requests_per_s"], r["output_tokens_per_s"]]
            for r in result.get("runs") or [result]]
    print(format_table(["rate" if "runs" in result else "clients", "ok", "TTFT p50", "TTFT p99",
                        "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "req/s", "goodput",
                        "out tok/s"], rows))
    slo = [f"{name} <= {bound:g} ms" for name, bound in (("TTFT", result["slo"]["ttft_ms"]),
                                                          ("TPOT", result["slo"]["tpot_ms"]))
           if bound is not None]
    print(f"(ms; {result['config']['max_tokens']} tokens a request; goodput: requests/s "
          f"{'with ' + ' and '.join(slo) if slo else 'that succeeded (no SLO given)'})")
    for error in result["errors"]:
        print(f"error: {error}")


def run_serve_bench(args: argparse.Namespace) -> int:
    """``raypp bench serve``: 0 when every request succeeded, else 1."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    cfg = ServeBenchConfig(url=args.url.rstrip("/"), model=args.model,
                           concurrency=args.concurrency, num_requests=args.num_requests,
                           max_tokens=args.max_tokens, endpoint=args.endpoint,
                           temperature=args.temperature, api_key=args.api_key,
                           warmup=args.warmup, request_rates=args.request_rate,
                           max_concurrency=args.max_concurrency, seed=args.seed,
                           slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                           progress=not args.no_progress)
    result = serve_bench(cfg)
    _print(result)
    if args.plot:
        from raypp.bench.plots import plot_serve

        result["plot"] = str(plot_serve(result, args.plot))
        print(f"plot: {result['plot']}")
    if args.json:
        result["context"] = run_context()
        write_json(args.json, result)
        print(f"results: {args.json}")
    return 0 if result["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raypp.bench.serve", description=__doc__)
    add_serve_bench_args(parser)
    return run_serve_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
