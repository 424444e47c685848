"""Offline data parallelism with each replica's `LLMEngine` in an engine process of its own
(`rosejax.engine.engine_process`: the child, its loop and its rows, as a server's), so that N
replicas' host work (dispatch, harvest, detokenizing) runs on N interpreters, not on one GIL.

`ProcessDataParallelEngine` is what `make_engine` builds for `data_parallel_size` > 1: the
replicas (`ReplicaProcess`, each speaking `LLMEngine`'s verbs from this process) behind the
router (`RoutedReplicas`). This process tokenizes, checks each request as the engine would and
rebuilds the engine's `RequestOutput`s from the rows the children send; the children warm up as
`EngineConfig.warmup` says, as `LLMEngine` does offline.

The children are spawned: a script that builds one runs again in each child as it starts, so
its top level must sit under `if __name__ == "__main__":`. `close()` (or a `with` block, or the
engine's garbage collection, or the interpreter's exit) stops them.
"""

from __future__ import annotations

import itertools
import logging
import math
import weakref
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from rosejax.engine.data_parallel import RoutedReplicas
from rosejax.engine.engine_process import EngineChild, spawn_children, wait_ready
from rosejax.engine.output_rows import RowReader
from rosejax.engine.request import RequestOutput
from rosejax.engine.request_checks import check_request, checked_prompt_ids
from rosejax.sampling import SamplingParams
from rosejax.settings import EngineConfig

log = logging.getLogger("rosejax")

# How long `step` waits for outputs before it returns none (the caller steps again).
STEP_WAIT_S = 1.0

Program = tuple[str, int, int | bool]


class ReplicaProcess:
    """One replica's `LLMEngine` in an engine process, driven from this process with its verbs.
    Requests are checked here as `LLMEngine.add_request` checks them (ValueError, nothing sent)
    and go out, with aborts, at the next `step`, in one message. `step` waits (at most
    `STEP_WAIT_S`) until the engine has sent outputs and returns every output received.
    `host_seconds`, `num_compiles`, `compile_seconds`: the engine's, as of its latest message.
    If the process dies, its unfinished requests end with finish reason "error" and new ones
    are refused (RuntimeError)."""

    def __init__(self, child: EngineChild, tokenizer: Any, token_texts: Any, seed: int):
        info = child.info
        self.child, self.tokenizer, self.seed = child, tokenizer, seed
        self.config, self.dtype, self.kernels = info.model_config, info.dtype, info.kernels
        self.max_batch_size, self.block_size = info.max_batch_size, info.block_size
        self.decode_steps, self.on_cpu = info.decode_steps, info.platform == "cpu"
        self.platform, self.device_kind = info.platform, info.device_kind
        self.devices = info.devices  # as this process numbers them ("gpu:1")
        self.snapshot = info.snapshot
        self._programs = list(info.warmup_programs)
        self._rows = RowReader(token_texts)
        # Added, no finished output received yet: request id -> its id in the engine process,
        # unique per add (`request_id#k`), so that rows still coming for an aborted request
        # never reach a new one of the same id.
        self._unfinished: dict[str, str] = {}
        self._adds = itertools.count()
        self._commands: list[tuple] = []  # not sent yet, in order
        self._received: list[RequestOutput] = []  # not returned by `step` yet
        self._answers: list[str | None] = []  # of warmup / compile_ahead: None or an error
        self.died: str | None = None  # how it died

    @property
    def num_kv_blocks(self) -> int:
        return self.snapshot["kv_blocks_total"]

    @property
    def num_compiles(self) -> int:
        return self.snapshot["num_compiles"]

    @property
    def compile_seconds(self) -> float:
        return self.snapshot["compile_seconds"]

    @property
    def host_seconds(self) -> dict[str, float]:
        return self.snapshot["host_seconds"]

    def warmup_programs(self) -> list[Program]:
        return list(self._programs)

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        return checked_prompt_ids(prompt, self.tokenizer, self.config)

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. Bad input raises ValueError and queues nothing."""
        params = params or SamplingParams()
        if request_id in self._unfinished:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.prompt_ids(prompt)
        check_request(ids, params, self.config, self.num_kv_blocks, self.block_size)
        if self.died is not None:
            raise RuntimeError(self.died)
        engine_id = f"{request_id}#{next(self._adds)}"
        self._rows.expect(engine_id, ids, params)
        self._unfinished[request_id] = engine_id
        self._commands.append(("add", [(engine_id, ids)], params))

    def abort_request(self, request_id: str) -> None:
        """Stop a request; no output of it follows. Unknown ids are ignored."""
        if self._received:
            self._received = [o for o in self._received if o.request_id != request_id]
        engine_id = self._unfinished.pop(request_id, None)
        if engine_id is not None:
            self._rows.forget(engine_id)
            self._commands.append(("abort", [engine_id]))

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished or self._received)

    @property
    def has_outputs(self) -> bool:
        """Outputs received and not returned yet."""
        return bool(self._received)

    @property
    def awaiting(self) -> bool:
        """Requests run and nothing is received to return: `step` would wait."""
        return bool(self._unfinished) and not self._received and self.died is None

    def flush(self) -> None:
        """Send the commands queued since the last flush, in one message."""
        if self._commands:
            self.child.send(self._commands)  # a dead child is seen when reading
            self._commands = []

    def step(self) -> list[RequestOutput]:
        return step_replicas([self])

    def take(self) -> list[RequestOutput]:
        """Every output received, what the pipe holds now included, without waiting."""
        self._read(wait=False)
        outputs, self._received = self._received, []
        return outputs

    def _read(self, wait: bool) -> None:
        """Handle every message the pipe holds; with `wait`, block for the first one."""
        if self.died is not None:
            return
        conn = self.child.conn
        try:
            while (wait and not self._answers) or conn.poll():
                message = conn.recv()
                self.snapshot = message[-1]
                if message[0] == "done":
                    self._answers.append(message[1])
                    continue
                for row in message[1]:
                    out = self._rows.output(row)  # None: a request aborted since
                    if out is not None:
                        engine_id = out.request_id
                        out.request_id = engine_id.rpartition("#")[0]
                        self._received.append(out)
                        if out.finished:
                            del self._unfinished[out.request_id]
                            self._rows.forget(engine_id)
        except (EOFError, OSError):
            self._fail(self.child.exit_code())

    def _fail(self, exit_code: str) -> None:
        """The process died: end every unfinished request with an error."""
        self.died = (
            f"the engine process of replica {self.child.replica} died (exit code {exit_code}); "
            "see the log above"
        )
        log.error("%s; failing its %d requests in flight", self.died, len(self._unfinished))
        for rid, engine_id in sorted(self._unfinished.items()):
            out = self._rows.error_output(engine_id, self.died)
            out.request_id = rid
            self._received.append(out)
        self._unfinished.clear()

    def send_compile(self, verb: str, programs: Sequence[Program] | None) -> None:
        """Ask for `LLMEngine.warmup(programs)` or `compile_ahead(*programs)` (`verb`); its
        end is awaited by `await_compile`."""
        self._commands.append((verb, programs))
        self.flush()

    def await_compile(self) -> None:
        """Wait until the engine answers `send_compile` (outputs received meanwhile are kept
        for `step`); RuntimeError if it failed or the process died."""
        self._read(wait=True)
        if self.died is not None:
            raise RuntimeError(self.died)
        error = self._answers.pop(0)
        if error is not None:
            raise RuntimeError(error)

    def warmup(self, programs: Sequence[Program] | None = None) -> None:
        """`LLMEngine.warmup` in the engine process."""
        self.send_compile("warmup", programs)
        self.await_compile()

    def compile_ahead(self, *programs: Program) -> None:
        """`LLMEngine.compile_ahead` in the engine process."""
        self.send_compile("compile_ahead", programs)
        self.await_compile()


def step_replicas(replicas: Sequence[ReplicaProcess]) -> list[RequestOutput]:
    """Send each replica its queued commands; wait (at most `STEP_WAIT_S`) until one that runs
    requests has sent outputs, unless some are received already; every output received,
    replica by replica."""
    for r in replicas:
        r.flush()
    conns = [r.child.conn for r in replicas if r.awaiting]
    if conns and not any(r.has_outputs for r in replicas):
        wait(conns, STEP_WAIT_S)
    return [out for r in replicas for out in r.take()]


def _stop(children: Sequence[EngineChild], timeout: float) -> None:
    for child in children:
        child.stop(timeout)


class ProcessDataParallelEngine(RoutedReplicas):
    """`data_parallel_size` replicas of one model, each an `LLMEngine` on its own device(s) in
    an engine process of its own (see the module), behind one router (`RoutedReplicas`).
    ValueError: a bad configuration (e.g. more replicas than devices), every child stopped."""

    def __init__(self, config: EngineConfig):
        from rosejax.tokenizer import TokenTexts, load_tokenizer

        level = logging.getLogger().getEffectiveLevel()
        children = spawn_children(config, level, serving=False)
        # Stops them at close(), at this engine's garbage collection or at the interpreter's exit.
        self._finalizer = weakref.finalize(self, _stop, children, 10.0)
        try:
            tokenizer = load_tokenizer(config.model, config.tokenizer)  # while they load
            token_texts = TokenTexts(tokenizer)  # logprobs' decoded_token, as theirs
            wait_ready(children)
        except BaseException:
            self._finalizer.detach()
            _stop(children, 5.0)  # those that failed have exited; one still building is ended
            raise
        replicas = [ReplicaProcess(c, tokenizer, token_texts, config.seed) for c in children]
        super().__init__(config, replicas)
        self.platform, self.device_kind = replicas[0].platform, replicas[0].device_kind

    def close(self) -> None:
        """Stop every engine process (requests in flight are dropped); idempotent."""
        self._finalizer()

    def warmup(self, programs: Sequence[Program] | None = None) -> None:
        """Compile `programs` (default: every one) on every replica, side by side."""
        self._compile("warmup", programs)

    def compile_ahead(self, *programs: Program) -> None:
        """`LLMEngine.compile_ahead` on every replica, side by side."""
        self._compile("compile_ahead", programs)

    def _compile(self, verb: str, programs: Sequence[Program] | None) -> None:
        for r in self.replicas:
            r.send_compile(verb, programs)
        for r in self.replicas:
            r.await_compile()

    def _route_loads(self) -> list[float]:
        # A replica whose engine process died takes no new request while another one lives.
        return [math.inf if r.died else n for r, n in zip(self.replicas, self.loads, strict=True)]

    def step(self) -> list[RequestOutput]:
        """`step_replicas` over every replica; finished requests leave the router's loads."""
        return self._forget_finished(step_replicas(self.replicas))
