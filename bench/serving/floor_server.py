"""An OpenAI-compatible completions server with no engine: the HTTP floor of a host. It streams
each request's `max_tokens` as a decode loop of a given speed would (the first token at once,
then a window of `--window` tokens every `--window` x `--tpot-ms`), from `--api-server-count`
uvicorn processes on one socket, as `python -m rosejax.serve` does. What a benchmark measures
against it is what the clients, the sockets and an event loop cost alone: a burst's TTFT over
HTTP can be no better on that host, and its throughput no better at that TPOT.

    python -m bench.serving.floor_server --port 8000 --tpot-ms 0.88
    python bench/compare_servers.py ... --floor 0.88   # a `floor` row beside the servers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODEL = "floor"


def _event(rid: str, created: int, choices: list, usage: dict | None = None) -> bytes:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": MODEL}
    chunk |= {"choices": choices} | ({"usage": usage} if usage else {})
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def create_app(tpot_s: float, window: int) -> Starlette:
    """The app: /health, /v1/models and a streaming /v1/completions (one " x" a token)."""

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> JSONResponse:
        card = {"id": MODEL, "object": "model", "owned_by": "bench"}
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        max_tokens = body.get("max_tokens")
        max_tokens = 16 if max_tokens is None else int(max_tokens)
        prompt = body.get("prompt")
        usage = {
            "prompt_tokens": len(prompt) if isinstance(prompt, list) else 0,
            "completion_tokens": max_tokens,
        }
        usage["total_tokens"] = usage["prompt_tokens"] + max_tokens
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        async def events() -> AsyncIterator[bytes]:
            loop = asyncio.get_running_loop()
            start, sent = loop.time(), 0
            while sent < max_tokens:
                n = 1 if sent == 0 else min(window, max_tokens - sent)
                sent += n
                # the token that ends this window comes (sent - 1) decode steps after the first
                await asyncio.sleep(max(0.0, start + (sent - 1) * tpot_s - loop.time()))
                finish = "length" if sent == max_tokens else None
                choice = {"index": 0, "text": " x" * n, "logprobs": None, "finish_reason": finish}
                yield _event(rid, created, [choice])
            yield _event(rid, created, [], usage) + b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _serve(sock: socket.socket, tpot_s: float, window: int) -> None:
    config = uvicorn.Config(
        create_app(tpot_s, window), log_level="warning", access_log=False, lifespan="off"
    )
    # uvicorn stops gracefully on SIGINT/SIGTERM and then re-raises the signal under the handlers
    # it found: no-op ones make a requested stop exit 0, as rosejax.serve's.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; default: %(default)s")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; default: %(default)s")
    p.add_argument(
        "--api-server-count",
        type=int,
        # rosejax.serve's default for one replica (not imported: that would import jax)
        default=max(1, min(4, len(os.sched_getaffinity(0)) // 4)),
        help="uvicorn processes on the one socket; default: %(default)s",
    )
    p.add_argument(
        "--tpot-ms",
        type=float,
        default=1.0,
        help="ms between a stream's tokens after the first; default: %(default)s",
    )
    p.add_argument(
        "--window",
        type=int,
        default=32,
        help="tokens an event carries after the first; default: %(default)s",
    )
    args = p.parse_args(argv)
    if args.api_server_count < 1 or args.window < 1 or args.tpot_ms < 0:
        p.error("--api-server-count and --window must be >= 1, --tpot-ms >= 0")
    sock = socket.create_server((args.host, args.port), backlog=2048)
    serving = (sock, args.tpot_ms / 1e3, args.window)
    ctx = multiprocessing.get_context("fork")  # no jax here: forking is safe and quick
    for _ in range(args.api_server_count - 1):  # daemons: they end with this process
        ctx.Process(target=_serve, args=serving, daemon=True).start()
    _serve(*serving)
    return 0


if __name__ == "__main__":
    sys.exit(main())
