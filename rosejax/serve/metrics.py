"""Prometheus metrics of one server, in a registry of its own (several servers per process work).

Latencies and token counts are observed as each replica's outputs leave `step()` (on its engine
thread, or on the thread that reads its engine process's messages), so they measure the engine,
not the event loop. Gauges of the scheduler and KV cache come from a snapshot that each engine
publishes after each iteration; the scrape never touches an engine. Every engine metric carries
the label `replica` (data parallelism; "0" with one).

With several API server processes (`--api-server-count N`) every scrape reports the whole
server, whichever process answers it. Each API server observes its own requests as one server
does, into prometheus_client's multiprocess mode (`ServerMetrics(shared_dir=...)`): its values
live in a file of its own in a directory the main process makes for the server (and removes at
its end), and the scrape sums every process's file (`MultiProcessCollector`). The engine gauges
and `rosejax_api_server_requests_total` come from the engine processes' snapshots, equal in all.
Why not count everything in the engine processes and send it with their snapshots: what only an
API server sees (rejections, a client gone, a shutdown's cut, an engine process that died) would
still need its own way there, every step would carry the counts down every pipe, and the
latencies would stop at the engine instead of the API server that answers. Multiprocess mode is
process-wide in prometheus_client (its value class), so such a process serves one server. A
dead API server's file stays, so what it served stays counted (counters never go down); none is
ever restarted in its place, so nothing counts twice, and there are no live gauges for
`mark_process_dead` to clean up. Counters and histograms have no `_created` samples there.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from rosejax.settings import set_prometheus_multiproc_dir

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
    "prefill_steps": (
        "rosejax_prefill_steps",
        "Prefill programs run (the requests of a burst admitted together share one).",
        "counter",
    ),
    "prefill_tokens": (
        "rosejax_prefill_tokens",
        "Prompt tokens prefilled (those served from the prefix cache not counted).",
        "counter",
    ),
    "preemptions": (
        "rosejax_preemptions",
        "Running requests preempted for KV cache blocks (their KV computed again later).",
        "counter",
    ),
    "programs_to_compile": (
        "rosejax_programs_to_compile",
        "Programs the server still compiles, or has compiled and not run once yet, while idle "
        "(a shape needed first compiles, or has its slower first run, then).",
        "gauge",
    ),
}


class _SnapshotCollector(Collector):
    """The engine gauges of every replica at scrape time, one sample per replica."""

    def __init__(self) -> None:
        self.snapshots: dict[str, Callable[[], dict[str, Any]]] = {}  # replica -> its snapshot

    def collect(self) -> Iterator[Metric]:
        snaps = {replica: snapshot() for replica, snapshot in list(self.snapshots.items())}
        for key, (name, doc, kind) in _SNAPSHOT.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            metric = family(name, doc, labels=["replica"])
            for replica, snap in snaps.items():
                metric.add_metric([replica], snap.get(key, 0))
            yield metric
        # Several API server processes (`--api-server-count`): each one's requests, as the
        # engine processes count them, so every API server's scrape shows them all.
        by_server = {
            r: s["api_server_requests"] for r, s in snaps.items() if "api_server_requests" in s
        }
        if by_server:
            metric = CounterMetricFamily(
                "rosejax_api_server_requests",
                "Requests (one per prompt) each API server process added to the engine.",
                labels=["replica", "api_server"],
            )
            for replica, counts in by_server.items():
                for server, count in enumerate(counts):
                    metric.add_metric([replica, str(server)], count)
            yield metric


class CountedHistogram(Collector):
    """A Prometheus histogram whose `observe` takes a count: a decode window hands a request
    its n tokens at once, each with the same gap, and n calls of prometheus_client's observe
    per request and window cost the engine thread more than the window's own host work.

    Its buckets and sum are prometheus_client values under a `Histogram`'s keys, so in
    multiprocess mode they go to the same files and `MultiProcessCollector` merges them as it
    does a `Histogram`'s; then it is registered nowhere (`registry` None)."""

    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry | None,
    ):
        self.name, self.doc, self.labelnames = name, doc, tuple(labelnames)
        self._bounds = [*buckets, math.inf]
        self._children: dict[tuple[str, ...], _CountedChild] = {}
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def labels(self, *labelvalues: str) -> _CountedChild:
        key = tuple(map(str, labelvalues))
        with self._lock:
            if key not in self._children:
                self._children[key] = _CountedChild(
                    self.name, self.doc, self.labelnames, key, self._bounds
                )
            return self._children[key]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        with self._lock:
            children = list(self._children.items())
        for key, child in children:
            counts, total = child.read()
            buckets, running = [], 0.0
            for bound, c in zip(self._bounds, counts, strict=True):
                running += c
                buckets.append((floatToGoString(bound), running))
            family.add_metric(list(key), buckets, total)
        yield family


class _CountedChild:
    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: tuple[str, ...],
        labelvalues: tuple[str, ...],
        bounds: list[float],
    ):
        self._bounds = bounds
        # Created as prometheus_client's Histogram creates its own (per bucket, not cumulative).
        self._buckets = [
            values.ValueClass(
                "histogram",
                name,
                f"{name}_bucket",
                (*labelnames, "le"),
                (*labelvalues, floatToGoString(bound)),
                doc,
            )
            for bound in self._bounds
        ]
        self._sum = values.ValueClass(
            "histogram", name, f"{name}_sum", labelnames, labelvalues, doc
        )

    def observe(self, value: float, count: int = 1) -> None:
        self.observe_many([(value, count)])

    def observe_many(self, observations: Iterable[tuple[float, int]]) -> None:
        """`observe(value, count)` of each, every bucket and the sum written once."""
        counts = [0] * len(self._bounds)
        total = 0.0
        for value, count in observations:
            counts[bisect.bisect_left(self._bounds, value)] += count  # the first value <= bound
            total += value * count
        for bucket, count in zip(self._buckets, counts, strict=True):
            if count:
                bucket.inc(count)
        if any(counts):
            self._sum.inc(total)

    def read(self) -> tuple[list[float], float]:
        return [bucket.get() for bucket in self._buckets], self._sum.get()


def share_across_processes(directory: str) -> None:
    """Keep the values of the prometheus metrics this process creates from now on in a file of
    its own in `directory`, where `MultiProcessCollector` sums every process's (prometheus_client's
    multiprocess mode). prometheus_client picks its value class from the environment when it is
    imported, before a server knows it is one of several: so it is set here."""
    set_prometheus_multiproc_dir(directory)
    values.ValueClass = values.MultiProcessValue()


class ServerMetrics:
    """Every metric of one server: the engine's per replica (label `replica`), requests refused
    at the door for the whole server. Thread-safe: prometheus_client metrics lock internally.

    `shared_dir`: this process is one of the server's API server processes, which all keep
    their values in this directory (`share_across_processes`); the scrape sums them."""

    def __init__(self, registry: CollectorRegistry | None = None, shared_dir: str | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        if shared_dir is not None:
            share_across_processes(shared_dir)
            MultiProcessCollector(self.registry, path=shared_dir)
            r = None  # the metrics themselves: in the files, which that collector reads
        self.ttft = Histogram(
            "rosejax_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = CountedHistogram(
            "rosejax_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
            ["replica"],
            _LATENCY_BUCKETS,
            r,
        )
        # Where a request's TTFT goes, observed with its first token from the engine's times
        # (`RequestMetrics`): TTFT less these three is the way back to the API server.
        self.dispatch_time = CountedHistogram(
            "rosejax_request_dispatch_time_seconds",
            "From a request's submission in an API server to its arrival at the engine.",
            ["replica"],
            _LATENCY_BUCKETS,
            r,
        )
        self.queue_time = CountedHistogram(
            "rosejax_request_queue_time_seconds",
            "From a request's arrival at the engine to the prefill that first took it.",
            ["replica"],
            _LATENCY_BUCKETS,
            r,
        )
        self.prefill_time = CountedHistogram(
            "rosejax_request_prefill_time_seconds",
            "From a request's first prefill to its first token read back from the device.",
            ["replica"],
            _LATENCY_BUCKETS,
            r,
        )
        self.e2e = Histogram(
            "rosejax_request_latency_seconds",
            "From a request's arrival to its end.",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generation_tokens = Counter(
            "rosejax_generation_tokens", "Tokens generated.", ["replica"], registry=r
        )
        self.prompt_tokens = Counter(
            "rosejax_prompt_tokens", "Prompt tokens of admitted requests.", ["replica"], registry=r
        )
        self.finished = Counter(
            "rosejax_requests_finished",
            "Requests (one per prompt) ended, by reason: stop, length, "
            "abort (client gone) or error.",
            ["replica", "reason"],
            registry=r,
        )
        self.rejected = Counter(
            "rosejax_requests_rejected",
            "HTTP requests refused, by reason: invalid (a 4xx) or overloaded (429).",
            ["reason"],
            registry=r,
        )
        self._snapshots = _SnapshotCollector()
        self.registry.register(self._snapshots)

    def replica(self, index: int, snapshot: Callable[[], dict[str, Any]]) -> ReplicaMetrics:
        """Replica `index`'s metrics; its engine gauges come from `snapshot()` at every scrape."""
        self._snapshots.snapshots[str(index)] = snapshot
        return ReplicaMetrics(self, str(index))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ReplicaMetrics:
    """One replica's share of a server's metrics, its `replica` label set: what its engine
    thread observes."""

    def __init__(self, metrics: ServerMetrics, replica: str):
        self.replica = replica
        self.ttft = metrics.ttft.labels(replica)
        self.itl = metrics.itl.labels(replica)
        self.e2e = metrics.e2e.labels(replica)
        self._starts = (
            metrics.dispatch_time.labels(replica),
            metrics.queue_time.labels(replica),
            metrics.prefill_time.labels(replica),
        )
        self.generation_tokens = metrics.generation_tokens.labels(replica)
        self.prompt_tokens = metrics.prompt_tokens.labels(replica)
        self._finished = metrics.finished

    def finished(self, reason: str) -> Any:
        """The counter of this replica's requests ended for `reason`."""
        return self._finished.labels(replica=self.replica, reason=reason)

    def observe_step(
        self,
        tokens: int,
        prompt_tokens: int,
        gaps: Iterable[tuple[float, int]],
        ended: Mapping[str, int],
        starts: Sequence[tuple[float, float, float]] = (),
    ) -> None:
        """One step's counts, each metric written once: tokens generated, prompt tokens of
        requests given their first token, inter-token latencies ((seconds per token, tokens)
        of each request's window), requests ended by finish reason, and the (dispatch, queue,
        prefill) seconds of requests given their first token."""
        if tokens:
            self.generation_tokens.inc(tokens)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        self.itl.observe_many(gaps)
        if starts:
            for histogram, seconds in zip(self._starts, zip(*starts, strict=True), strict=True):
                histogram.observe_many((s, 1) for s in seconds)
        for reason, count in ended.items():
            self.finished(reason).inc(count)
