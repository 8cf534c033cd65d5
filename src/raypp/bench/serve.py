"""``raypp bench serve``: load-test a running OpenAI-compatible server.

``concurrency`` clients on loopback (or any URL) each send streaming requests
back to back until ``num_requests`` are done. Per request: TTFT (send → first
non-empty text chunk), inter-token latency (gaps between later text chunks),
end-to-end latency and completion tokens (from the server's ``usage``). Reports
p50/p99 of each, requests/s and output tokens/s over the measured window.
Requests ask for ``ignore_eos`` so every one generates ``max_tokens`` tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from raypp.bench.report import format_table, run_context, summarize, write_json

_PROMPTS = ["The list type", "A function definition", "The import statement",
            "Assert statements are a convenient way to", "Classes provide a means of"]


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


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    completion_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


def _body(cfg: ServeBenchConfig, model: str, i: int) -> dict[str, Any]:
    prompt = _PROMPTS[i % len(_PROMPTS)]
    body: dict[str, Any] = {
        "model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def _one(client: httpx.AsyncClient, cfg: ServeBenchConfig, model: str,
               i: int) -> RequestResult:
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    start = time.perf_counter()
    result, last = RequestResult(ok=False), None
    try:
        async with client.stream("POST", path, json=_body(cfg, model, i)) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                if not _chunk_text(chunk):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency_s = time.perf_counter() - start
    result.ok = last is not None
    return result


async def _run(cfg: ServeBenchConfig) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 1)
    async with httpx.AsyncClient(base_url=cfg.url, headers=headers, limits=limits,
                                 timeout=cfg.timeout_s) as client:
        model = cfg.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        for i in range(cfg.warmup):
            await _one(client, cfg, model, i)
        todo = iter(range(cfg.num_requests))
        results: list[RequestResult] = []

        async def worker() -> None:
            for i in todo:  # shared iterator: each index is taken once
                results.append(await _one(client, cfg, model, i))

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(cfg.concurrency)])
        duration = time.perf_counter() - start
    return _summary(cfg, model, results, duration)


def _summary(cfg: ServeBenchConfig, model: str, results: list[RequestResult],
             duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ms = lambda values: {k: (v * 1e3 if k != "n" else v)  # noqa: E731
                         for k, v in summarize(values).items()}
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "config": asdict(cfg) | {"model": model, "api_key": None},
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration else 0.0,
        "output_tokens_per_s": tokens / duration if duration else 0.0,
        "ttft_ms": ms([r.ttft_s for r in ok]),
        "itl_ms": ms([gap for r in ok for gap in r.itl_s]),
        "latency_ms": ms([r.latency_s for r in ok]),
    }


def serve_bench(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Run the load against ``cfg.url`` and return the summary (see module docstring)."""
    return asyncio.run(_run(cfg))


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    d = ServeBenchConfig()
    parser.add_argument("--url", default=d.url, help="server base URL")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--concurrency", "-c", type=int, default=d.concurrency,
                        help="clients streaming at once")
    parser.add_argument("--num-requests", "-n", type=int, default=d.num_requests)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default=d.endpoint)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured requests first")
    parser.add_argument("--json", default=None, metavar="OUT", help="write results as JSON")


def run_serve_bench(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    cfg = ServeBenchConfig(url=args.url.rstrip("/"), model=args.model,
                           concurrency=args.concurrency, num_requests=args.num_requests,
                           max_tokens=args.max_tokens, endpoint=args.endpoint,
                           temperature=args.temperature, api_key=args.api_key,
                           warmup=args.warmup)
    result = serve_bench(cfg)
    rows = [[name, result[key]["p50"], result[key]["p99"], result[key]["mean"]]
            for name, key in (("TTFT ms", "ttft_ms"), ("ITL ms", "itl_ms"),
                              ("latency ms", "latency_ms")) if result[key].get("n")]
    print(format_table(["metric", "p50", "p99", "mean"], rows))
    print(f"{result['requests'] - result['failed']}/{result['requests']} ok in "
          f"{result['duration_s']:.2f} s: {result['requests_per_s']:.2f} req/s, "
          f"{result['output_tokens_per_s']:.1f} output tok/s "
          f"(concurrency {cfg.concurrency}, {cfg.max_tokens} tokens each)")
    for error in result["errors"]:
        print(f"error: {error}")
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
