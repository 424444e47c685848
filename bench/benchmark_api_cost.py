"""CPU an API server process spends per streamed /v1/completions request, without a GPU: the
real app (`create_app` over `EngineProcesses`) called through ASGI, its engine process a stub
that answers with scripted output rows, the HTTP server (uvicorn) left out.

    python -m bench.benchmark_api_cost                                # this checkout
    python -m bench.benchmark_api_cost --checkout ../main --checkout .  # before/after, alternated

Each round sends `--num-requests` requests at once (benchmark_serving's body: 8 prompt token
ids, `--output-len` new tokens, EOS off, usage in the stream) and splits the process's CPU time
(every thread: the event loop and the engine pipe's reader) in two halves:

- request: from the first request's call until every request's add has gone down the pipe to
  the engine process (body read, JSON, validation, SamplingParams, checks, the add posted);
- output: the stub then sends one message per decode window (the first token alone, then
  `--window` tokens each, every `--window-ms`), as an engine process does: from the first
  message until every stream has ended (rows read back into RequestOutputs, delivered with the
  metrics observed, SSE chunks built and handed to ASGI `send`).

Each checkout runs in processes of its own (`--runs` of them, alternated A B A B ...), and each
checks that every stream ended with `[DONE]`; the table gives the median µs per request over
all rounds, whether the checkouts' streams carried the same bytes (ids and times aside), and
the ASGI messages a request sent (uvicorn writes each to the socket: its cost is not counted).
Metrics are kept in prometheus_client's multiprocess mode, as with several API servers (the
default); `--no-shared-metrics` keeps them in memory, as with one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAPSHOT = {
    "running": 0,
    "waiting": 0,
    "kv_blocks_used": 0,
    "kv_blocks_total": 10**6,
    "prefix_hits": 0,
    "prefix_hit_tokens": 0,
    "programs_to_compile": 0,
}


def window_sizes(output_len: int, window: int) -> list[int]:
    """New tokens per engine message: the prefill's first token, then decode windows."""
    sizes = [1]
    while sum(sizes) < output_len:
        sizes.append(min(window, output_len - sum(sizes)))
    return sizes


def stub_engine(conn: Any, model: str, output_len: int, window: int, window_s: float) -> None:
    """An engine process's end of the pipe: "ready" with a `ReplicaInfo` of `random:<model>`,
    then it notes each "add" and, on ("go",), streams every request added so far: the same
    random tokens (decoded by the model's tokenizer) for each, a message per window."""
    from multiprocessing.reduction import ForkingPickler

    import numpy as np

    from rosejax.engine.engine_process import ReplicaInfo
    from rosejax.engine.output_rows import RowWriter
    from rosejax.engine.request import CompletionOutput, RequestOutput
    from rosejax.models import preset
    from rosejax.tokenizer import load_tokenizer

    conn.send(("ready", ReplicaInfo(preset(model), 256, 64, "cpu", [0], SNAPSHOT)))
    tokenizer = load_tokenizer(f"random:{model}")
    ids = np.random.default_rng(0).integers(0, 50000, output_len).tolist()
    pieces, at = [], 0
    for size in window_sizes(output_len, window):
        pieces.append((ids[at : at + size], tokenizer.decode(ids[at : at + size])))
        at += size
    added: list[tuple[str, list[int]]] = []
    try:
        while True:
            for cmd in conn.recv():
                if cmd[0] == "add":
                    added += cmd[1]
                elif cmd[0] == "go":
                    # Every message made (and pickled, as `conn.send` does) before the first
                    # goes out, so this process's work does not share the CPU with the API
                    # process's while it is measured.
                    writer, messages = RowWriter(), []
                    tokens, text = [], ""
                    for w, (new_ids, new_text) in enumerate(pieces):
                        tokens, text = tokens + new_ids, text + new_text
                        reason = "length" if w == len(pieces) - 1 else None
                        seq = CompletionOutput(
                            0, text, tokens, None, None, reason, new_ids, new_text
                        )
                        outs = [
                            RequestOutput.from_outputs(r, p, [seq], None, reason is not None)
                            for r, p in added
                        ]
                        message = ("out", [writer.row(o) for o in outs], SNAPSHOT)
                        messages.append(ForkingPickler.dumps(message))
                    for message in messages:
                        conn.send_bytes(message)
                        time.sleep(window_s)
                    added = []
    except EOFError:  # the API process has gone
        pass


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """This process as one API server: `--rounds` timed rounds after an untimed one."""
    import uvloop

    from rosejax.engine.engine_process import EngineLink
    from rosejax.serve.app import create_app
    from rosejax.serve.engine_process import EngineProcesses
    from rosejax.serve.metrics import ServerMetrics
    from rosejax.settings import EngineConfig, freeze_heap

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    stub_args = (there, args.model, args.output_len, args.window, args.window_ms / 1000)
    stub = ctx.Process(target=stub_engine, args=stub_args, daemon=True)
    stub.start()
    there.close()
    link = EngineLink(0, here, stub.pid)
    config = EngineConfig(model=f"random:{args.model}", max_batch_size=256)
    engines = EngineProcesses(config, links=[link])
    metrics_dir = tempfile.mkdtemp(prefix="api-cost-metrics-")
    metrics = None if args.no_shared_metrics else ServerMetrics(shared_dir=metrics_dir)
    app = create_app(engines, max_waiting=None, metrics=metrics)
    body = json.dumps(
        {
            "model": "rosejax",
            "prompt": list(range(1000, 1008)),
            "max_tokens": args.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"localhost"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    # Every add posted: the request half is over.
    send_to_engine, posted = link.send, {"adds": 0, "want": 0, "done": None}

    def counting_send(cmds: list) -> None:
        send_to_engine(cmds)
        posted["adds"] += sum(len(c[1]) for c in cmds if c[0] == "add")
        if posted["adds"] >= posted["want"]:
            posted["done"].set()

    link.send = counting_send

    async def one_round(n: int) -> tuple[float, float, float, bytes, float]:
        posted.update(adds=0, want=n, done=asyncio.Event())
        sent: list[list[dict]] = [[] for _ in range(n)]
        never = asyncio.Event()  # no client leaves

        def receiver() -> Any:
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict:
                if messages:
                    return messages.pop()
                await never.wait()

            return receive

        start = time.process_time()
        calls = [app(dict(scope), receiver(), _async_send(out.append)) for out in sent]
        tasks = [asyncio.ensure_future(call) for call in calls]
        await posted["done"].wait()
        submitted, loop_submitted = time.process_time(), time.thread_time()
        send_to_engine([("go",)])
        await asyncio.gather(*tasks)
        ended, loop_ended = time.process_time(), time.thread_time()
        streams = [b"".join(m.get("body", b"") for m in out[1:]) for out in sent]
        for out, stream in zip(sent, streams, strict=True):
            if out[0]["status"] != 200 or not stream.endswith(b"data: [DONE]\n\n"):
                raise RuntimeError(f"a stream did not end with [DONE]: {out[:2]} ... {out[-2:]}")
        return (
            (submitted - start) / n * 1e6,
            (ended - submitted) / n * 1e6,
            (loop_ended - loop_submitted) / n * 1e6,
            streams[0],
            sum(map(len, sent)) / n,
        )

    async def run() -> dict[str, Any]:
        app.state.engine.start()
        freeze_heap()  # as the server does once it serves
        await one_round(args.num_requests)
        rounds = [await one_round(args.num_requests) for _ in range(args.rounds)]
        app.state.engine.stop(5)
        return {
            "request_us": [r[0] for r in rounds],
            "output_us": [r[1] for r in rounds],
            "output_loop_us": [r[2] for r in rounds],
            "stream": _normalized(rounds[-1][3].decode()),
            "sends": rounds[-1][4],
        }

    try:
        return uvloop.run(run())
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _normalized(stream: str) -> str:
    """A stream's text with its request id and creation time replaced (they differ per run)."""
    stream = re.sub(r'"(chat)?cmpl-[0-9a-f]+"', '"ID"', stream)
    return re.sub(r'"created": \d+', '"created": 0', stream)


def _async_send(append: Any) -> Any:
    async def send(message: dict) -> None:
        append(message)

    return send


# The flags a worker process takes over from the command line.
WORKLOAD_FLAGS = ("rounds", "num_requests", "output_len", "window", "window_ms", "model")


def run_checkout(checkout: str, args: argparse.Namespace) -> dict[str, Any]:
    """One worker process measuring `checkout`'s rosejax (with this script)."""
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in WORKLOAD_FLAGS]
    flags += ["--no-shared-metrics"] if args.no_shared_metrics else []
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", *flags]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the worker for {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over every round of a checkout's runs."""

    def median(key: str) -> float:
        return statistics.median(x for r in runs for x in r[key])

    totals = [a + b for r in runs for a, b in zip(r["request_us"], r["output_us"], strict=True)]
    return {
        "request_us": median("request_us"),
        "output_us": median("output_us"),
        "output_loop_us": median("output_loop_us"),
        "total_us": statistics.median(totals),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--checkout",
        action="append",
        default=None,
        help="a checkout whose rosejax to measure (repeatable: their runs alternate, the first "
        "is the baseline); default: this one",
    )
    p.add_argument("--runs", type=int, default=3, help="worker processes per checkout")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per worker process")
    p.add_argument("--num-requests", type=int, default=256, help="requests per round, at once")
    p.add_argument("--output-len", type=int, default=256, help="new tokens per request")
    p.add_argument(
        "--window", type=int, default=32, help="tokens per engine message after the first"
    )
    p.add_argument("--window-ms", type=float, default=20.0, help="ms between engine messages")
    p.add_argument("--model", default="gpt2", help="the random:<preset> the stub engine serves")
    p.add_argument(
        "--no-shared-metrics",
        action="store_true",
        help="metrics in memory (one API server) instead of multiprocess mode's files",
    )
    p.add_argument("--json", default=None, help="write every round's figures here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args)))
        return 0
    checkouts = args.checkout or [HERE]
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in checkouts}
    for i in range(args.runs):
        for checkout in checkouts:
            r = run_checkout(checkout, args)
            results[checkout].append(r)
            request, output = (
                " ".join(f"{x:.0f}" for x in r[k]) for k in ("request_us", "output_us")
            )
            print(
                f"{checkout} run {i + 1}: request {request} | output {output} µs/request",
                file=sys.stderr,
                flush=True,
            )
    print(f"API server CPU per streamed request (µs, median of {args.runs * args.rounds} rounds)")
    columns = ("request", "output", "(loop)", "total", "vs first", "same bytes", "sends")
    print(f"{'checkout':40}" + "".join(f"{c:>11}" for c in columns))
    summary = {}
    for checkout in checkouts:
        s = summary[checkout] = summarize(results[checkout])
        base = summary[checkouts[0]]
        first_stream = results[checkouts[0]][0]["stream"]
        s["same_stream"] = all(r["stream"] == first_stream for r in results[checkout])
        cells = [f"{s[k]:.0f}" for k in ("request_us", "output_us", "output_loop_us", "total_us")]
        cells += [f"{s['total_us'] / base['total_us']:.2f}", "yes" if s["same_stream"] else "NO"]
        cells.append(f"{results[checkout][0]['sends']:g}")
        print(f"{checkout[-40:]:40}" + "".join(f"{c:>11}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
