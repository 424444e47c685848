"""AsyncEngine: one background thread owns the (not thread-safe) LLMEngine and runs its loop.

asyncio handlers hand it commands through a thread-safe queue; it answers each submission on a
future and streams every RequestOutput into that submission's asyncio.Queue via
`loop.call_soon_threadsafe`. So all HTTP connections share one continuous batch. With data
parallelism each replica has an AsyncEngine of its own (`rosejax.serve.replicas`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from rosejax.engine.request import RequestOutput
from rosejax.engine.router import request_cost
from rosejax.sampling import SamplingParams
from rosejax.serve.metrics import ServerMetrics

log = logging.getLogger("rosejax.serve")


class Overloaded(Exception):
    """Too many requests wait already; the caller answers 429."""


class EngineError(RuntimeError):
    """Serving a request failed (500), or the server stops (503): the caller answers `status`."""

    def __init__(self, message: str, status: int = 500, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


def _shutting_down() -> EngineError:
    return EngineError("the server is shutting down", 503, "server_shutting_down")


class _Sink:
    """Where one submission's outputs go: an asyncio.Queue living on the submitter's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rids: Sequence[str]):
        self.loop, self.queue, self.rids = loop, asyncio.Queue(), list(rids)
        self.arrival = time.perf_counter()
        self.last: dict[str, float] = {}  # request id -> time of its latest token

    def put(self, item: RequestOutput | BaseException) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the event loop is closed: nobody will read this
            return False


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():  # cancelled: the client already left
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


class RequestStream:
    """Outputs of one submission (one engine request per prompt), in order per request."""

    def __init__(self, engine: AsyncEngine, sink: _Sink):
        self._engine, self._sink = engine, sink
        self.request_ids = sink.rids
        self._pending = set(sink.rids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pending:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            self._pending.clear()  # the engine has dropped them already
            raise item
        if item.finished:
            self._pending.discard(item.request_id)
        return item

    def abort(self) -> None:
        """Stop whatever is still running (a client went away); idempotent."""
        if self._pending:
            self._engine.abort(sorted(self._pending))
            self._pending.clear()


class AsyncEngine:
    def __init__(
        self,
        engine: Any,
        max_waiting: int | None = None,
        metrics: ServerMetrics | None = None,
        poll_s: float = 0.05,
        warm_in_background: bool = False,
        replica: int = 0,
    ):
        """`engine`: an `LLMEngine`, replica `replica` of the server (its metrics' label)."""
        self.engine = engine
        # Compile the programs warm-up has not on a thread of its own, so that compiling (seconds
        # a program on a GPU) never holds up a step; a shape needed before its turn compiles
        # where it is needed, as without warm-up.
        self._compiler = None
        self._idle = threading.Event()  # set while no request is in flight: compiling may go on
        self._programs_left = 0
        if warm_in_background:
            self._programs_left = len(engine.cold_programs())
            self._compiler = threading.Thread(
                target=self._compile_ahead, name="rosejax-compile", daemon=True
            )
        # In flight past a full batch counts as waiting; more than max_waiting of those -> 429.
        self.max_waiting = max_waiting
        self.max_in_flight = None if max_waiting is None else engine.max_batch_size + max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        # Tokens in flight (`request_cost`) of submissions not ended yet, for routing: added on
        # submission (the event loop), taken off as each request ends (this engine's thread).
        self._load_lock = threading.Lock()
        self._load = 0
        self._costs: dict[str, int] = {}  # request id -> its cost; the engine thread's
        self._stop = threading.Event()
        self._cut_at: float | None = None  # set by begin_shutdown: when open requests are ended
        self._poll_s = poll_s
        self._thread = threading.Thread(
            target=self._run, name=f"rosejax-engine-{replica}", daemon=True
        )
        self.snapshot: dict[str, Any] = {}
        self._publish()
        self.metrics = (metrics or ServerMetrics()).replica(replica, lambda: self.snapshot)

    # ----------------------------------------------------------------- called from other threads

    def start(self) -> None:
        self._thread.start()
        if self._compiler is not None:
            self._compiler.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        for thread in (self._thread, self._compiler):
            if thread is not None and thread.is_alive():
                thread.join(timeout)

    def begin_shutdown(self, grace: float) -> None:
        """The server stops: refuse new requests now, and in `grace` seconds end the open ones
        with a "shutting down" error, so each still gets a complete answer."""
        if self._cut_at is None:
            self._cut_at = time.monotonic() + grace
            self._commands.put(("wake",))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set() and self._cut_at is None

    @property
    def load(self) -> int:
        """Tokens in flight: each submitted request's prompt and most new tokens, until it ends."""
        return self._load

    def _add_load(self, tokens: int) -> None:
        with self._load_lock:
            self._load += tokens

    async def submit(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams, request_id: str
    ) -> RequestStream:
        """Queue one request per prompt (all or none). ValueError: bad input; Overloaded."""
        if self._cut_at is not None:
            raise _shutting_down()
        if not self.alive:
            raise EngineError("the engine is not running", 503, "engine_stopped")
        loop = asyncio.get_running_loop()
        rids = [f"{request_id}-{i}" for i in range(len(prompts))]
        context = self.engine.config.max_model_len
        costs = [request_cost(len(p), params.max_tokens, context) for p in prompts]
        sink, accepted = _Sink(loop, rids), loop.create_future()
        self._add_load(sum(costs))
        self._commands.put(("add", sink, list(prompts), params, costs, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the client left before the engine answered
            self.abort(rids)
            raise
        return RequestStream(self, sink)

    def abort(self, request_ids: Sequence[str]) -> None:
        self._commands.put(("abort", list(request_ids)))

    # ------------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_unfinished_requests()
                if idle:
                    self._idle.set()
                self._drain(block=idle)
                self._idle.clear()
                if self._stop.is_set():
                    break
                if self._cut_at is not None and time.monotonic() >= self._cut_at and self._sinks:
                    self._fail_all(_shutting_down())
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        finally:
            self._fail_all(_shutting_down())
            self._publish()

    def _compile_ahead(self) -> None:
        """Compile the programs warm-up has not, each one only once no request is in flight
        (compiling holds the GIL for much of its time, which a step would wait for)."""
        for program in self.engine.cold_programs():
            while not self._idle.wait(self._poll_s):
                if self._stop.is_set():
                    return
            if self._stop.is_set():
                return
            try:
                self.engine.compile_ahead(program)
            except Exception:  # serving goes on: the program compiles on first use instead
                log.exception("compiling %s ahead failed", program)
            self._programs_left -= 1

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._poll_s) if block else self._commands.get_nowait()
            while True:
                self._handle(cmd)
                cmd = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            self._add(*cmd[1:])
        elif cmd[0] == "abort":
            for rid in cmd[1]:
                if self._forget(rid) is not None:
                    self.engine.abort_request(rid)
                    self.metrics.finished("abort").inc()

    def _forget(self, rid: str) -> _Sink | None:
        """Drop an ended request (its sink and its load); its sink, None if it was not here."""
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            self._add_load(-self._costs.pop(rid))
        return sink

    def _add(
        self, sink: _Sink, prompts: list, params: SamplingParams, costs: list[int], accepted
    ) -> None:
        def answer(exc: BaseException | None) -> None:
            if exc is not None:  # nothing was queued
                self._add_load(-sum(costs))
            try:
                sink.loop.call_soon_threadsafe(_settle, accepted, exc)
            except RuntimeError:  # the event loop is closed: nobody waits for these
                for rid in sink.rids:
                    if self._forget(rid) is not None:
                        self.engine.abort_request(rid)

        scheduler = self.engine.scheduler
        in_flight = len(scheduler.running) + len(scheduler.waiting)
        if self.max_in_flight is not None and in_flight + len(prompts) > self.max_in_flight:
            return answer(
                Overloaded(
                    f"the server is overloaded: {in_flight} requests in flight, at most "
                    f"{self.max_in_flight} (batch {self.engine.max_batch_size} + max waiting "
                    f"{self.max_waiting}); retry later"
                )
            )
        added: list[str] = []
        try:
            for rid, prompt in zip(sink.rids, prompts, strict=True):
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
        except Exception as e:  # ValueError: bad input; anything else must not kill the loop
            for rid in added:
                self.engine.abort_request(rid)
            return answer(e)
        for rid, cost in zip(added, costs, strict=True):
            self._sinks[rid] = sink
            self._costs[rid] = cost
        answer(None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # Not one request's fault (the engine ends those itself): a program failed. Every
            # request in flight may have lost its state; end them all, and serve on.
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(EngineError("the engine failed while generating; see the server log"))
            return
        now = time.perf_counter()
        m = self.metrics
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            n = len(out.new_token_ids)
            if n:
                m.generation_tokens.inc(n)
                last = sink.last.get(out.request_id)
                if last is None:
                    m.ttft.observe(now - sink.arrival)
                    m.prompt_tokens.inc(len(out.prompt_token_ids))
                else:
                    m.itl.observe((now - last) / n, n)  # a window hands over n tokens at once
                sink.last[out.request_id] = now
            if out.finish_reason == "error":  # the engine ended this one request
                self._fail_sink(sink, EngineError(f"generating this request failed: {out.error}"))
                continue
            if out.finished:
                self._forget(out.request_id)
                m.finished(out.finish_reason or "stop").inc()
                m.e2e.observe(now - sink.arrival)
            if not sink.put(out) and not out.finished:
                self._forget(out.request_id)
                self.engine.abort_request(out.request_id)

    def _fail_sink(self, sink: _Sink, exc: EngineError) -> None:
        """End one submission with `exc`: its other prompts are aborted."""
        for rid in sink.rids:
            if self._forget(rid) is not None:
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    log.exception("abort of %s failed", rid)
                self.metrics.finished("error").inc()
        sink.put(exc)

    def _fail_all(self, exc: EngineError) -> None:
        for sink in {id(s): s for s in self._sinks.values()}.values():
            self._fail_sink(sink, exc)

    def _publish(self) -> None:
        """A fresh dict each time, so a scrape from another thread reads one consistent view."""
        alloc, sched = self.engine.allocator, self.engine.scheduler
        self.snapshot = {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "kv_blocks_used": alloc.num_used_blocks,
            "kv_blocks_total": alloc.num_blocks - 1,
            "prefix_hits": alloc.prefix_hits,
            "prefix_hit_tokens": alloc.prefix_hit_tokens,
            "programs_to_compile": self._programs_left,
        }
