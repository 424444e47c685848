"""The HTTP side: streamed /v1/completions clients (aiohttp or httpx), in this process or in
client processes timed from one instant."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from typing import Any

from bench.serving.records import Record
from bench.serving.workload import Sample


def pick_client(name: str) -> str:
    if name != "auto":
        return name
    try:
        import aiohttp  # noqa: F401

        return "aiohttp"
    except ImportError:
        return "httpx"


def client_version(name: str) -> str:
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def run_client(coro: Any) -> Any:
    """Run the client's coroutine on uvloop where it is installed (uvicorn[standard] brings it):
    a client that reads hundreds of streams must not be what the figures measure."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def client_loop() -> str:
    return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


class HTTPStatusError(Exception):
    pass


@contextlib.asynccontextmanager
async def open_session(client: str, connections: int | None):
    """An HTTP session of `client` whose post_lines(url, body) yields the response's lines."""
    if client == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=connections or 0)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:

            async def post_lines(url: str, body: dict) -> AsyncIterator[bytes]:
                async with session.post(url, json=body) as r:
                    if r.status != 200:
                        raise HTTPStatusError(f"HTTP {r.status}: {(await r.text())[:300]}")
                    async for line in r.content:
                        yield line

            yield post_lines
    else:
        import httpx

        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        async with httpx.AsyncClient(limits=limits, timeout=None) as session:

            async def post_lines(url: str, body: dict) -> AsyncIterator[bytes]:
                async with session.stream("POST", url, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        raise HTTPStatusError(f"HTTP {r.status_code}: {r.text[:300]}")
                    async for line in r.aiter_lines():
                        yield line.encode()

            yield post_lines


def completion_body(model: str, s: Sample, args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"include_usage": True}
    if args.continuous_usage_stats:
        options["continuous_usage_stats"] = True
    return {
        "model": model,
        "prompt": s.prompt,
        "max_tokens": s.output_len,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": options,
    } | ({} if args.logprobs is None else {"logprobs": args.logprobs})


class _StreamReader:
    """Feeds one response's SSE lines into its Record. Every chunk with a choice is an event,
    as vLLM's benchmark counts them (the server streams one for each step's new tokens, with
    or without text), but one that continuous usage stats say brought no token."""

    def __init__(self, rec: Record):
        self.rec = rec
        self.done = False
        self.exact = True  # every event carried cumulative usage so far
        self.seen = 0  # cumulative completion tokens at the last event

    def line(self, raw: bytes, now: float) -> None:
        raw = raw.strip()
        if not raw.startswith(b"data:"):
            return
        data = raw[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        rec = self.rec
        if "error" in obj:
            err = obj["error"]
            rec.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return
        usage = obj.get("usage") or None
        if not obj.get("choices"):  # the final usage chunk
            if usage:
                rec.output_tokens = int(usage.get("completion_tokens") or 0)
                rec.prompt_len = usage.get("prompt_tokens", rec.prompt_len)
            return
        new = None
        if usage and usage.get("completion_tokens") is not None:  # continuous usage stats
            total = int(usage["completion_tokens"])
            new, self.seen = total - self.seen, total
            if not new:
                return
        rec.event_s.append(now)
        if new is None:
            self.exact = False
        elif self.exact:
            if rec.event_tokens is None:
                rec.event_tokens = []
            rec.event_tokens.append(new)

    def finish(self) -> None:
        rec = self.rec
        if not self.exact:
            rec.event_tokens = None
        if rec.disconnected:  # left on purpose: no [DONE], no usage
            return
        if rec.error is None and not self.done:
            rec.error = "the stream ended without data: [DONE]"
        if rec.error is None and not rec.event_s:
            rec.error = "nothing streamed"
        if rec.error is None and not rec.output_tokens:  # no usage: count what was streamed
            rec.output_tokens = sum(rec.event_tokens) if rec.event_tokens else len(rec.event_s)


async def run_http(
    url: str,
    model: str,
    samples: Sequence[Sample],
    offsets: Sequence[float],
    args: argparse.Namespace,
    client: str,
    tag: str = "http",
    indexes: Sequence[int] | None = None,
    start_at: float | None = None,
    max_concurrency: int | None = None,
) -> tuple[list[Record], float]:
    """Send samples[i] at offsets[i] after `start_at` (a `time.monotonic()` instant; default:
    now), at most `max_concurrency` in flight, and stream each answer; returns one Record per
    sample (numbered by `indexes`, default 0, 1, ...) and the duration (start to the last
    stream's end)."""
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(samples), desc=tag, unit="req", leave=False, mininterval=0.5)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    indexes = range(len(samples)) if indexes is None else indexes
    records = [
        Record(i, s.output_len, offsets[k], prompt_len=s.prompt_len)
        for k, (i, s) in enumerate(zip(indexes, samples, strict=True))
    ]
    f = args.disconnect_fraction
    for rec in records:  # evenly spread: request i leaves when floor(i * f) steps up
        if int((rec.index + 1) * f) > int(rec.index * f):
            rec.disconnect_after = args.disconnect_after
    async with open_session(client, max_concurrency) as post_lines:
        start = time.monotonic() if start_at is None else start_at

        async def consume(rec: Record, body: dict) -> None:
            reader = _StreamReader(rec)
            try:
                async with contextlib.aclosing(post_lines(url, body)) as lines:
                    async for raw in lines:
                        reader.line(raw, time.monotonic() - start)
                        if rec.disconnected:  # closing the response drops the connection
                            return
            except Exception as e:  # refused, reset, HTTP error, bad JSON
                rec.error = rec.error or f"{type(e).__name__}: {e}"[:300]
            finally:
                rec.end_s = time.monotonic() - start
                reader.finish()

        async def one(rec: Record, body: dict) -> None:
            # Again while early: uvloop's timers have millisecond resolution and may fire early.
            while (wait := start + rec.scheduled_s - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            async with sem or contextlib.nullcontext():
                rec.sent_s = time.monotonic() - start
                try:
                    await asyncio.wait_for(consume(rec, body), args.request_timeout)
                except asyncio.TimeoutError:
                    rec.error = f"timed out after {args.request_timeout:g} s"
            if bar is not None:
                bar.update(1)

        await asyncio.gather(
            *(
                one(r, completion_body(model, s, args))
                for r, s in zip(records, samples, strict=True)
            )
        )
        duration = time.monotonic() - start
    if bar is not None:
        bar.close()
    return records, duration


def http_get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def served_model(base_url: str) -> str:
    try:
        return http_get_json(base_url + "/v1/models")["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"no model from {base_url}/v1/models ({e}); is the server up?") from None


def _import_client(client: str) -> None:
    importlib.import_module(client)
    if importlib.util.find_spec("uvloop"):
        importlib.import_module("uvloop")


def _client_process(
    url: str,
    model: str,
    samples: list[Sample],
    offsets: list[float],
    indexes: list[int],
    args: argparse.Namespace,
    client: str,
    start_at: float,
    max_concurrency: int | None,
) -> tuple[list[Record], float]:
    return run_client(
        run_http(url, model, samples, offsets, args, client, "", indexes, start_at, max_concurrency)
    )


class Clients:
    """Runs workloads against one server's /v1/completions: in this process, or with request i
    in client process i mod --client-processes, all timed from one instant (CLOCK_MONOTONIC is
    the machine's, not a process's) and --max-concurrency shared out among them."""

    def __init__(self, args: argparse.Namespace, url: str, model: str, client: str):
        self.args, self.endpoint, self.model, self.client = (
            args,
            url + "/v1/completions",
            model,
            client,
        )
        self.processes = min(args.client_processes, args.max_concurrency or args.client_processes)
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.started: float | None = None  # the last run's start (client processes' clock)

    def __enter__(self) -> Clients:
        if self.processes > 1 or self.args.client_nice:
            ctx = multiprocessing.get_context("spawn")  # never fork a process that may run jax
            self.pool = concurrent.futures.ProcessPoolExecutor(
                self.processes,
                mp_context=ctx,
                initializer=os.nice,
                initargs=(self.args.client_nice,),
            )
            # Each process started and its client imported before any clock starts.
            for f in [self.pool.submit(_import_client, self.client) for _ in range(self.processes)]:
                f.result()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def run(
        self, samples: Sequence[Sample], offsets: Sequence[float], tag: str
    ) -> tuple[list[Record], float]:
        """One Record per sample, and the duration (start to the last stream's end)."""
        args, n = self.args, min(self.processes, len(samples))
        if self.pool is None:
            self.started = None  # run_http's own clock
            return run_client(
                run_http(
                    self.endpoint,
                    self.model,
                    samples,
                    offsets,
                    args,
                    self.client,
                    tag,
                    max_concurrency=args.max_concurrency,
                )
            )
        quiet = argparse.Namespace(**vars(args) | {"no_progress": True})
        start_at = self.started = time.monotonic() + 0.2  # every process waiting when it comes
        futures = []
        for k in range(n):
            idx = list(range(k, len(samples), n))
            limit = None
            if args.max_concurrency:
                limit = args.max_concurrency // n + (k < args.max_concurrency % n)
            part = ([samples[i] for i in idx], [offsets[i] for i in idx], idx)
            job = (self.endpoint, self.model, *part, quiet, self.client, start_at, limit)
            futures.append(self.pool.submit(_client_process, *job))
        parts = [f.result() for f in futures]
        records = sorted((r for recs, _ in parts for r in recs), key=lambda r: r.index)
        return records, max(d for _, d in parts)


# The engine's counters that tell how a run was served: a burst admitted in one prefill or in
# several (its later parts waiting behind a decode window), requests preempted.
ENGINE_COUNTERS = {
    "prefill_steps": "rosejax_prefill_steps_total",
    "preemptions": "rosejax_preemptions_total",
}
# Where the server's TTFT went (histograms, mean ms per request of the run): the API server to
# the engine, the engine's queue, the prefill; TTFT less the three is the way back.
ENGINE_TIMES = {
    "dispatch_ms": "rosejax_request_dispatch_time_seconds",
    "queue_ms": "rosejax_request_queue_time_seconds",
    "prefill_ms": "rosejax_request_prefill_time_seconds",
    "server_ttft_ms": "rosejax_time_to_first_token_seconds",
}


TTFT_PARTS = ("dispatch_ms", "queue_ms", "prefill_ms", "back_ms")


def ttft_parts(counts: dict[str, float]) -> str:
    """The server's mean TTFT of a run in its parts (TTFT_PARTS), as a line."""
    return "dispatch {:.1f} + queue {:.1f} + prefill {:.1f} + back {:.1f} = {:.1f} ms".format(
        *(counts[k] for k in TTFT_PARTS), counts["server_ttft_ms"]
    )


def metric_sums(base_url: str, names: Sequence[str]) -> dict[str, float] | None:
    """Each named sample of the server's /metrics summed over its labels (replicas, API
    servers); None if it does not answer."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
    except OSError:
        return None
    sums = dict.fromkeys(names, 0.0)
    for line in lines:
        name = line.split("{")[0].split(" ")[0]
        if name in sums:
            sums[name] += float(line.split()[-1])
    return sums


def run_http_side(
    args: argparse.Namespace,
    url: str,
    samples: list[Sample],
    offsets: list[float],
    warmups: list[list[Sample]],
    client: str,
) -> tuple[list[Record], float, str, dict[str, float]]:
    """The warm-ups, then the timed run: its records, duration, the model name sent, and
    ENGINE_COUNTERS' growth over it and the mean of each ENGINE_TIMES over it (empty if the
    server has no /metrics)."""
    model = args.served_model_name or served_model(url)
    names = list(ENGINE_COUNTERS.values())
    names += [f"{name}_{part}" for name in ENGINE_TIMES.values() for part in ("sum", "count")]
    with Clients(args, url, model, client) as clients:
        for r, ws in enumerate(warmups):
            recs, _ = clients.run(ws, offsets, f"warm-up {r}")
            bad = [x.error for x in recs if not x.ok and not x.disconnected]
            if bad:
                print(f"warm-up {r}: {len(bad)} requests failed, e.g. {bad[0]}", file=sys.stderr)
        before = metric_sums(url, names)
        records, duration = clients.run(samples, offsets, "http")
        after = metric_sums(url, names)
        if clients.started is not None:
            print(
                f"the timed run's clients started at time.monotonic() {clients.started:.6f} "
                "(bench/step_timeline.py --start)",
                file=sys.stderr,
            )
    counts: dict[str, float] = {}
    if before and after:
        counts = {key: int(after[name] - before[name]) for key, name in ENGINE_COUNTERS.items()}
        for key, name in ENGINE_TIMES.items():
            n = after[f"{name}_count"] - before[f"{name}_count"]
            if n:
                counts[key] = 1e3 * (after[f"{name}_sum"] - before[f"{name}_sum"]) / n
        if counts.keys() >= ENGINE_TIMES.keys():  # (a server of before the parts has TTFT only)
            parts = sum(counts[k] for k in TTFT_PARTS[:3])
            counts["back_ms"] = counts["server_ttft_ms"] - parts
    return records, duration, model, counts
