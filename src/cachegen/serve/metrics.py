"""Prometheus metrics, one registry per app (two apps in a process never share counters).

Labels carry only endpoints, status codes, levels and fixed reason words:
never a URL, a prompt or a message, so no secret can reach ``/metrics``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cachegen.engine.completion import Completion
from cachegen.stream import TEXT

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FALLBACK_REASONS = ("planned", "not stored", "fault", "after fault")


class _WriterCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        w = self.engine.writer
        s = w.stats
        yield GaugeMetricFamily("cachegen_writer_depth", "Background store writes queued or running", value=w.depth())
        yield CounterMetricFamily(
            "cachegen_writer_dropped_jobs", "Background writes dropped: the queue was full", value=s.dropped
        )
        yield CounterMetricFamily(
            "cachegen_writer_dropped_chunks", "Chunks not stored: their write was dropped", value=s.dropped_chunks
        )
        yield CounterMetricFamily(
            "cachegen_writer_written_chunks", "Chunks encoded and stored in the background", value=s.written_chunks
        )
        yield CounterMetricFamily(
            "cachegen_writer_failed_jobs", "Background writes that failed (store errors)", value=s.failed
        )


class Metrics:
    def __init__(self, engine, worker):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "cachegen_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "cachegen_ttft_seconds", "Time to first token", ["endpoint"], buckets=_LATENCY, registry=r
        )
        self.latency = Histogram(
            "cachegen_request_seconds", "Whole-request latency", ["endpoint"], buckets=_LATENCY, registry=r
        )
        self.prompt_tokens = Counter(
            "cachegen_prompt_tokens", "Prompt tokens by where their KV came from", ["source"], registry=r
        )
        self.fetched = Counter(
            "cachegen_fetched_bytes", "Bytes fetched from the store per level", ["level"], registry=r
        )
        self.levels = Counter(
            "cachegen_level_choices", "Chunks loaded per level ('text': recomputed)", ["level"], registry=r
        )
        self.misses = Counter("cachegen_deadline_misses", "Loads that missed their deadline", registry=r)
        self.fallbacks = Counter(
            "cachegen_fallbacks", "Chunks recomputed instead of loaded, by reason", ["reason"], registry=r
        )
        self.store_errors = Counter(
            "cachegen_store_errors", "Store faults met while loading (then recomputed)", registry=r
        )
        self.cancelled = Counter("cachegen_cancelled", "Generations stopped because the client went away", registry=r)
        q = Gauge("cachegen_queue_depth", "Requests waiting for the model", registry=r)
        q.set_function(lambda: worker.waiting)
        run = Gauge("cachegen_running", "Requests on the model now (0 or 1)", registry=r)
        run.set_function(lambda: worker.running)
        r.register(_WriterCollector(engine))

    def observe(self, endpoint: str, run: Completion) -> None:
        """Record what one generation's load did."""
        self.prompt_tokens.labels("loaded").inc(run.cached_tokens)
        self.prompt_tokens.labels("computed").inc(run.computed_tokens)
        if run.ttft_s is not None:
            self.ttft.labels(endpoint).observe(run.ttft_s)
        if run.finish_reason == "cancelled":
            self.cancelled.inc()
        if run.faults:
            self.store_errors.inc(len(run.faults))
        res = run.load
        if res is None:
            return
        if res.missed:
            self.misses.inc()
        for d in res.decisions:
            level = "text" if d.choice == TEXT else str(d.choice)
            self.levels.labels(level).inc()
            if d.bytes:
                self.fetched.labels(level).inc(d.bytes)
            if d.choice == TEXT:
                reason = d.reason if d.reason in FALLBACK_REASONS else "fault"
                self.fallbacks.labels(reason).inc()
