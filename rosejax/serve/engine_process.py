"""Engine processes behind the server: each replica's engine loop in a process of its own
(`--engine-process`, the server's default with several replicas; with one, the loop runs on a
thread), so that the API process's event loop (HTTP, JSON, SSE) and the replicas' host loops
never wait for one another's GIL. The child and its protocol: `rosejax.engine.engine_process`.

- Start: `EngineProcesses(config)` spawns one child per data-parallel replica, each warming up
  as the server does (the first programs, the rest while idle), and loads the tokenizer itself.
- The API process checks each request as `LLMEngine.add_request` would and counts the requests
  in flight (429), so an add needs no answer: the commands of one event-loop iteration go out in
  one message.
- A reader thread in the API process turns each child's rows back into the `RequestOutput`s the
  engine made and delivers them as `AsyncEngine` does (`EngineFront._deliver`: metrics observed
  there).
- A child that dies: its requests in flight end with a 500, /health answers 503, the log says
  how it ended. A child whose API process dies sees its pipe close and exits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from rosejax.engine.engine_process import EngineLink, spawn_children, wait_ready
from rosejax.engine.output_rows import RowReader
from rosejax.engine.request_checks import checked_prompt_ids
from rosejax.sampling import SamplingParams
from rosejax.serve.engine_loop import (
    EngineError,
    EngineFront,
    RequestStream,
    _shutting_down,
    _Sink,
)
from rosejax.serve.metrics import ServerMetrics
from rosejax.settings import EngineConfig

log = logging.getLogger("rosejax.serve")


class EngineProcess(EngineFront):
    """One replica whose engine runs in a child process: `AsyncEngine`'s interface for the app
    and `ReplicatedEngine` (see the module)."""

    def __init__(
        self,
        child: EngineLink,
        tokenizer: Any,
        token_texts: Any,
        max_waiting: int | None = None,
        metrics: ServerMetrics | None = None,
        poll_s: float = 0.05,
    ):
        info = child.info
        super().__init__(info.max_batch_size, max_waiting, metrics, child.replica, info.snapshot)
        self.child, self.tokenizer, self.config = child, tokenizer, info.model_config
        self.block_size = info.block_size
        self._outputs = RowReader(token_texts)
        self._outbox: list[tuple] = []  # commands not sent yet, in order
        self._outbox_lock = threading.Lock()
        self._send_lock = threading.Lock()  # held from taking the outbox to sending it: in order
        self._flush_scheduled = False
        self._stopping = False
        self._died: str | None = None
        self._poll_s = poll_s
        self._reader = threading.Thread(
            target=self._read, name=f"rosejax-engine-{child.replica}-reader", daemon=True
        )

    def start(self) -> None:
        self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self.child.stop(timeout)
        if self._reader.is_alive():
            self._reader.join(timeout)

    def begin_shutdown(self, grace: float) -> None:
        """As `AsyncEngine.begin_shutdown`: refuse new requests now, end open ones in `grace` s."""
        if self._cut_at is None:
            self._cut_at = time.monotonic() + grace

    @property
    def alive(self) -> bool:
        return (
            self._reader.is_alive()
            and self._died is None
            and not self._stopping
            and self._cut_at is None
        )

    async def submit(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams, request_id: str
    ) -> RequestStream:
        """Queue one request per prompt (all or none). ValueError: bad input; Overloaded."""
        kv_blocks = self.snapshot["kv_blocks_total"]
        sink, ids = self._register(
            prompts, params, request_id, self.tokenizer, self.config, kv_blocks, self.block_size
        )
        for rid, i in zip(sink.rids, ids, strict=True):
            self._outputs.expect(rid, i, params)
        self._post(("add", list(zip(sink.rids, ids, strict=True)), params))
        return RequestStream(self, sink)

    def abort(self, request_ids: Sequence[str]) -> None:
        gone = [rid for rid in request_ids if self._forget(rid) is not None]
        if gone:
            self.metrics.finished("abort").inc(len(gone))
            self._post(("abort", gone))

    def _abort_in_engine(self, rid: str) -> None:
        self._post(("abort", [rid]))

    def _forget(self, rid: str) -> _Sink | None:
        self._outputs.forget(rid)
        return super()._forget(rid)

    # ------------------------------------------------------------- sending commands

    def _post(self, cmd: tuple) -> None:
        """Send `cmd` after those posted before it: from the event loop once this iteration
        of it ends (with every command it posted, in one message), from another thread now."""
        with self._outbox_lock:
            self._outbox.append(cmd)
            if self._flush_scheduled:
                return
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                self._flush_scheduled = True
                loop.call_soon(self._flush)
                return
        self._flush()

    def _flush(self) -> None:
        with self._send_lock:
            with self._outbox_lock:
                cmds, self._outbox, self._flush_scheduled = self._outbox, [], False
            if cmds:
                self.child.send(cmds)

    # ------------------------------------------------------------- the reader thread

    def _read(self) -> None:
        conn = self.child.conn
        try:
            while True:
                if conn.poll(self._poll_s):
                    _, rows, self.snapshot = conn.recv()
                    outputs = [
                        out for row in rows if (out := self._outputs.output(row)) is not None
                    ]
                    self._deliver(outputs)
                if self._cut_at is not None and time.monotonic() >= self._cut_at and self._sinks:
                    self._fail_all(_shutting_down())
        except (EOFError, OSError):
            pass
        if self._stopping:
            self._fail_all(_shutting_down())
            return
        self._died = self.child.exit_code()
        log.error(
            "the engine process of replica %d (pid %s) died, exit code %s; failing its %d "
            "requests in flight",
            self.child.replica,
            self.child.pid,
            self._died,
            len(self._sinks),
        )
        self._fail_all(
            EngineError(
                f"the engine process of replica {self.child.replica} died (exit code "
                f"{self._died}); see the server log",
                500,
                "engine_died",
            )
        )


class EngineProcesses:
    """What `create_app` takes in place of an engine when each replica's engine runs in a
    process of its own: the model's config and tokenizer for the API process's checks, and one
    child per data-parallel replica (see the module). ValueError: a bad configuration."""

    def __init__(
        self,
        config: EngineConfig,
        log_level: int | None = None,
        wait: bool = True,
        api_servers: int = 1,
        links: Sequence[EngineLink] | None = None,
    ):
        """Spawn the children (with a pipe each for `api_servers` API processes: this one and
        those `api_server_links` are for) and load the tokenizer; or, given `links` (another
        API server's ends, one per replica), connect to children spawned elsewhere. With
        `wait`, `wait_ready` too (without it, the caller does other work while the children
        build their engines: the server imports its HTTP stack)."""
        from rosejax.tokenizer import TokenTexts, load_tokenizer

        level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        self.children: list[EngineLink] = list(links or [])
        try:
            if not links:
                self.children = spawn_children(config, level, True, api_servers)
            self.tokenizer = load_tokenizer(config.model, config.tokenizer)  # while they load
            self.token_texts = TokenTexts(self.tokenizer)  # logprobs' decoded_token, as theirs
        except BaseException:
            self.close()
            raise
        if wait:
            self.wait_ready()

    def api_server_links(self) -> list[list[EngineLink]]:
        """For each other API server process (1, 2, ...), its pipe ends: one per replica."""
        return [list(links) for links in zip(*(c.links for c in self.children), strict=True)]

    def wait_ready(self) -> None:
        """Wait until every child's engine is built (ValueError, RuntimeError: one failed; then
        every child is stopped)."""
        try:
            infos = wait_ready(self.children)
        except BaseException:
            self.close()
            raise
        first = infos[0]
        self.config, self.block_size = first.model_config, first.block_size
        self.max_batch_size, self.on_cpu = first.max_batch_size, first.platform == "cpu"

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        return checked_prompt_ids(prompt, self.tokenizer, self.config)

    def async_replicas(
        self, max_waiting: int | None, metrics: ServerMetrics
    ) -> list[EngineProcess]:
        """The replicas as the app serves them (`ReplicatedEngine`)."""
        return [
            EngineProcess(c, self.tokenizer, self.token_texts, max_waiting, metrics)
            for c in self.children
        ]

    def close(self, timeout: float = 10.0) -> None:
        """Stop every child (those an app serves stop with it)."""
        for child in self.children:
            child.stop(timeout)
