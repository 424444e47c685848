"""The server's metrics without a server: the counted ITL histogram against prometheus_client's
own Histogram, in memory and in multiprocess files; and several API server processes' metrics
(`ServerMetrics(shared_dir=...)`, this process and a subprocess) summed by one scrape, against
one in-memory `ServerMetrics` that saw everything. The server with two API servers is tested in
tests/test_api_servers.py."""

from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from rosejax.serve.metrics import (
    _LATENCY_BUCKETS,
    CountedHistogram,
    ServerMetrics,
    share_across_processes,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SNAPSHOT = {"running": 3, "waiting": 1, "kv_blocks_used": 5, "kv_blocks_total": 9}


@pytest.fixture
def restore_prometheus(monkeypatch):
    """Multiprocess mode is process-wide: take it back after the test."""
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")


def _samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")  # not written in multiprocess mode
    }


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


@pytest.mark.parametrize("batched", [False, True], ids=["observe", "observe_many"])
@pytest.mark.parametrize("shared", [False, True], ids=["in-memory", "multiprocess"])
def test_counted_histogram_matches_prometheus_observing_one_at_a_time(
    shared, batched, tmp_path, restore_prometheus
):
    """The ITL histogram takes a window's n tokens in one call (or a step's windows in one
    `observe_many`); its buckets and count equal prometheus_client's Histogram fed the same
    values one observation at a time, its sum too; in multiprocess mode as
    `MultiProcessCollector` reads its files."""
    rng = random.Random()
    plain = CollectorRegistry()
    reference = Histogram("t_seconds", "doc", ["replica"], buckets=_LATENCY_BUCKETS, registry=plain)
    children = {r: reference.labels(r) for r in "01"}  # in memory before the mode changes
    counted = CollectorRegistry()
    if shared:
        share_across_processes(str(tmp_path))
        MultiProcessCollector(counted, path=str(tmp_path))
    histogram = CountedHistogram(
        "t_seconds", "doc", ["replica"], _LATENCY_BUCKETS, None if shared else counted
    )
    edges = [*_LATENCY_BUCKETS, 1e3]  # values on the bounds too: a bound is inclusive
    steps: dict[str, list] = {"0": [], "1": []}  # observations not handed to `histogram` yet
    for _ in range(300):
        value = rng.choice(edges) if rng.random() < 0.3 else rng.expovariate(20.0)
        n, replica = rng.randint(1, 40), rng.choice("01")
        for _ in range(n):
            children[replica].observe(value)
        if not batched:
            histogram.labels(replica).observe(value, n)
            continue
        steps[replica].append((value, n))
        if rng.random() < 0.2:  # a step's end
            histogram.labels(replica).observe_many(steps[replica])
            steps[replica] = []
    for replica, observations in steps.items():
        histogram.labels(replica).observe_many(observations)
    got = _samples(generate_latest(counted).decode())
    _assert_same(got, _samples(generate_latest(plain).decode()))


def _random_ops(rng: random.Random, n: int) -> list[list]:
    """What an API server's requests make it observe: [method, args] of `_apply`."""
    ops = []
    for _ in range(n):
        replica = rng.randrange(2)
        ops += [
            ["ttft", replica, rng.expovariate(10.0)],
            ["itl", replica, rng.expovariate(50.0), rng.randint(1, 16)],
            ["e2e", replica, rng.expovariate(2.0)],
            ["generation_tokens", replica, rng.randint(1, 64)],
            ["prompt_tokens", replica, rng.randint(1, 200)],
            ["finished", replica, rng.choice(["stop", "length", "abort", "error"])],
            ["starts", replica, [[rng.expovariate(100.0) for _ in range(3)]]],
        ]
        if rng.random() < 0.3:
            ops.append(["rejected", rng.choice(["invalid", "overloaded"])])
    return ops


def _apply(metrics: ServerMetrics, ops: list[list]) -> None:
    replicas = [metrics.replica(i, lambda: SNAPSHOT) for i in range(2)]
    for name, *args in ops:
        if name == "rejected":
            metrics.rejected.labels(args[0]).inc()
        elif name == "finished":
            replicas[args[0]].finished(args[1]).inc()
        elif name == "starts":  # a request's (dispatch, queue, prefill) seconds
            replicas[args[0]].observe_step(0, 0, [], {}, [tuple(s) for s in args[1]])
        elif name in ("ttft", "e2e", "itl"):
            getattr(replicas[args[0]], name).observe(*args[1:])
        else:
            getattr(replicas[args[0]], name).inc(args[1])


def api_server(shared_dir: str, ops_json: str) -> None:
    """Another API server process: observe `ops_json` into `shared_dir`, then end."""
    _apply(ServerMetrics(shared_dir=shared_dir), json.loads(ops_json))


def test_api_server_processes_metrics_sum_in_every_scrape(tmp_path, restore_prometheus):
    rng = random.Random()
    ours, theirs = _random_ops(rng, rng.randint(5, 30)), _random_ops(rng, rng.randint(5, 30))
    whole = ServerMetrics()  # in memory: one server that saw every request
    _apply(whole, ours + theirs)
    want = _samples(whole.render().decode())

    shared = str(tmp_path)
    code = "import sys; from tests.test_metrics import api_server; api_server(*sys.argv[1:])"
    subprocess.run(
        [sys.executable, "-c", code, shared, json.dumps(theirs)], cwd=ROOT, check=True, timeout=60
    )
    metrics = ServerMetrics(shared_dir=shared)
    _apply(metrics, ours)
    for _ in range(2):  # a scrape changes nothing
        _assert_same(_samples(metrics.render().decode()), want)
    # A file per kind and process: nothing but these two processes wrote there.
    kinds = sorted(p.name.split("_")[0] for p in tmp_path.iterdir())
    assert kinds == ["counter", "counter", "histogram", "histogram"], kinds
