"""Data parallelism: the router by hand (pure Python), devices per replica, bad sizes refused at
start naming the flag, per-replica metrics; and in a subprocess with 4 host devices
(tests/data_parallel_checks.py), 2 replicas against one engine, alone and behind the server."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import subprocess
import sys
import types

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rosejax import LLM
from rosejax.engine.data_parallel import replica_devices
from rosejax.engine.router import Router, request_cost
from rosejax.serve import ServerMetrics
from rosejax.serve import cli as serve_cli
from rosejax.settings import EngineConfig

SEED = int(os.environ.get("ROSEJAX_TEST_SEED", random.randrange(2**31)))
BS = 4  # block size of the router tests


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50000) for _ in range(n)]


def test_router_picks_the_least_loaded_without_a_known_prefix():
    rng = random.Random(SEED)
    router = Router(3, BS)
    for _ in range(20):
        loads = [rng.randrange(5) for _ in range(3)]
        # fresh prompts: no replica holds any of their blocks
        assert router.route(ids(rng, rng.randrange(1, 20)), loads) == loads.index(min(loads))
    assert Router(1, BS).route(ids(rng, 9), [7]) == 0
    with pytest.raises(ValueError, match="one load per replica"):
        router.route([1, 2], [0, 0])


def test_router_prefix_affinity_unless_much_more_loaded():
    rng = random.Random(SEED)
    router = Router(2, BS, imbalance=0.5)
    prefix = ids(rng, 3 * BS)
    assert router.route(prefix + ids(rng, 2), [5, 0]) == 1  # least loaded; now holds 3 blocks
    # Replica 1 holds the 3 leading blocks (12 tokens the hit saves): taken while its load is at
    # most 1.5 x the least loaded one's + 12.
    assert router.route(prefix + ids(rng, 1), [100, 162]) == 1
    assert router.route(prefix + ids(rng, 1), [100, 163]) == 0  # much more loaded: spills to 0
    # Both hold the prefix now: the less loaded holder gets it.
    assert router.route(prefix + ids(rng, 5), [30, 20]) == 1
    assert router.route(prefix + ids(rng, 5), [20, 30]) == 0
    # Another prompt sharing only the first block: both hold it, the less loaded wins.
    assert router.route(prefix[:BS] + ids(rng, 9), [3, 1]) == 1


def test_router_longest_held_prefix_wins_and_last_token_is_never_cached():
    rng = random.Random(SEED)
    router = Router(3, BS)
    a, b, c = ids(rng, BS), ids(rng, BS), ids(rng, BS)
    assert router.route(a + [1], [0, 1, 1]) == 0  # holds block a
    assert router.route(a + b + [1], [1, 1, 0]) == 0  # a held by 0: affinity (1 <= 0 + 4)
    assert router.route(ids(rng, 3) + [1], [9, 9, 0]) == 2
    # 2 takes a + b + c (prompt of exactly 3 blocks: its last block holds the last token, which
    # is always computed, so only a, b count) -> it holds a, b only.
    assert router.route(a + b + c, [50, 1, 0]) == 2
    assert router.held_blocks(router.prefix_blocks(a + b + c + [1])) == [2, 0, 2]
    # a + b held by 0 and 2 alike (2 blocks each): the less loaded of them, not the idle 1.
    assert router.route(a + b + [7, 7], [4, 0, 3]) == 2


def test_router_forgets_the_least_recent_blocks_past_capacity():
    rng = random.Random(SEED)
    router = Router(2, BS, capacity=3)
    old, new = ids(rng, 2 * BS), ids(rng, 2 * BS)
    router.route(old + [1], [1, 0])  # 1 holds old's 2 blocks
    router.route(new + [1], [0, 1])  # 0 holds new's 2 blocks: old's first block is forgotten
    assert router.held_blocks(router.prefix_blocks(old + [1])) == [0, 0]
    assert router.held_blocks(router.prefix_blocks(new + [1])) == [2, 0]


def test_request_cost_is_prompt_and_new_tokens_within_the_context():
    assert request_cost(10, 20, 100) == 30
    assert request_cost(10, 10**9, 100) == 100
    assert request_cost(100, 5, 100) == 101  # a prompt filling the context still takes a token


def test_replica_devices_and_too_few_devices_name_the_flag():
    d = [types.SimpleNamespace(id=i, platform="gpu") for i in range(4)]
    assert replica_devices(2, devices=d) == [(d[0],), (d[1],)]
    assert replica_devices(2, 2, devices=d) == [(d[0], d[1]), (d[2], d[3])]
    with pytest.raises(ValueError, match="--data-parallel-size 3 x --tensor-parallel-size 2 "):
        replica_devices(3, 2, devices=d)
    # This process (and each engine process it spawns) sees one CPU device: asking for more
    # fails before any model is loaded, in engine processes (every one stopped) or on threads.
    with pytest.raises(ValueError, match="--data-parallel-size 2 needs 2 devices"):
        LLM("random:tiny", data_parallel_size=2)
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="--data-parallel-size 2 needs 2 devices"):
        LLM("random:tiny", data_parallel_size=2, engine_process=False)
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        EngineConfig(model="random:tiny", data_parallel_size=0)


def test_serve_cli_refuses_more_replicas_than_devices(capsys):
    """With the engine on a thread, before it listens (in process: uvicorn, once it runs,
    binds its log handlers to this test's captured stderr)."""
    args = ["--model", "random:tiny", "--no-warmup", "--data-parallel-size", "3"]
    assert serve_cli.main([*args, "--no-engine-process"]) == 2
    assert "--data-parallel-size 3 needs 3 devices" in capsys.readouterr().err


@pytest.mark.slow  # a server subprocess and its engine processes
def test_serve_cli_engine_processes_refuse_more_replicas_than_devices():
    """With engine processes (the default with several replicas), once a child finds too few
    devices."""
    args = ["--model", "random:tiny", "--no-warmup", "--data-parallel-size", "3", "--port", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "rosejax.serve", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "--data-parallel-size 3 needs 3 devices" in proc.stderr


def test_metrics_carry_a_replica_label():
    metrics = ServerMetrics()
    snapshots = [{"running": 2, "kv_blocks_used": 7}, {"running": 1, "kv_blocks_used": 0}]
    replicas = [metrics.replica(i, lambda i=i: snapshots[i]) for i in (0, 1)]
    replicas[1].generation_tokens.inc(5)
    replicas[1].finished("abort").inc()
    replicas[0].ttft.observe(0.01)
    metrics.rejected.labels("overloaded").inc()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert samples[("rosejax_requests_running", (("replica", "0"),))] == 2
    assert samples[("rosejax_kv_blocks_used", (("replica", "1"),))] == 0
    assert samples[("rosejax_generation_tokens_total", (("replica", "1"),))] == 5
    assert samples[("rosejax_requests_finished_total", (("reason", "abort"), ("replica", "1")))]
    assert samples[("rosejax_time_to_first_token_seconds_count", (("replica", "0"),))] == 1
    assert samples[("rosejax_requests_rejected_total", (("reason", "overloaded"),))] == 1


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_with_devices(devices: int, *argv: str) -> str:
    """`python argv...` with `devices` host devices (flags that must precede jax's start); its
    stdout, or the test fails with its output."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    )
    out = subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"seed {SEED}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    return out.stdout


@pytest.mark.slow  # a subprocess that compiles three engines' programs
def test_two_replicas_give_one_engines_tokens_and_serve_behind_one_server():
    out = run_with_devices(4, "-m", "tests.data_parallel_checks", str(SEED), "--server")
    assert out.strip().endswith("ok")


@pytest.mark.slow  # a subprocess that spawns two engine processes
def test_two_replicas_in_engine_processes_give_one_engines_tokens():
    out = run_with_devices(4, "-m", "tests.data_parallel_checks", str(SEED), "--engine-process")
    assert out.strip().endswith("ok")


@pytest.mark.slow  # launches two servers and builds an engine of two replicas
def test_benchmark_data_parallel_end_to_end(tmp_path):
    path = tmp_path / "dp.json"
    engine = ["--model", "random:tiny", "--no-warmup", "--max-batch-size", "4", "--block-size"]
    engine += ["16", "--kv-cache-tokens", "512", "--decode-steps", "4", "--seed", str(SEED)]
    workload = ["--num-prompts", "6", "--input-len", "4", "--output-len", "5", "--per-replica"]
    runs = ["--warmup-runs", "2", "--repeat-runs", "3", "--no-progress", "--json", str(path)]
    out = run_with_devices(2, "bench/benchmark_data_parallel.py", *engine, *workload, *runs)
    data = json.loads(path.read_text())
    assert data["replicas"] == 2
    for side in ("http", "in_process"):
        r = data[side]
        for k in ("1", "2"):
            tok_s = r[k]["output_throughput_tok_s"]
            assert len(tok_s) == 3 and min(tok_s) > 0 and r[k]["median"] == sorted(tok_s)[1]
            assert r[k]["requests"] == 6 * int(k)  # --per-replica: each replica gets 6
        assert r["ratio"] == pytest.approx(r["2"]["median"] / r["1"]["median"])
        assert f"{r['ratio']:.3f}" in out
    devices = data["in_process"]["devices"]  # one device each, not the same one
    assert [len(d) for d in devices] == [1, 1] and devices[0] != devices[1]
    assert all(h["wait"] > 0 for h in data["in_process"]["host_seconds"])
