"""Plain ASGI for the routes that carry the load (/v1/completions, /v1/chat/completions).

FastAPI's routing, its Request, dependency solving and StreamingResponse's task group cost a
request about 150 µs of the event loop's time before its first token: most of what 256 requests
arriving at once waited for. `ServingApp` answers those routes itself with the helpers here and
hands every other request to FastAPI, which also documents them (`openapi_paths`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from fastapi import FastAPI

from rosejax.serve.protocol import APIError, Limits

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its request's body arrived: nothing to answer."""


class ServingApp(FastAPI):
    """A FastAPI app whose POST routes in `fast_routes` (path -> ASGI handler) bypass it."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.fast_routes: dict[str, Handler] = {}

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        handler = self.fast_routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None:
            return await super().__call__(scope, receive, send)
        if scope["method"] != "POST":
            error = APIError(
                f"{scope['method']} is not allowed here", 405, headers={"Allow": "POST"}
            )
            return await send_json(send, error.status, error.body(), error.headers)
        await handler(scope, receive, send)


def _header(scope: dict[str, Any], name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return b""


async def read_body(scope: dict[str, Any], receive: Receive, limits: Limits) -> bytes:
    """The whole body: 413 past `max_body_bytes` (before reading any of it when the client
    says its length), 408 if it has not arrived within `read_timeout` seconds; ClientGone."""

    def too_large() -> APIError:
        return APIError(
            f"the request body is larger than this server's limit ({limits.max_body_bytes} "
            "bytes, --max-request-bytes)",
            413,
            code="request_too_large",
            headers={"Connection": "close"},  # the rest of the body is never read
        )

    length = _header(scope, b"content-length")
    if length.isdigit() and int(length) > limits.max_body_bytes:
        raise too_large()
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.read_timeout or None):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise too_large()
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise APIError(
            f"the request body did not arrive within {limits.read_timeout:g} s (--request-timeout)",
            408,
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None


def _headers(pairs: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in pairs]


async def send_json(
    send: Send, status: int, body: Any, headers: dict[str, str] | None = None
) -> None:
    """A JSON response, as FastAPI's JSONResponse writes it."""
    payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    pairs = [
        ("content-type", "application/json"),
        ("content-length", str(len(payload))),
        *(headers or {}).items(),
    ]
    await send({"type": "http.response.start", "status": status, "headers": _headers(pairs)})
    await send({"type": "http.response.body", "body": payload})


async def until_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (the body is read already, so only that can arrive)."""
    while (await receive())["type"] != "http.disconnect":
        pass


_SSE_HEADERS = _headers(
    [("content-type", "text/event-stream; charset=utf-8"), ("cache-control", "no-cache")]
)


async def send_events(
    send: Send, receive: Receive, events: AsyncIterator[str], gone: Callable[[], None]
) -> None:
    """Stream `events` (each a whole server-sent event); if the client leaves first, `gone()`,
    which must end `events` (what they still yield goes nowhere)."""
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    watcher = asyncio.ensure_future(until_disconnect(receive))
    watcher.add_done_callback(lambda task: task.cancelled() or gone())
    try:
        async for event in events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        watcher.cancel()


def openapi_paths(operations: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """OpenAPI path items for `fast_routes`: path -> (its POST operation: summary,
    operationId, requestBody, responses in FastAPI's `responses=` form, ErrorBody's schema
    named by `model`)."""
    paths = {}
    for path, op in operations.items():
        responses = {}
        for status, spec in op["responses"].items():
            spec = dict(spec)
            model = spec.pop("model", None)
            if model is not None:
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                spec["content"] = {"application/json": {"schema": ref}}
            responses[str(status)] = spec
        paths[path] = {"post": {**op, "responses": responses}}
    return paths
