"""Engine processes: each replica's engine loop in a process of its own (`--engine-process`, the
server's default with several replicas; with one, the loop runs on a thread), so that the API
process's event loop (HTTP, JSON, SSE) and the replicas' host loops never wait for one
another's GIL.

- Start: `EngineProcesses(config)` spawns one child per data-parallel replica (the `spawn`
  start method: jax must never be forked). Child i sees only its replica's GPUs
  (CUDA_VISIBLE_DEVICES, `rosejax.settings.select_gpus`, set before its backend starts; on a host
  platform it picks its devices by index as `replica_devices` does), builds its `LLMEngine`,
  warms up as the server does (the first programs, the rest while idle) and answers "ready" with
  what the API process needs: the model config, batch size, block size, KV blocks. The API
  process loads the tokenizer itself.
- The API process checks each request as `LLMEngine.add_request` would (`checked_prompt_ids`,
  `check_request`) and counts the requests in flight (429), so an add needs no answer: its
  commands go out without a round trip, those of one event-loop iteration in one message.
- Commands in (one pickled list per message): ("add", [(request id, prompt ids)], params),
  ("abort", [request ids]), ("stop",). Out: ("out", rows, snapshot) once per engine step with
  anything new, a row per `RequestOutput` carrying what changed in it
  (`rosejax.serve.output_rows`: each sequence's new tokens, text, logprobs and finish reason, the
  prompt's logprobs): the child detokenizes (stop strings need the text), the API process only
  appends.
- A reader thread in the API process turns those rows back into the `RequestOutput`s the engine
  made and delivers them as `AsyncEngine` does (`EngineFront._deliver`: metrics observed there).
- A child that dies: its requests in flight end with a 500, /health answers 503, the log says
  how it ended. A child whose API process dies sees its pipe close and exits. SIGINT (a terminal
  sends it to the whole process group) is the API process's to handle: children ignore it and stop
  when told to, or are terminated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from rosejax.engine.llm_engine import checked_prompt_ids
from rosejax.sampling import SamplingParams
from rosejax.serve.engine_loop import (
    EngineError,
    EngineFront,
    RequestStream,
    _shutting_down,
    _Sink,
    compile_while_idle,
    engine_snapshot,
    warm_for_serving,
)
from rosejax.serve.metrics import ServerMetrics
from rosejax.serve.output_rows import RowReader, RowWriter
from rosejax.settings import EngineConfig, freeze_heap

log = logging.getLogger("rosejax.serve")


@dataclasses.dataclass(frozen=True)
class ReplicaInfo:
    """What a child tells the API process once its engine is built."""

    model_config: Any
    max_batch_size: int
    block_size: int
    platform: str
    device_ids: list[int]  # of the devices it runs on
    snapshot: dict[str, Any]


# --------------------------------------------------------------------------- the child process


def _replica_engine(config: EngineConfig, replica: int) -> Any:
    """Replica `replica`'s `LLMEngine` on its own devices, warmed up as `config.warmup` says
    (None: as the server does); and whether programs are left to compile while idle."""
    import jax

    from rosejax.engine.data_parallel import replica_devices
    from rosejax.engine.llm_engine import LLMEngine
    from rosejax.settings import configure_process, select_gpus

    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    # Before jax starts its backend: this replica's GPUs only, so it takes no memory on others.
    select_gpus([replica * tp + k for k in range(tp)], "--data-parallel-size")
    configure_process(config.compilation_cache_dir)
    devices = jax.local_devices()
    if devices[0].platform == "cpu":  # host devices are all visible: this replica's by index
        devices = replica_devices(dp, tp, devices)[replica]
    elif len(devices) != tp:
        raise ValueError(
            f"replica {replica} of --data-parallel-size {dp} needs {tp} devices, found "
            f"{len(devices)}: lower --data-parallel-size"
        )
    one = dataclasses.replace(config, data_parallel_size=1, warmup=False)
    engine = LLMEngine(one, devices, replica=replica)
    return engine, warm_for_serving(engine, config.warmup)


class _EngineLoop:
    """The child's loop: commands in, one message of outputs per step out (see the module).

    With several API server processes (`--api-server-count`) it has a pipe to each: it
    remembers which one added each request, sends each only its own requests' rows (the
    snapshot to all), takes an abort only from the request's owner and a stop only from API
    server 0, and stops then once every other API server's pipe has closed. A pipe of another
    API server that closes aborts that server's requests; the loop serves the rest on."""

    def __init__(
        self, engine: Any, conns: Sequence[Connection], background: bool, poll_s: float = 0.05
    ):
        self.engine, self.poll_s = engine, poll_s
        self.idle, self.stop = threading.Event(), threading.Event()
        self.stop_asked = False  # API server 0 said stop: stop once no other pipe is open
        self.open = set(range(len(conns)))  # the API servers whose pipe is open
        self.owner: dict[str, int] = {}  # request added and not ended -> its API server
        self.added = [0] * len(conns)  # requests each API server added
        self.rows: list[list[tuple]] = [[] for _ in conns]  # what each next message carries
        self.writer = RowWriter()
        self.programs_left = len(engine.cold_programs()) if background else 0
        self.sent: dict[str, Any] | None = None  # the snapshot last sent
        # Each pipe's two directions each on a thread of their own, so an API process's sends
        # never wait for a step to end and a step never waits for an API process to read.
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # (pipe, command list or None)
        self.outboxes = [queue.SimpleQueue() for _ in conns]  # messages; None: no more
        self.senders = []
        for i, conn in enumerate(conns):
            name = f"rosejax-commands-{i}"
            threading.Thread(target=self._receive, args=(i, conn), name=name, daemon=True).start()
            sender = threading.Thread(
                target=self._send, args=(conn, self.outboxes[i]), name=f"rosejax-outputs-{i}"
            )
            sender.daemon = True
            sender.start()
            self.senders.append(sender)
        if background:
            threading.Thread(
                target=compile_while_idle,
                args=(engine, self.idle, self.stop, poll_s, self._compiled),
                name="rosejax-compile",
                daemon=True,
            ).start()

    def _compiled(self) -> None:
        self.programs_left -= 1

    def _receive(self, pipe: int, conn: Connection) -> None:
        try:
            while True:
                self.inbox.put((pipe, conn.recv()))
        except (EOFError, OSError):
            self.inbox.put((pipe, None))

    @staticmethod
    def _send(conn: Connection, outbox: queue.SimpleQueue) -> None:
        try:
            while (message := outbox.get()) is not None:
                conn.send(message)
        except OSError:  # that API process has gone; the receiving thread says so
            pass

    def _commands(self, wait: float) -> None:
        """Handle every command list received, waiting up to `wait` seconds for the first."""
        try:
            item = self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait()
            while True:
                pipe, cmds = item
                if cmds is None:
                    self._closed(pipe)
                else:
                    for cmd in cmds:
                        self._handle(pipe, cmd)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def run(self) -> None:
        try:
            while not (self.stop_asked and self.open <= {0}):
                busy = self.engine.has_unfinished_requests()
                if not busy:
                    self.idle.set()
                self._commands(0 if busy else self.poll_s)
                self.idle.clear()
                if 0 not in self.open:  # nothing to serve
                    log.warning("the API process has gone; this engine process stops")
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                else:  # idle: a program compiled ahead runs its costlier first run now
                    self.engine.run_ahead()
                self._publish()
        finally:
            self.stop.set()
            for outbox in self.outboxes:
                outbox.put(None)
            for sender in self.senders:
                sender.join(5)  # the last outputs out before the process ends

    def _closed(self, pipe: int) -> None:
        self.open.discard(pipe)
        if pipe == 0:
            return
        gone = [rid for rid, owner in self.owner.items() if owner == pipe]
        level = logging.WARNING if gone else logging.INFO
        log.log(level, "API server %d has gone; aborting its %d requests", pipe, len(gone))
        for rid in gone:
            self._abort(rid)

    def _abort(self, rid: str) -> None:
        del self.owner[rid]
        self.writer.forget(rid)
        self.engine.abort_request(rid)

    def _handle(self, pipe: int, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, items, params = cmd
            self.added[pipe] += len(items)
            for rid, ids in items:
                try:
                    self.engine.add_request(rid, ids, params)
                    self.owner[rid] = pipe
                except Exception as e:  # the API process checked it: not expected
                    log.exception("adding %s failed", rid)
                    self.rows[pipe].append(self.writer.error_row(rid, f"adding it failed: {e}"))
        elif cmd[0] == "abort":
            for rid in cmd[1]:
                if self.owner.get(rid) == pipe:
                    self._abort(rid)
        elif cmd[0] == "stop" and pipe == 0:
            self.stop_asked = True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # Not one request's fault (the engine ends those itself): a program failed. Every
            # request in flight may have lost its state; end them all, and serve on.
            log.exception("engine step failed; failing the requests in flight")
            why = "the engine failed while generating; see the server log"
            for rid, pipe in self.owner.items():
                self.engine.abort_request(rid)
                self.rows[pipe].append(self.writer.error_row(rid, why))
            self.owner.clear()
            return
        for out in outputs:
            pipe = self.owner.get(out.request_id)
            if pipe is None:  # its API server has gone
                continue
            if out.finished:
                del self.owner[out.request_id]
            self.rows[pipe].append(self.writer.row(out))

    def _publish(self) -> None:
        snapshot = engine_snapshot(self.engine, self.programs_left)
        if len(self.added) > 1:
            snapshot["api_server_requests"] = list(self.added)
        changed = snapshot != self.sent
        for pipe in self.open:
            if self.rows[pipe] or changed:
                self.outboxes[pipe].put(("out", self.rows[pipe], snapshot))
        self.rows, self.sent = [[] for _ in self.rows], snapshot


def _child_main(
    conns: list[Connection], config: EngineConfig, replica: int, log_level: int
) -> None:
    # Ctrl-C in a terminal reaches the whole process group: the API process decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level,
        format=f"%(levelname)s: %(name)s [engine {replica}]: %(message)s",
        force=True,
    )
    if log_level > logging.DEBUG:
        logging.getLogger("jax").setLevel(logging.WARNING)

    def tell_all(msg: tuple) -> None:
        for conn in conns:
            try:
                conn.send(msg)
            except OSError:  # that API process has gone
                pass

    try:
        engine, background = _replica_engine(config, replica)
    except Exception as e:
        if not isinstance(e, ValueError):
            log.exception("building replica %d's engine failed", replica)
        tell_all(("failed", str(e), isinstance(e, ValueError)))
        return
    info = ReplicaInfo(
        engine.config,
        engine.max_batch_size,
        engine.block_size,
        engine.home_device.platform,
        [d.id for d in engine.devices],
        engine_snapshot(engine, len(engine.cold_programs()) if background else 0),
    )
    tell_all(("ready", info))
    freeze_heap()
    _EngineLoop(engine, conns, background).run()


# ------------------------------------------------------------------------ the API process


def _exit_code(code: int | None) -> str:
    if code is not None and code < 0:
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


class EngineLink:
    """An API process's end of one replica's engine process pipe: what `EngineProcess` talks
    through. This class is the end of an API server process that did not spawn the engine
    process (`--api-server-count`; picklable while spawning that API server): it cannot wait
    for the engine process, and stopping only closes this end (the engine process aborts this
    API server's requests left and serves the others on)."""

    def __init__(self, replica: int, conn: Connection, pid: int | None):
        self.replica, self.conn, self.pid = replica, conn, pid
        self.info: ReplicaInfo | None = None

    def join(self) -> None:
        """Wait a few seconds for the engine process to end (only its spawner can)."""

    def exit_code(self) -> str:
        """How the engine process ended, as far as this process can tell."""
        return "unknown (not this API process's child)"

    def wait_ready(self) -> ReplicaInfo:
        """Its `ReplicaInfo` once its engine is built; ValueError (bad configuration) or
        RuntimeError if it failed or died."""
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the engine process of replica {self.replica} exited with code "
                f"{self.exit_code()} while loading; see the log above"
            ) from None
        if msg[0] == "failed":
            self.join()
            raise (ValueError if msg[2] else RuntimeError)(msg[1])
        self.info = msg[1]
        return self.info

    def send(self, cmds: list) -> None:
        try:
            self.conn.send(cmds)
        except (OSError, ValueError):  # it has died (the reader tells) or its pipe is closed
            pass

    def stop(self, timeout: float) -> None:
        self.conn.close()


class _Child(EngineLink):
    """One replica's process and the spawning API process's end of its pipe; with
    `api_servers` > 1, a pipe more for each other API server process, whose ends (`links`)
    the caller hands to those processes and then closes here."""

    def __init__(
        self, ctx: Any, config: EngineConfig, replica: int, log_level: int, api_servers: int = 1
    ):
        pipes = [ctx.Pipe() for _ in range(api_servers)]
        self.process = ctx.Process(
            target=_child_main,
            args=([child_end for _, child_end in pipes], config, replica, log_level),
            name=f"rosejax-engine-{replica}",
            daemon=True,  # multiprocessing terminates it if the API process exits without stop
        )
        self.process.start()
        for _, child_end in pipes:
            child_end.close()  # so that a dead child reads as EOF here
        super().__init__(replica, pipes[0][0], self.process.pid)
        self.links = [EngineLink(replica, end, self.process.pid) for end, _ in pipes[1:]]

    def join(self) -> None:
        self.process.join(5)

    def exit_code(self) -> str:
        self.join()
        return _exit_code(self.process.exitcode)

    def stop(self, timeout: float) -> None:
        """Tell it to stop and wait `timeout` s; then terminate it, then kill it."""
        self.send([("stop",)])
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("engine process %d did not stop; terminating it", self.replica)
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


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

        if config.num_processes > 1:
            raise ValueError("--engine-process does not combine with --num-processes > 1")
        ctx = multiprocessing.get_context("spawn")  # jax must never be forked
        level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        self.data_parallel_size = config.data_parallel_size
        self.children: list[EngineLink] = list(links or [])
        try:
            for replica in range(0 if links else config.data_parallel_size):
                self.children.append(_Child(ctx, config, replica, level, api_servers))
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
            infos = [child.wait_ready() for child in self.children]
            platforms = [info.platform for info in infos]
            if len(set(platforms)) > 1:
                raise ValueError(
                    f"the replicas found different devices ({platforms}): --data-parallel-size "
                    f"{self.data_parallel_size} needs that many GPUs; lower it"
                )
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
