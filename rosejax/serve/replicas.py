"""What the app serves from: one `EngineProcess` (an engine process: the server's default) or
one `AsyncEngine` (an engine thread: `--no-engine-process`) per data-parallel replica, and a
`Router` that picks each submission's replica by load and prompt prefix.

A submission (all prompts of one HTTP request) goes to one replica, whose stream then answers
for it: its aborts (a client gone) reach that replica alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rosejax.engine.router import Router
from rosejax.sampling import SamplingParams
from rosejax.serve.engine_loop import AsyncEngine, Overloaded, RequestStream
from rosejax.serve.metrics import ServerMetrics


class ReplicatedEngine:
    """An `LLMEngine` (one replica) or a `DataParallelEngine`'s replicas, each on an engine
    thread of its own, or `EngineProcesses`' replicas, each in a process of its own, behind one
    router; `AsyncEngine`'s interface for the app."""

    def __init__(
        self,
        engine: Any,
        max_waiting: int | None = None,
        metrics: ServerMetrics | None = None,
        warm_in_background: bool = False,
    ):
        self.metrics = metrics or ServerMetrics()
        if hasattr(engine, "async_replicas"):  # `EngineProcesses`: a process per replica
            self.engines = engine.async_replicas(max_waiting, self.metrics)
        else:
            self.engines = [
                AsyncEngine(
                    r,
                    max_waiting=max_waiting,
                    metrics=self.metrics,
                    warm_in_background=warm_in_background,
                    replica=i,
                )
                for i, r in enumerate(getattr(engine, "replicas", [engine]))
            ]
        capacity = sum(e.snapshot["kv_blocks_total"] for e in self.engines)
        self.router = Router(len(self.engines), engine.block_size, capacity=capacity)
        # One submission goes to one replica, so it must fit one replica's bound.
        self.max_in_flight = self.engines[0].max_in_flight

    def start(self) -> None:
        for e in self.engines:
            e.start()

    def stop(self, timeout: float = 10.0) -> None:
        for e in self.engines:
            e.stop(timeout)

    def begin_shutdown(self, grace: float) -> None:
        for e in self.engines:
            e.begin_shutdown(grace)

    @property
    def alive(self) -> bool:
        """Every replica serves."""
        return all(e.alive for e in self.engines)

    async def submit(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams, request_id: str
    ) -> RequestStream:
        """Queue one request per prompt on the replica the router picks by the first prompt's
        ids (all or none); a full replica passes it on to the others, least loaded first.
        ValueError: bad input; Overloaded when every replica is full."""
        loads = [e.load for e in self.engines]
        first = prompts[0] if prompts and not isinstance(prompts[0], str) else []
        pick = self.router.route(first, loads)
        others = sorted((i for i in range(len(loads)) if i != pick), key=lambda i: loads[i])
        for i in [pick, *others]:
            try:
                return await self.engines[i].submit(prompts, params, request_id)
            except Overloaded as e:
                overloaded = e
        raise overloaded
