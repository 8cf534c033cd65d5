"""The summary of one load-test run: latency percentiles, throughput and goodput.

:func:`summarize_run` turns the :class:`~raypp.bench.serve_client.RequestResult` of
every request of a run into a dictionary. ``*_ms`` entries are
:func:`raypp.bench.report.summarize` in milliseconds over the successful requests:
TTFT, TPOT (time per output token after the first), ITL (every gap between text
chunks) and end-to-end latency. Rates are over ``duration_s`` (first send to last
completion). **Goodput** is the successful requests per second that met every given
SLO (TTFT ≤ ``slo_ttft_ms``, TPOT ≤ ``slo_tpot_ms``; a request of one token has no
TPOT and meets that bound); with no SLO it equals ``requests_per_s``. So
``goodput_requests_per_s ≤ requests_per_s`` always.
"""

from __future__ import annotations

from typing import Any

from raypp.bench.report import summarize
from raypp.bench.serve_client import RequestResult


def _ms(values: list[float]) -> dict[str, float]:
    return {k: (v * 1e3 if k != "n" else v) for k, v in summarize(values).items()}


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether ``r`` succeeded within both bounds (``None``: no bound)."""
    if not r.ok:
        return False
    if slo_ttft_ms is not None and r.ttft_s * 1e3 > slo_ttft_ms:
        return False
    tpot = r.tpot_s
    return slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms


def summarize_run(results: list[RequestResult], duration: float,
                  slo_ttft_ms: float | None = None,
                  slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """One run's numbers (see module docstring), plus one row per request in send order
    (``per_request``: ``sent_s``, ``ok``, ``ttft_ms``, ``tpot_ms``, ``latency_ms``, ``tokens``)."""
    ok = [r for r in results if r.ok]
    good = [r for r in ok if meets_slo(r, slo_ttft_ms, slo_tpot_ms)]
    tokens = sum(r.completion_tokens for r in ok)
    rate = (lambda n: n / duration if duration > 0 else 0.0)  # noqa: E731
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "requests_per_s": rate(len(ok)),
        "output_tokens_per_s": rate(tokens),
        "good_requests": len(good),
        "goodput_requests_per_s": rate(len(good)),
        "ttft_ms": _ms([r.ttft_s for r in ok]),
        "tpot_ms": _ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": _ms([gap for r in ok for gap in r.itl_s]),
        "latency_ms": _ms([r.latency_s for r in ok]),
        "per_request": [
            {"sent_s": round(r.sent_s, 6), "ok": r.ok,
             "ttft_ms": round(r.ttft_s * 1e3, 3) if r.ok else None,
             "tpot_ms": None if r.tpot_s is None else round(r.tpot_s * 1e3, 3),
             "latency_ms": round(r.latency_s * 1e3, 3) if r.ok else None,
             "tokens": r.completion_tokens}
            for r in sorted(results, key=lambda r: r.sent_s)],
    }
