"""The server's Prometheus metrics (``GET /metrics``), one registry per app.

Counters and histograms are updated by the request handlers (outcomes) and by the scheduler's
worker (tokens, latencies, queue); the Engine's figures are the worker's latest copy of
``engine.stats()`` (refreshed every half second while it works: only the worker touches the
Engine), read when the page is scraped; the process collector adds
``process_resident_memory_bytes`` and the other ``process_*`` series."""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0)


class _EngineCollector:
    """The Engine's figures from the scheduler's copy of its statistics."""

    def __init__(self, stats: Callable[[], Dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats() or {}
        hr = s.get("hit_rate")
        g = GaugeMetricFamily("specmoe_expert_cache_hit_rate",
                              "expert cache hits / accesses since the engine started")
        g.add_metric([], float(hr) if hr is not None else float("nan"))
        yield g
        for family, key, name, doc in (
                (CounterMetricFamily, "hits", "specmoe_expert_cache_hits", "expert cache hits"),
                (CounterMetricFamily, "misses", "specmoe_expert_cache_misses",
                 "expert cache misses"),
                (CounterMetricFamily, "stall_s", "specmoe_expert_stall_seconds",
                 "seconds the forward waited for experts to load"),
                (CounterMetricFamily, "bytes_read", "specmoe_expert_bytes_read",
                 "bytes read from the slow tier (the expert store)"),
                (GaugeMetricFamily, "capacity", "specmoe_expert_cache_slots",
                 "experts the cache holds"),
                (GaugeMetricFamily, "cache_bytes", "specmoe_expert_cache_bytes",
                 "bytes of the expert cache")):
            m = family(name, doc)
            m.add_metric([], float(s.get(key) or 0))
            yield m


class Metrics:
    """Every series of ``/metrics``; ``stats`` returns the Engine's latest statistics."""

    def __init__(self, stats: Callable[[], Dict[str, Any]] = dict) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specmoe_requests", "requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.queue_depth = Gauge("specmoe_queue_depth", "requests waiting for the worker",
                                 registry=r)
        self.running = Gauge("specmoe_running_sequences",
                             "requests admitted and being stepped", registry=r)
        self._prompt = Counter("specmoe_prompt_tokens", "prompt tokens prefilled",
                               registry=r)
        self._generated = Counter("specmoe_generation_tokens", "tokens generated",
                                  registry=r)
        self.ttft = Histogram("specmoe_time_to_first_token_seconds",
                              "from a request's arrival at the scheduler to its first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("specmoe_inter_token_latency_seconds",
                             "between two consecutive tokens of one request",
                             buckets=_LATENCY, registry=r)
        self.batch = Histogram("specmoe_decode_batch_size",
                               "sequences advanced by one decode forward",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self._drafts = Counter("specmoe_draft_tokens", "draft tokens verified, by outcome "
                               "(speculative decoding)", ["outcome"], registry=r)
        r.register(_EngineCollector(stats))
        ProcessCollector(registry=r)

    def request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def set_queue(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def prompt_tokens(self, n: int) -> None:
        self._prompt.inc(n)

    def generation_tokens(self, n: int) -> None:
        self._generated.inc(n)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def drafts(self, proposed: int, accepted: int) -> None:
        self._drafts.labels("accepted").inc(accepted)
        self._drafts.labels("rejected").inc(proposed - accepted)

    def decode_batch(self, n: int) -> None:
        self.batch.observe(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
