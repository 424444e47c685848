"""Data-parallel checks that need several devices, run by tests/test_data_parallel.py in a
subprocess whose XLA_FLAGS give jax 4 host devices (flags must be set before jax starts, and the
test process's jax has started): `python -m tests.data_parallel_checks SEED [--server]`.

A data-parallel engine of 2 replicas on threads of this process (`DataParallelEngine`; replicas
in engine processes: tests/test_process_engine.py) against one engine (fp32, random weights): the
same greedy and seeded sampled tokens for the same prompts, both replicas used, each one's arrays
and program outputs on its own device, a prompt routed to the replica holding its prefix (a
prefix-cache hit there); with --server, the same engine behind the HTTP server: concurrent requests answered as
one engine answers them, per-replica metrics, aborts reaching their replica, /health; with
--engine-process, only the server, its 2 replicas in processes of their own (devices 0 and 1).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time

import httpx
import jax
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from rosejax import LLM, SamplingParams
from rosejax.serve import create_app
from rosejax.serve.engine_process import EngineProcesses
from rosejax.serve.server import ServerThread
from rosejax.settings import EngineConfig

MODEL = "random:tiny"
BLOCK = 16


def engine_args(seed: int) -> dict:
    # A fixed decode window and few rows: few programs to compile.
    return dict(
        seed=seed,
        warmup=False,
        max_batch_size=4,
        block_size=BLOCK,
        kv_cache_tokens=1024,
        decode_steps=4,
        dtype="float32",
    )


def arrays_devices(engine) -> set:
    runner = engine.runner
    leaves = jax.tree.leaves((runner.params, runner.cache, runner.state))
    return {d for x in leaves for d in x.devices()}


def check_engine(seed: int) -> tuple[LLM, LLM]:
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, 50000, rng.integers(3, 14))] for _ in range(7)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 13)), temperature=0) for _ in prompts]
    params[1] = SamplingParams(max_tokens=9, temperature=0.9, top_k=20, seed=int(rng.integers(99)))
    one = LLM(MODEL, **engine_args(seed))
    dp = LLM(MODEL, data_parallel_size=2, engine_process=False, **engine_args(seed))
    engine = dp.engine
    # What a server compiles before it serves, on every replica's devices, then runs on.
    engine.compile_ahead(*engine.warmup_programs()[:3])
    assert [r.num_compiles for r in engine.replicas] == [3, 3]
    want = [o.token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    got = [o.token_ids for o in dp.generate(prompts, params, use_tqdm=False)]
    assert got == want, (got, want)
    compiles = [r.num_compiles for r in engine.replicas]
    assert [o.token_ids for o in dp.generate(prompts, params, use_tqdm=False)] == want
    assert [r.num_compiles for r in engine.replicas] == compiles  # the same programs again

    devices = [arrays_devices(r) for r in engine.replicas]
    assert devices == [{jax.devices()[0]}, {jax.devices()[1]}], devices
    assert arrays_devices(one.engine) == {jax.devices()[0]}
    used = [r.prefill_tokens_computed for r in engine.replicas]
    assert all(used) and sum(used) == 2 * sum(map(len, prompts)), used  # no prefix hits
    assert engine.loads == [0, 0] and not engine.has_unfinished_requests()

    # Prefix affinity: a prompt whose two leading blocks replica 1 served goes there, though
    # replica 0 is as idle, and reuses those blocks from its prefix cache.
    shared = [int(t) for t in rng.integers(0, 50000, 2 * BLOCK)]
    other = [int(t) for t in rng.integers(0, 50000, 5)]
    greedy = SamplingParams(max_tokens=3, temperature=0)
    dp.generate([other, shared + [1, 2]], greedy, use_tqdm=False)  # 0 least loaded, then 1
    hits = [r.allocator.prefix_hit_tokens for r in engine.replicas]
    tail = [int(t) for t in rng.integers(0, 50000, 3)]
    outputs = dp.generate_stream(shared + tail, greedy, request_ids=["affine"])
    next(outputs)  # admitted: its blocks are allocated
    assert engine.replica_of("affine") == 1
    assert engine.replicas[1].allocator.prefix_hit_tokens == hits[1] + 2 * BLOCK
    assert engine.replicas[0].allocator.prefix_hit_tokens == hits[0]
    last = list(outputs)[-1]
    assert last.finished
    assert last.token_ids == one.generate(shared + tail, greedy, use_tqdm=False)[0].token_ids
    return one, dp


def scrape(url: str) -> dict[str, float]:
    """/metrics samples keyed by name and sorted labels."""
    out = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def idle(url: str) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:
        m = scrape(url)
        busy = [
            m[f"rosejax_{k}{{replica={r}}}"]
            for r in (0, 1)
            for k in ("requests_running", "requests_waiting", "kv_blocks_used")
        ]
        if not any(busy) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def check_server(seed: int, one: LLM, engine) -> None:
    """`engine` (a `DataParallelEngine`, or `EngineProcesses` of 2 replicas) behind the server
    answers as `one` does."""
    rng = np.random.default_rng(seed + 1)
    prompts = [[int(t) for t in rng.integers(0, 50000, rng.integers(2, 12))] for _ in range(16)]
    lengths = [int(rng.integers(2, 12)) for _ in prompts]
    want = [
        one.generate(p, SamplingParams(max_tokens=n, temperature=0), use_tqdm=False)[0].text
        for p, n in zip(prompts, lengths, strict=True)
    ]
    app = create_app(engine, served_model_name="tiny")
    with ServerThread(app) as server:
        url = server.url
        before = scrape(url)

        async def ask(h: httpx.AsyncClient, prompt, n: int) -> str:
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
            r = await h.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        async def all_at_once() -> list[str]:
            async with httpx.AsyncClient(timeout=120) as h:
                jobs = [ask(h, p, n) for p, n in zip(prompts, lengths, strict=True)]
                return await asyncio.gather(*jobs)

        assert asyncio.run(all_at_once()) == want
        m = idle(url)
        made = [
            m[f"rosejax_generation_tokens_total{{replica={r}}}"]
            - before.get(f"rosejax_generation_tokens_total{{replica={r}}}", 0)
            for r in (0, 1)
        ]
        assert all(made) and sum(made) == sum(lengths), made

        # A client that leaves mid-stream: its request is aborted on its own replica.
        body = {"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        m = idle(url)
        aborts = [
            m.get(f"rosejax_requests_finished_total{{reason=abort,replica={r}}}", 0) for r in (0, 1)
        ]
        assert sorted(aborts) == [0, 1], aborts
        for r in (0, 1):
            assert m[f"rosejax_kv_blocks_used{{replica={r}}}"] == 0
            assert m[f"rosejax_kv_blocks_total{{replica={r}}}"] > 0
        assert httpx.get(url + "/health").status_code == 200
        app.state.engine.engines[1].stop()  # one replica down: the server is not healthy
        assert httpx.get(url + "/health").status_code == 503


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("seed", type=int)
    p.add_argument("--server", action="store_true")
    p.add_argument("--engine-process", action="store_true", help="only the server, 2 processes")
    args = p.parse_args()
    assert len(jax.devices()) >= 2, jax.devices()
    if args.engine_process:
        one = LLM(MODEL, **engine_args(args.seed))
        config = EngineConfig(model=MODEL, data_parallel_size=2, **engine_args(args.seed))
        engine = EngineProcesses(config)
        assert [c.info.device_ids for c in engine.children] == [[0], [1]]
        check_server(args.seed, one, engine)
        assert multiprocessing.active_children() == []  # the server stopped every child
    else:
        one, dp = check_engine(args.seed)
        if args.server:
            check_server(args.seed, one, dp.engine)
    print("ok")


if __name__ == "__main__":
    main()
