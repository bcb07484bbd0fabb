"""Prometheus metrics (`GET /metrics`), named like vLLM's with a `dsv4:` prefix.

Engine gauges come from the `EngineStats` of every engine message; token counters and
latency histograms are measured here, per engine request, from its arrival in the API
process: time to first token, time per output token after the first, end to end.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the route

from .ipc import EngineStats, TokenOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str, num_pages: int):
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.running = Gauge("dsv4:num_requests_running", "Requests in the engine's running batch", m, registry=r)
        self.waiting = Gauge("dsv4:num_requests_waiting", "Requests waiting for admission", m, registry=r)
        self.pages_used = Gauge("dsv4:cache_pages_used", "KV history pages (256 tokens) in use", m, registry=r)
        self.pages_free = Gauge("dsv4:cache_pages_free", "KV history pages free", m, registry=r)
        self.pages_total = Gauge("dsv4:cache_pages_total", "KV history pages in the cache", m, registry=r)
        self.swa_used = Gauge("dsv4:swa_pages_used", "Sliding-window pages in use", m, registry=r)
        self.slots_used = Gauge("dsv4:request_slots_used", "Request state slots in use", m, registry=r)
        self.usage = Gauge("dsv4:kv_cache_usage_perc", "Fraction of KV history pages in use", m, registry=r)
        self.prompt_tokens = Counter("dsv4:prompt_tokens", "Prompt tokens sent to the engine", m, registry=r)
        self.generation_tokens = Counter("dsv4:generation_tokens", "Tokens generated", m, registry=r)
        self.finished = Counter("dsv4:request_success", "Engine requests ended, by finish reason",
                                m + ["finished_reason"], registry=r)
        self.ttft = Histogram("dsv4:time_to_first_token_seconds", "Time to first token", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("dsv4:time_per_output_token_seconds", "Time per output token after the first",
                              m, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("dsv4:e2e_request_latency_seconds", "End-to-end request latency", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.name = model_name
        self.pages_total.labels(model_name).set(num_pages)
        self.update(EngineStats(pages_free=num_pages))

    def update(self, stats: EngineStats) -> None:
        name = self.name
        self.running.labels(name).set(stats.num_running)
        self.waiting.labels(name).set(stats.num_waiting)
        self.pages_used.labels(name).set(stats.pages_used)
        self.pages_free.labels(name).set(stats.pages_free)
        self.swa_used.labels(name).set(stats.swa_pages_used)
        self.slots_used.labels(name).set(stats.slots_used)
        total = stats.pages_used + stats.pages_free
        self.usage.labels(name).set(stats.pages_used / total if total else 0.0)

    def track(self, num_requests: int, prompt_tokens: int) -> "RequestTracker":
        self.prompt_tokens.labels(self.name).inc(prompt_tokens)
        return RequestTracker(self, num_requests)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Timing of the engine requests of one HTTP request, by child index."""

    def __init__(self, metrics: ServerMetrics, n: int):
        self.m, self.start = metrics, time.perf_counter()
        self.first: list[float | None] = [None] * n
        self.tokens = [0] * n
        self.done = [False] * n

    def observe(self, index: int, out: TokenOutput) -> None:
        now, name = time.perf_counter(), self.m.name
        if out.token_ids and self.first[index] is None:
            self.first[index] = now
            self.m.ttft.labels(name).observe(now - self.start)
        self.tokens[index] += len(out.token_ids)
        self.m.generation_tokens.labels(name).inc(len(out.token_ids))
        if out.finished:
            self._end(index, out.finish_reason or "stop")
            self.m.e2e.labels(name).observe(now - self.start)
            if self.tokens[index] > 1:
                self.m.tpot.labels(name).observe((now - self.first[index]) / (self.tokens[index] - 1))

    def close(self, reason: str) -> None:
        """Count every child not finished yet as ended for `reason` ("abort", "error")."""
        for index, done in enumerate(self.done):
            if not done:
                self._end(index, reason)

    def _end(self, index: int, reason: str) -> None:
        self.done[index] = True
        self.m.finished.labels(self.m.name, reason).inc()
