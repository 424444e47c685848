"""The app a server listens with from its first second: while the model loads and its first
programs compile, every request is a 503 in OpenAI's shape (`/health`: {"status": "loading"}),
so a load balancer or a client sees a server that is coming up rather than a refused connection;
once the engine is built, `ready(app)` runs the real app's lifespan and hands every request to it.
"""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any

from rosejax.serve.asgi import send_json
from rosejax.serve.protocol import APIError, Limits


class LoadingApp:
    """An ASGI app that answers 503 until `ready(app)`, then is `app` (see the module)."""

    def __init__(self, limits: Limits):
        self.app: Any = None
        # What uvicorn and `make_server` read of an app: the limits now, the engine once ready.
        self.state = types.SimpleNamespace(limits=limits, engine=None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()  # the event loop runs: `ready` may hand over
        self._lifespan: Any = None  # the real app's lifespan context, entered by `ready`

    def ready(self, app: Any, timeout: float = 60.0) -> None:
        """Start `app`'s lifespan on the server's event loop and serve it from now on; called
        from the thread that built it, once the server runs."""
        if not self._started.wait(timeout):
            raise RuntimeError("the server's event loop did not start")
        asyncio.run_coroutine_threadsafe(self._enter(app), self._loop).result(timeout)

    async def _enter(self, app: Any) -> None:
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        self._lifespan = lifespan
        self.state.engine = app.state.engine
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self._run_lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            status, body = 503, {"status": "loading"}
        else:
            body = APIError(
                "the server is loading its model; retry once /health answers 200",
                503,
                type="server_error",
                code="loading",
            ).body()
            status = 503
        await send_json(send, status, body, {"Retry-After": "5"})

    async def _run_lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                self._started.set()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._lifespan is not None:
                    await self._lifespan.__aexit__(None, None, None)
                await send({"type": "lifespan.shutdown.complete"})
                return
