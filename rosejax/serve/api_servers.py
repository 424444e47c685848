"""Several API server processes in front of the engine processes (`--api-server-count N`, as
vLLM's flag): one event loop admitting a burst of hundreds of requests (HTTP, JSON, tokenizing,
checks) delays every first token; N event loops in N processes share that work.

- The main process binds the listening socket, spawns the engine processes (each with a pipe
  to every API server: `EngineProcesses(api_servers=N)`) and API servers 1..N-1 (the `spawn`
  start method: jax must never be forked), handing each the socket and its pipe ends; it is API
  server 0 itself. The kernel gives each connection to whichever process accepts it first.
- Each API server process loads the tokenizer, connects to the engine processes
  (`EngineProcesses(links=...)`) and serves as the main process does (`cli.run_server`). All N
  start serving together (`ReadyTogether`): until then each answers 503 (/health too), so once
  any /health says 200 no connection lands on one still loading.
- /metrics: every API server keeps its request counters and latency histograms in a directory
  the main process makes for the server (`ServerMetrics(shared_dir=...)`) and removes at its
  stop, so each scrape sums every API server's; the engine gauges come from the engine
  processes' snapshots (`rosejax.serve.metrics`).
- Stop: SIGINT/SIGTERM to the main process begins its shutdown by sending SIGTERM to the others,
  so all drain at once as one server does (`--shutdown-timeout`); each engine process stops once
  API server 0 says so and every other API server's pipe has closed. A terminal's Ctrl-C
  reaches every process: each drains on its own. An API server that dies is logged, the engine
  processes abort its requests, and the rest serve on; one whose main process dies stops itself
  (the engine processes stop as their pipe to API server 0 closes).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from rosejax.engine.engine_process import EngineLink
from rosejax.serve.cli import configure_logging, max_waiting, run_server
from rosejax.serve.engine_process import EngineProcesses
from rosejax.serve.protocol import Limits
from rosejax.settings import EngineConfig

log = logging.getLogger("rosejax.serve")

# How long past the shutdown timeout an API server has to end before it is killed.
_STOP_MARGIN_S = 10.0
# How long a built API server waits for the others before it serves alone (one died or hangs).
READY_TOGETHER_TIMEOUT_S = 120.0


class ReadyTogether:
    """A count the N API server processes share: each adds itself once its app is built, then
    waits until all N have (see the module). Passed to the spawned processes."""

    def __init__(self, ctx: Any, count: int):
        self.count = count
        self.built = ctx.Value("i", 0)

    def arrive_and_wait(
        self, stop: Callable[[], bool], timeout: float = READY_TOGETHER_TIMEOUT_S
    ) -> bool:
        """Count this process built, then wait for the rest; False if `stop()` turned true or
        `timeout` passed first (logged: this one serves without them)."""
        with self.built.get_lock():
            self.built.value += 1
        deadline = time.monotonic() + timeout
        while self.built.value < self.count:
            if stop():
                return False
            if time.monotonic() > deadline:
                log.warning(
                    "%d of %d API servers ready after %.0f s; serving without the rest",
                    self.built.value,
                    self.count,
                    timeout,
                )
                return False
            time.sleep(0.02)
        return True


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host`:`port` that every API server process accepts on."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=2048)


class ApiServers:
    """API server processes 1..N-1, spawned by the main process (API server 0; see the
    module), and the directory all N keep their metrics in (`metrics_dir`). OSError: the port
    could not be bound."""

    def __init__(
        self,
        args: argparse.Namespace,
        config: EngineConfig,
        limits: Limits,
        template: str | None,
        sampling_defaults: dict[str, Any],
        engines: EngineProcesses,
    ):
        self.sock = bind_socket(args.host, args.port)
        self.metrics_dir = tempfile.mkdtemp(prefix="rosejax-metrics-")
        self.stop_timeout = args.shutdown_timeout + _STOP_MARGIN_S
        self.stopping = False
        self.processes: list[Any] = []
        ctx = multiprocessing.get_context("spawn")  # jax must never be forked
        self.ready_together = ReadyTogether(ctx, args.api_server_count)
        try:
            for index, links in enumerate(engines.api_server_links(), start=1):
                process = ctx.Process(
                    target=_api_server_main,
                    args=(
                        index,
                        self.sock,
                        links,
                        args,
                        config,
                        limits,
                        template,
                        sampling_defaults,
                        self.metrics_dir,
                        self.ready_together,
                    ),
                    name=f"rosejax-api-server-{index}",
                    daemon=True,  # multiprocessing terminates it if this process exits first
                )
                process.start()
                self.processes.append(process)
                for link in links:  # it has its own copies: its death reads as EOF there
                    link.conn.close()
        except BaseException:
            self.stop()
            engines.close()
            raise
        threading.Thread(target=self._watch, name="rosejax-api-servers", daemon=True).start()

    def _watch(self) -> None:
        """Log each API server that ends before the stop."""
        left = {p.sentinel: p for p in self.processes}
        while left:
            for sentinel in multiprocessing.connection.wait(list(left)):
                process = left.pop(sentinel)
                process.join()
                if not self.stopping:
                    log.error(
                        "API server process %s (pid %d) exited with code %s; the others serve on",
                        process.name,
                        process.pid,
                        process.exitcode,
                    )

    def begin_shutdown(self) -> None:
        """SIGTERM to every API server process: each drains as the main process does."""
        self.stopping = True
        for process in self.processes:
            if process.is_alive():
                process.terminate()

    def stop(self) -> None:
        """`begin_shutdown`, wait for them to end, kill those left; close the socket and remove
        the metrics directory."""
        self.begin_shutdown()
        deadline = time.monotonic() + self.stop_timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.warning("API server process %s did not stop; killing it", process.name)
                process.kill()
                process.join(5)
        self.sock.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


def _exit_with_parent() -> None:
    """Stop this API server (as SIGTERM does) once the main process has gone."""
    multiprocessing.parent_process().join()
    log.warning("the main server process has gone; this API server stops")
    os.kill(os.getpid(), signal.SIGTERM)


def _api_server_main(
    index: int,
    sock: socket.socket,
    links: list[EngineLink],
    args: argparse.Namespace,
    config: EngineConfig,
    limits: Limits,
    template: str | None,
    sampling_defaults: dict[str, Any],
    metrics_dir: str,
    ready_together: ReadyTogether,
) -> None:
    configure_logging(args.log_level, f" [api server {index}]")
    threading.Thread(target=_exit_with_parent, name="rosejax-parent", daemon=True).start()

    def build() -> tuple[EngineProcesses, bool, Any]:
        engines = EngineProcesses(config, links=links)
        return engines, False, engines.close

    waiting = max_waiting(args, args.api_server_count)
    sys.exit(
        run_server(
            args,
            limits,
            template,
            sampling_defaults,
            build,
            waiting,
            sock=sock,
            metrics_dir=metrics_dir,
            ready_together=ready_together,
        )
    )
