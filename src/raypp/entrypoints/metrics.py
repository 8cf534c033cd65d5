"""Prometheus metrics of one server, in a registry of its own (never the global one).

Request-level numbers (TTFT, inter-token latency, tokens, outcomes) are measured
where the server consumes the engine's stream (:class:`RequestTracker`); engine
gauges and per-stage step times are read from the :class:`AsyncLLMEngine` when
``/metrics`` is scraped (:meth:`ServerMetrics.render`).
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from raypp.engine.async_engine import AsyncLLMEngine
from raypp.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """Every metric ``/metrics`` exports (names prefixed ``raypp_``)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "raypp_http_requests", "HTTP requests by endpoint and status code",
            ["endpoint", "status"], registry=r)
        self.completions_finished = Counter(
            "raypp_completions_finished", "Completions (n per prompt) by outcome: stop, length, "
            "abort (the client went away), error", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(
            "raypp_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(
            "raypp_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "raypp_time_to_first_token_seconds", "Request arrival to its first generated token",
            buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "raypp_inter_token_latency_seconds", "Gap between consecutive tokens of a completion",
            buckets=_STEP_BUCKETS, registry=r)
        self.e2e = Histogram(
            "raypp_e2e_request_latency_seconds", "Request arrival to its last token",
            buckets=_E2E_BUCKETS, registry=r)
        self.running = Gauge(
            "raypp_num_requests_running", "Requests with a sequence in the running set",
            registry=r)
        self.waiting = Gauge(
            "raypp_num_requests_waiting", "Requests queued, none of their sequences running",
            registry=r)
        self.kv_used = Gauge("raypp_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("raypp_kv_blocks_total", "KV cache blocks per stage", registry=r)
        self.prefix_queries = Counter(
            "raypp_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
            "(when a request is first scheduled)", registry=r)
        self.prefix_hits = Counter(
            "raypp_prefix_cache_hits", "Prompt tokens the prefix cache supplied", registry=r)
        self._prefix_seen = (0, 0)  # the engine's cumulative (queries, hits) at the last scrape
        self.spec = {  # speculative decoding, named as vLLM's spec_decode counters
            "spec_verifications": Counter(
                "raypp_spec_decode_num_drafts", "Sequence steps that verified a draft",
                registry=r),
            "spec_drafted_tokens": Counter(
                "raypp_spec_decode_num_draft_tokens", "Drafted tokens verified", registry=r),
            "spec_accepted_tokens": Counter(
                "raypp_spec_decode_num_accepted_tokens", "Drafted tokens accepted", registry=r),
        }
        self._spec_seen = dict.fromkeys(self.spec, 0)
        self.stage_occupancy = {  # the latest window per stage (raypp.engine.occupancy)
            "busy": Gauge("raypp_stage_busy_fraction", "Share of the latest window a stage "
                          "spent computing", ["stage"], registry=r),
            "bubble": Gauge("raypp_stage_bubble_fraction", "Share of the latest window a stage "
                            "waited for the input of a submitted step", ["stage"], registry=r),
            "idle": Gauge("raypp_stage_idle_fraction", "Share of the latest window a stage was "
                          "not computing (bubbles included)", ["stage"], registry=r),
            "mean_wait_ms": Gauge("raypp_stage_mean_input_wait_milliseconds", "Mean wait for a "
                                  "step's input in the latest window", ["stage"], registry=r),
            "tokens_per_step": Gauge("raypp_stage_tokens_per_step", "Mean tokens fed per step "
                                     "in the latest window", ["stage"], registry=r),
        }
        self.stage_step = Histogram(
            "raypp_stage_step_seconds", "Compute time of one micro-batch on one pipeline stage",
            ["stage"], buckets=_STEP_BUCKETS, registry=r)

    def render(self, engine: AsyncLLMEngine) -> bytes:
        """Refresh the engine gauges and stage times, then the Prometheus text."""
        stats = engine.stats()
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        queries, hits = self._prefix_seen
        self.prefix_queries.inc(max(0, stats.prefix_cache_queries - queries))
        self.prefix_hits.inc(max(0, stats.prefix_cache_hits - hits))
        self._prefix_seen = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        for name, counter in self.spec.items():
            value = getattr(stats, name)
            counter.inc(max(0, value - self._spec_seen[name]))
            self._spec_seen[name] = value
        for window in stats.stage_occupancy:
            for key, gauge in self.stage_occupancy.items():
                gauge.labels(stage=str(window["stage"])).set(window[key])
        for stage, seconds in engine.pop_stage_times():
            self.stage_step.labels(stage=str(stage)).observe(seconds)
        return generate_latest(self.registry)

    def tracker(self, arrival: float | None = None) -> RequestTracker:
        return RequestTracker(self, time.monotonic() if arrival is None else arrival)


class RequestTracker:
    """Per-request timing: call :meth:`admitted`, :meth:`update` per output, :meth:`finish`."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.m = metrics
        self.arrival = arrival
        self._first_token: float | None = None
        self._last_token: dict[tuple[int, int], float] = {}  # (prompt, completion) -> time
        self._num_tokens: dict[tuple[int, int], int] = {}
        self._finished = False

    def admitted(self, prompt_tokens: int) -> None:
        self.m.prompt_tokens.inc(prompt_tokens)

    def update(self, out: RequestOutput, prompt_index: int = 0) -> None:
        now = time.monotonic()
        for c in out.outputs:
            key = (prompt_index, c.index)
            new = len(c.token_ids) - self._num_tokens.get(key, 0)
            if new <= 0:
                continue
            self._num_tokens[key] = len(c.token_ids)
            self.m.generation_tokens.inc(new)
            if self._first_token is None:
                self._first_token = now
                self.m.ttft.observe(now - self.arrival)
            last = self._last_token.get(key)
            if last is not None:
                for _ in range(new):  # a coalesced update: spread its gap evenly
                    self.m.itl.observe((now - last) / new)
            self._last_token[key] = now

    def finish(self, reasons: list[str | None]) -> None:
        """Count each completion's outcome once (``None`` counts as abort)."""
        if self._finished:
            return
        self._finished = True
        for reason in reasons:
            self.m.completions_finished.labels(finish_reason=reason or "abort").inc()
        if self._first_token is not None and all(r in ("stop", "length") for r in reasons):
            self.m.e2e.observe(time.monotonic() - self.arrival)
