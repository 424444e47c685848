"""Data parallelism: N `LLMEngine` replicas, each with its own device(s), params, KV cache and
scheduler, behind one `Router` (`RoutedReplicas`, which speaks `LLMEngine`'s verbs): each in an
engine process of its own (`rosejax.engine.process_engine`, the default) or each on a thread of
this process (`DataParallelEngine`, `EngineConfig.engine_process` off).

`make_engine(config)` builds an `LLMEngine` for `data_parallel_size` 1 and one of those
otherwise. Replica i runs on `replica_devices(...)[i]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import jax

from rosejax.engine.llm_engine import LLMEngine
from rosejax.engine.request import RequestOutput
from rosejax.engine.router import Router, request_cost
from rosejax.sampling import SamplingParams
from rosejax.settings import EngineConfig


def replica_devices(
    data_parallel_size: int,
    tensor_parallel_size: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> list[tuple[jax.Device, ...]]:
    """Each replica's devices: replica i gets devices[i * tp : (i + 1) * tp] of `devices`
    (default: this process's local devices). ValueError naming the flags if there are too few."""
    devices = list(jax.local_devices() if devices is None else devices)
    dp, tp = data_parallel_size, tensor_parallel_size
    if dp < 1 or tp < 1:
        raise ValueError(
            f"--data-parallel-size and --tensor-parallel-size must be >= 1: {dp}, {tp}"
        )
    if dp * tp > len(devices):
        flags = f"--data-parallel-size {dp}" + (f" x --tensor-parallel-size {tp}" if tp > 1 else "")
        kind = devices[0].platform if devices else "no"
        raise ValueError(
            f"{flags} needs {dp * tp} devices, but this process sees {len(devices)} {kind} "
            f"device(s): lower --data-parallel-size"
        )
    return [tuple(devices[i * tp : (i + 1) * tp]) for i in range(dp)]


def make_engine(config: EngineConfig) -> LLMEngine | RoutedReplicas:
    """One `LLMEngine` for `data_parallel_size` 1; else a `ProcessDataParallelEngine` (each
    replica in an engine process of its own), or with `engine_process` off a
    `DataParallelEngine` (each replica on a thread of this process)."""
    if config.data_parallel_size == 1:
        return LLMEngine(config)
    if config.engine_process:
        from rosejax.engine.process_engine import ProcessDataParallelEngine

        return ProcessDataParallelEngine(config)
    return DataParallelEngine(config)


class RoutedReplicas:
    """Replicas of one model behind one `Router` (by load and prefix), with `LLMEngine`'s verbs,
    so that `LLM`, the benchmarks and the server drive them as they drive one engine. Each
    replica speaks `LLMEngine`'s verbs too; subclasses build them and say how they step (`step`,
    `warmup`, `compile_ahead`). Not thread-safe, like `LLMEngine`."""

    def __init__(self, config: EngineConfig, replicas: Sequence[Any]):
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.engine_config = config
        self.config, self.tokenizer, self.dtype = first.config, first.tokenizer, first.dtype
        self.kernels, self.on_cpu, self.seed = first.kernels, first.on_cpu, first.seed
        self.max_batch_size, self.block_size = first.max_batch_size, first.block_size
        self.decode_steps = first.decode_steps
        # The router remembers at most as many prefix blocks as the replicas' caches hold.
        n = len(self.replicas)
        self.router = Router(n, self.block_size, capacity=self.num_kv_blocks)
        self.loads = [0] * n  # tokens in flight per replica (`request_cost`)
        self._where: dict[str, tuple[int, int]] = {}  # request id -> (replica, cost)

    @property
    def num_kv_blocks(self) -> int:
        return sum(r.num_kv_blocks for r in self.replicas)

    @property
    def num_compiles(self) -> int:
        return sum(r.num_compiles for r in self.replicas)

    @property
    def compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self.replicas)

    def warmup_programs(self) -> list[tuple[str, int, int | bool]]:
        return self.replicas[0].warmup_programs()

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        return self.replicas[0].prompt_ids(prompt)

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> None:
        """Route the request to a replica and queue it there. Bad input raises ValueError and
        leaves every replica as it was."""
        if request_id in self._where:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        ids = self.prompt_ids(prompt)
        replica = self.router.route(ids, self._route_loads())
        self.replicas[replica].add_request(request_id, ids, params)
        # Its n sequences each hold a slot and their own tokens (the prompt's blocks shared).
        cost = params.n * request_cost(len(ids), params.max_tokens, self.config.max_model_len)
        self._where[request_id] = (replica, cost)
        self.loads[replica] += cost

    def _route_loads(self) -> list[float]:
        """The loads the router weighs (a subclass may rule a replica out with inf)."""
        return self.loads

    def _ended(self, request_id: str) -> int | None:
        """Forget an ended request; its replica, or None if it was not here."""
        where = self._where.pop(request_id, None)
        if where is None:
            return None
        self.loads[where[0]] -= where[1]
        return where[0]

    def _forget_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                self._ended(out.request_id)
        return outputs

    def abort_request(self, request_id: str) -> None:
        """Stop a request now on its replica; unknown ids are ignored."""
        replica = self._ended(request_id)
        if replica is not None:
            self.replicas[replica].abort_request(request_id)

    def replica_of(self, request_id: str) -> int | None:
        """The replica serving an unfinished request."""
        where = self._where.get(request_id)
        return None if where is None else where[0]

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def close(self) -> None:
        """Stop what runs the replicas (their threads or processes); idempotent."""
        raise NotImplementedError

    def __enter__(self) -> RoutedReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DataParallelEngine(RoutedReplicas):
    """`data_parallel_size` replicas of one model, each an `LLMEngine` on its own device(s) in
    this process (`RoutedReplicas`). `step` steps every busy replica at once, one thread each,
    and returns all their outputs; their host work shares this process's GIL, which two GPUs'
    worth of it does not fit (`ProcessDataParallelEngine` runs each in a process of its own).
    A server with `--no-engine-process` builds its replicas so and runs each on an engine
    thread of its own (`rosejax.serve`)."""

    def __init__(self, config: EngineConfig):
        placements = replica_devices(config.data_parallel_size, config.tensor_parallel_size)
        one = dataclasses.replace(config, data_parallel_size=1)
        n = len(placements)
        # Threads: the replicas load and compile side by side (XLA compiles without the GIL).
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="rosejax-replica")
        replicas = self._pool.map(lambda i: LLMEngine(one, placements[i], replica=i), range(n))
        super().__init__(config, list(replicas))

    def close(self) -> None:
        self._pool.shutdown()

    def warmup(self, programs: list[tuple[str, int, int | bool]] | None = None) -> None:
        """Compile `programs` (default: every one) on every replica, side by side."""
        list(self._pool.map(lambda r: r.warmup(programs), self.replicas))

    def compile_ahead(self, *programs: tuple[str, int, int | bool]) -> None:
        """`LLMEngine.compile_ahead` on every replica, side by side."""
        list(self._pool.map(lambda r: r.compile_ahead(*programs), self.replicas))

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work, concurrently (each dispatches its next
        program before reading back its previous one); their outputs, replica by replica."""
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(busy) == 1:
            outputs = busy[0].step()
        else:
            futures = [self._pool.submit(r.step) for r in busy]
            wait(futures)  # every replica finishes its step before any failure is raised
            outputs = [out for f in futures for out in f.result()]
        return self._forget_finished(outputs)
