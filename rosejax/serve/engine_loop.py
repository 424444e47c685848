"""AsyncEngine: one background thread owns the (not thread-safe) LLMEngine and runs its loop.

asyncio handlers hand it commands through a thread-safe queue; it answers each submission on a
future and streams every RequestOutput into that submission's queue (`_Sink`) via
`loop.call_soon_threadsafe`. So all HTTP connections share one continuous batch. With data
parallelism each replica has an AsyncEngine of its own (`rosejax.serve.replicas`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from rosejax.engine.request import RequestOutput
from rosejax.engine.request_checks import check_request, checked_prompt_ids
from rosejax.engine.router import request_cost
from rosejax.engine.serving import (
    compile_while_idle,
    engine_snapshot,
    gather_seconds,
    idle_wait,
    take_commands,
)
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
    """Where one submission's outputs go: a queue read on the submitter's event loop (a deque
    and the reader's future: asyncio.Queue's bookkeeping cost an output as much again)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rids: Sequence[str]):
        self.loop, self.rids = loop, list(rids)
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None  # the reader's, while it waits for an item
        self.arrival = time.monotonic()  # the engine's clock (`RequestMetrics`)
        self.last: dict[str, float] = {}  # request id -> time of its latest token

    def put(self, item: RequestOutput | BaseException) -> bool:
        """`push` on the loop, from any thread; False if the loop is closed (nobody will read
        it)."""
        try:
            self.loop.call_soon_threadsafe(self.push, item)
            return True
        except RuntimeError:
            return False

    def push(self, item: Any) -> None:
        """Queue `item` and wake the reader; on the loop."""
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> Any:
        while not self.items:
            self.waiter = self.loop.create_future()
            await self.waiter
        return self.items.popleft()


_CLOSED = object()  # what `RequestStream.close` puts in its queue


class RequestStream:
    """Outputs of one submission (one engine request per prompt), in order per request."""

    def __init__(self, engine: EngineFront, sink: _Sink):
        self._engine, self._sink = engine, sink
        self.request_ids = sink.rids
        self._pending = set(sink.rids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pending:
            raise StopAsyncIteration
        item = await self._sink.get()
        if item is _CLOSED:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._pending.clear()  # the engine has dropped them already
            raise item
        if item.finished:
            self._pending.discard(item.request_id)
        return item

    @property
    def ended(self) -> bool:
        """No output follows: every request has finished, or was aborted."""
        return not self._pending

    def abort(self) -> None:
        """Stop whatever is still running (a client went away); idempotent."""
        if self._pending:
            self._engine.abort(sorted(self._pending))
            self._pending.clear()

    def close(self) -> None:
        """The client has gone: `abort`, and end an iteration waiting for the next output
        (none comes). Called on the event loop that iterates."""
        self.abort()
        self._sink.push(_CLOSED)


class EngineFront:
    """One replica as the app sees it, whatever runs its engine (a thread: `AsyncEngine`; a
    process: `rosejax.serve.engine_process`): the submissions in flight and their load, their
    outputs delivered to their sinks with the metrics observed, failures ended with an error.
    Subclasses say how a request is aborted in the engine (`_abort_in_engine`)."""

    def __init__(
        self,
        max_batch_size: int,
        max_waiting: int | None,
        metrics: ServerMetrics | None,
        replica: int,
        snapshot: dict[str, Any],
    ):
        # In flight past a full batch counts as waiting; more than max_waiting of those -> 429.
        self.max_waiting, self.max_batch_size = max_waiting, max_batch_size
        self.max_in_flight = None if max_waiting is None else max_batch_size + max_waiting
        self._sinks: dict[str, _Sink] = {}
        # Tokens in flight (`request_cost`) of submissions not ended yet, for routing: added on
        # submission (the event loop), taken off as each request ends (the engine's side).
        self._load_lock = threading.Lock()
        self._load = 0
        # Sequences in flight (each request's n: each takes a batch slot), what the 429 bounds.
        self._sequences = 0
        self._costs: dict[str, tuple[int, int]] = {}  # request id -> (its cost, its n)
        self._cut_at: float | None = None  # set by begin_shutdown: when open requests are ended
        self.snapshot = snapshot
        self.metrics = (metrics or ServerMetrics()).replica(replica, lambda: self.snapshot)

    @property
    def load(self) -> int:
        """Tokens in flight: each submitted request's prompt and most new tokens, until it ends."""
        return self._load

    def _add_load(self, tokens: int, sequences: int) -> None:
        with self._load_lock:
            self._load += tokens
            self._sequences += sequences

    def _check_open(self, alive: bool) -> None:
        if self._cut_at is not None:
            raise _shutting_down()
        if not alive:
            raise EngineError("the engine is not running", 503, "engine_stopped")

    def _overloaded(self, in_flight: int, more: int) -> Overloaded | None:
        if self.max_in_flight is None or in_flight + more <= self.max_in_flight:
            return None
        return Overloaded(
            f"the server is overloaded: {in_flight} sequences in flight (a request's n "
            f"choices each count), at most "
            f"{self.max_in_flight} (batch {self.max_batch_size} + max waiting "
            f"{self.max_waiting}); retry later"
        )

    def _register(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        request_id: str,
        tokenizer: Any,
        config: Any,
        kv_blocks: int,
        block_size: int,
    ) -> tuple[_Sink, list[list[int]]]:
        """Check one submission as `LLMEngine.add_request` would (ValueError: bad input;
        Overloaded) and take its requests in flight, so the engine's add needs no answer: a
        round trip per request, each way waiting for the GIL, was most of what a burst of
        requests took to reach the engine. Returns its sink and its prompts' token ids."""
        self._check_open(self.alive)
        ids = [checked_prompt_ids(p, tokenizer, config) for p in prompts]
        for i in ids:
            check_request(i, params, config, kv_blocks, block_size)
        overloaded = self._overloaded(self._sequences, len(ids) * params.n)
        if overloaded is not None:
            raise overloaded
        rids = [f"{request_id}-{i}" for i in range(len(ids))]
        sink = _Sink(asyncio.get_running_loop(), rids)
        for rid, i in zip(rids, ids, strict=True):
            cost = request_cost(len(i), params.max_tokens, config.max_model_len)
            self._add_load(cost, params.n)
            self._costs[rid] = cost, params.n
            self._sinks[rid] = sink
        return sink, ids

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop these requests (a client went away); ids already ended are ignored."""
        raise NotImplementedError

    def _abort_in_engine(self, rid: str) -> None:
        """Stop one request in the engine (its sink is forgotten already)."""
        raise NotImplementedError

    def _forget(self, rid: str) -> _Sink | None:
        """Drop an ended request (its sink and its load); its sink, None if it was not here."""
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            cost, n = self._costs.pop(rid)
            self._add_load(-cost, -n)
        return sink

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        """Hand one step's outputs to their sinks, in order, once the metrics are observed:
        the counts for the whole step at once (in multiprocess mode each observation is a
        locked write into a file's map)."""
        now = time.monotonic()
        m = self.metrics
        tokens = prompt_tokens = 0
        gaps: list[tuple[float, int]] = []  # (time per token, tokens) of each later window
        starts: list[tuple[float, float, float]] = []  # (dispatch, queue, prefill) of first ones
        ended: collections.Counter[str] = collections.Counter()  # finish reason -> requests
        handed: list[tuple[_Sink, RequestOutput | EngineError]] = []
        for out in outputs:
            rid = out.request_id
            sink = self._sinks.get(rid)
            if sink is None:
                continue
            n = len(out.new_token_ids)  # the first sequence's: the request's latencies
            if n:
                tokens += sum(len(c.new_token_ids) for c in out.outputs) or n
                last = sink.last.get(rid)
                if last is None:
                    m.ttft.observe(now - sink.arrival)
                    prompt_tokens += len(out.prompt_token_ids)
                    t = out.metrics
                    if t is not None:  # (set by the engine before any output)
                        scheduled = t.first_scheduled_time
                        starts.append(
                            (
                                t.arrival_time - sink.arrival,
                                scheduled - t.arrival_time,
                                t.first_token_time - scheduled,
                            )
                        )
                else:
                    gaps.append(((now - last) / n, n))  # a window hands over n tokens at once
                sink.last[rid] = now
            if out.finish_reason == "error":  # the engine ended this one request
                self._end_sink(sink)
                handed.append((sink, EngineError(f"generating this request failed: {out.error}")))
                continue
            if out.finished:
                self._forget(rid)
                ended[out.finish_reason or "stop"] += 1
                m.e2e.observe(now - sink.arrival)
            handed.append((sink, out))
        m.observe_step(tokens, prompt_tokens, gaps, ended, starts)
        for sink, item in handed:
            if not sink.put(item) and isinstance(item, RequestOutput) and not item.finished:
                self._forget(item.request_id)
                self._abort_in_engine(item.request_id)

    def _end_sink(self, sink: _Sink) -> None:
        """Forget one failed submission's requests, aborting those still running."""
        for rid in sink.rids:
            if self._forget(rid) is not None:
                try:
                    self._abort_in_engine(rid)
                except Exception:
                    log.exception("abort of %s failed", rid)
                self.metrics.finished("error").inc()

    def _fail_sink(self, sink: _Sink, exc: EngineError) -> None:
        """End one submission with `exc`: its other prompts are aborted."""
        self._end_sink(sink)
        sink.put(exc)

    def _fail_all(self, exc: EngineError) -> None:
        for sink in {id(s): s for s in list(self._sinks.values())}.values():
            self._fail_sink(sink, exc)


class AsyncEngine(EngineFront):
    """An `LLMEngine` run by a thread of this process (see the module)."""

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
        self._stop = threading.Event()
        self._programs_left = 0
        if warm_in_background:
            self._programs_left = len(engine.cold_programs())
            self._compiler = threading.Thread(
                target=compile_while_idle,
                args=(engine, self._idle, self._stop, poll_s, self._compiled),
                name="rosejax-compile",
                daemon=True,
            )
        super().__init__(
            engine.max_batch_size, max_waiting, metrics, replica, engine_snapshot(engine, 0)
        )
        self._publish()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._poll_s = poll_s
        self._gather_s = gather_seconds(engine.engine_config)
        self._thread = threading.Thread(
            target=self._run, name=f"rosejax-engine-{replica}", daemon=True
        )

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

    async def submit(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams, request_id: str
    ) -> RequestStream:
        """Queue one request per prompt (all or none). ValueError: bad input; Overloaded."""
        engine = self.engine
        sink, ids = self._register(
            prompts,
            params,
            request_id,
            engine.tokenizer,
            engine.config,
            engine.num_kv_blocks,
            engine.block_size,
        )
        self._commands.put(("add", sink, ids, params))
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
                else:  # idle: a program compiled ahead runs its costlier first run now
                    self.engine.run_ahead()
                self._publish()
        finally:
            self._fail_all(_shutting_down())
            self._publish()

    def _compiled(self) -> None:
        self._programs_left -= 1

    def _drain(self, block: bool) -> None:
        if block:
            wait = idle_wait(self.engine, self._poll_s)
            take_commands(self._commands, self._handle, wait, self._gather_s)
        else:
            take_commands(self._commands, self._handle, 0.0)

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            self._add(*cmd[1:])
        elif cmd[0] == "abort":
            for rid in cmd[1]:
                if self._forget(rid) is not None:
                    self.engine.abort_request(rid)
                    self.metrics.finished("abort").inc()

    def _abort_in_engine(self, rid: str) -> None:
        self.engine.abort_request(rid)

    def _add(self, sink: _Sink, prompts: list, params: SamplingParams) -> None:
        for rid, prompt in zip(sink.rids, prompts, strict=True):
            if rid not in self._sinks:  # aborted, or its submission failed, since
                continue
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as e:  # checked at submit: not the client's fault if it fails here
                log.exception("adding %s failed", rid)
                return self._fail_sink(sink, EngineError(f"adding this request failed: {e}"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # Not one request's fault (the engine ends those itself): a program failed. Every
            # request in flight may have lost its state; end them all, and serve on.
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(EngineError("the engine failed while generating; see the server log"))
            return
        self._deliver(outputs)

    def _publish(self) -> None:
        self.snapshot = engine_snapshot(self.engine, self._programs_left)
