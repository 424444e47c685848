"""uvicorn as rosejax runs it: a deadline on every request head, and a shutdown that answers.

- A client must send a request's head within the app's `Limits.read_timeout` of connecting (or
  of its previous response) or the connection is closed: a connection trickling a half-sent
  head holds nothing for long. (The app itself times out a half-sent body with a 408.)
- On SIGINT/SIGTERM new requests get 503 at once; open ones may finish for `shutdown_timeout`
  seconds, then each ends with an answer: a stream with an error event and `data: [DONE]`, a
  non-streamed request with a JSON 503. uvicorn's own deadline comes a little later, so the
  handlers have time to write those last bytes before it cancels what is left.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn[standard]'s C parser: a streamed event costs a fraction of h11's pure Python
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:
    HttpToolsProtocol = None

# How long past the shutdown timeout uvicorn waits for the handlers to write their last events.
_SHUTDOWN_MARGIN_S = 5.0


def _with_head_deadline(protocol: type, timeout: float) -> type:
    class WithHeadDeadline(protocol):
        """uvicorn's HTTP protocol, closing a connection whose next request head has not
        arrived `timeout` seconds after the connection opened or its last response ended."""

        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            # A pending timer would hold this protocol (its buffers, cycle and flow control)
            # for the rest of the timeout after its connection closed.
            self._cancel_head_deadline()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            self._cancel_head_deadline()
            if not self.transport.is_closing():
                self.head_timer = self.loop.call_later(timeout, self._head_deadline, self.cycle)

        def _cancel_head_deadline(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_deadline(self, cycle: Any) -> None:
            # A new head makes a new cycle: the same one means none came since the timer began.
            waiting = cycle is None or cycle.response_complete
            if self.cycle is cycle and waiting and not self.transport.is_closing():
                if isinstance(self, H11Protocol):
                    try:
                        self.conn.send(h11.ConnectionClosed())
                    except h11.LocalProtocolError:
                        pass
                self.transport.close()

    WithHeadDeadline.__name__ = f"{protocol.__name__}WithHeadDeadline"
    return WithHeadDeadline


def http_protocol(name: str = "auto") -> type:
    """uvicorn's protocol for `name` (its --http): auto = httptools where it is installed
    (uvicorn[standard]), else h11."""
    if name == "h11" or (name == "auto" and HttpToolsProtocol is None):
        return H11Protocol
    if name not in ("auto", "httptools"):
        raise ValueError(f"--http must be auto, h11 or httptools, got {name!r}")
    if HttpToolsProtocol is None:
        raise ValueError("--http httptools needs httptools: pip install 'uvicorn[standard]'")
    return HttpToolsProtocol


class Server(uvicorn.Server):
    """A uvicorn server for an app of `create_app` (see the module's docstring)."""

    def __init__(
        self,
        config: uvicorn.Config,
        app: Any,
        shutdown_timeout: float,
        on_shutdown: Callable[[], None] | None = None,
    ):
        super().__init__(config)
        self.app, self.shutdown_timeout, self.on_shutdown = app, shutdown_timeout, on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_shutdown is not None:  # the other API server processes stop meanwhile
            self.on_shutdown()
        engine = self.app.state.engine  # None while a LoadingApp still loads
        if engine is not None:
            engine.begin_shutdown(self.shutdown_timeout)
        await super().shutdown(sockets)


def make_server(
    app: Any,
    *,
    shutdown_timeout: float = 5.0,
    http: str = "auto",
    on_shutdown: Callable[[], None] | None = None,
    **uvicorn_kwargs: Any,
) -> Server:
    """The server for an app of `create_app` (or a `LoadingApp`) with the HTTP protocol `http`
    (`http_protocol`), calling `on_shutdown()` as its shutdown begins; `uvicorn_kwargs` go to
    `uvicorn.Config` (host, port, log_level, access_log, ...)."""
    timeout = app.state.limits.read_timeout
    protocol = http_protocol(http)
    config = uvicorn.Config(
        app,
        http=_with_head_deadline(protocol, timeout) if timeout else protocol,
        timeout_graceful_shutdown=shutdown_timeout + _SHUTDOWN_MARGIN_S,
        **uvicorn_kwargs,
    )
    return Server(config, app, shutdown_timeout, on_shutdown)


class ServerThread:
    """`make_server(app, ...)` run by a thread, on a loopback port bound before it starts (tests
    and benchmarks): `with ServerThread(app) as s: httpx.get(s.url + "/health")`."""

    def __init__(self, app: Any, shutdown_timeout: float = 5.0, **uvicorn_kwargs: Any):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        kwargs = {"log_level": "warning", "access_log": False} | uvicorn_kwargs
        self.server = make_server(app, shutdown_timeout=shutdown_timeout, **kwargs)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True  # what SIGINT and SIGTERM do
        self.thread.join(60)
        self.sock.close()
