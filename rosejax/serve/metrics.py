"""Prometheus metrics of one server, in a registry of its own (several servers per process work).

Latencies and token counts are observed by the engine thread as outputs leave `step()`, so they
measure the engine, not the event loop. Gauges of the scheduler and KV cache come from a snapshot
that the engine thread publishes after each iteration; the scrape never touches the engine.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)

# snapshot key -> (metric name, help, kind)
_SNAPSHOT = {
    "running": ("rosejax_requests_running", "Requests in the running batch.", "gauge"),
    "waiting": ("rosejax_requests_waiting", "Requests queued for a batch slot.", "gauge"),
    "kv_blocks_used": ("rosejax_kv_blocks_used", "KV cache blocks held by requests.", "gauge"),
    "kv_blocks_total": ("rosejax_kv_blocks_total", "Allocatable KV cache blocks.", "gauge"),
    "prefix_hits": (
        "rosejax_prefix_cache_hit_blocks",
        "KV blocks served from the prefix cache.",
        "counter",
    ),
    "prefix_hit_tokens": (
        "rosejax_prefix_cache_hit_tokens",
        "Prompt tokens whose KV came from the prefix cache.",
        "counter",
    ),
    "programs_to_compile": (
        "rosejax_programs_to_compile",
        "Programs the server still compiles while idle (a shape needed first compiles then).",
        "gauge",
    ),
}


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        for key, (name, doc, kind) in _SNAPSHOT.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=snap.get(key, 0))


class CountedHistogram(Collector):
    """A Prometheus histogram whose `observe` takes a count: a decode window hands a request
    its n tokens at once, each with the same gap, and n calls of prometheus_client's observe
    per request and window cost the engine thread more than the window's own host work."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float], registry: CollectorRegistry):
        self.name, self.doc = name, doc
        self._bounds = [*buckets, math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        i = bisect.bisect_left(self._bounds, value)  # the first bucket with value <= bound
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, c in zip(self._bounds, counts, strict=True):
            running += c
            cumulative.append(("+Inf" if bound == math.inf else repr(bound), running))
        yield HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=total)


class ServerMetrics:
    """Every metric of one server. Thread-safe: prometheus_client metrics lock internally."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "rosejax_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = CountedHistogram(
            "rosejax_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
            _LATENCY_BUCKETS,
            r,
        )
        self.e2e = Histogram(
            "rosejax_request_latency_seconds",
            "From a request's arrival to its end.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generation_tokens = Counter(
            "rosejax_generation_tokens", "Tokens generated.", registry=r
        )
        self.prompt_tokens = Counter(
            "rosejax_prompt_tokens", "Prompt tokens of admitted requests.", registry=r
        )
        self.finished = Counter(
            "rosejax_requests_finished",
            "Requests (one per prompt) ended, by reason: stop, length, "
            "abort (client gone) or error.",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter(
            "rosejax_requests_rejected",
            "HTTP requests refused, by reason: invalid (a 4xx) or overloaded (429).",
            ["reason"],
            registry=r,
        )

    def watch(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Export the engine gauges from `snapshot()` at every scrape."""
        self.registry.register(_SnapshotCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
