"""Engine processes: one data-parallel replica's `LLMEngine` in a process of its own, driven over
a pipe by the process that spawned it (its driver: a server's API process,
`rosejax.serve.engine_process`; an offline engine, `rosejax.engine.process_engine`), so that the
replicas' host loops and the driver's work never wait for one another's GIL.

- Start: `EngineChild` spawns it (the `spawn` start method: jax must never be forked). It sees
  only its replica's GPUs (CUDA_VISIBLE_DEVICES, `rosejax.settings.select_gpus`, set before its
  backend starts; on a host platform it picks its devices by index as `replica_devices` does),
  builds its `LLMEngine`, warms up (a server's way, `warm_for_serving`, or offline as
  `EngineConfig.warmup` says, as `LLMEngine` does) and answers ("ready", `ReplicaInfo`), or
  ("failed", message, whether it is a ValueError: a bad configuration).
- The driver checks each request as `LLMEngine.add_request` would (`checked_prompt_ids`,
  `check_request`), so an add needs no answer: commands go out without a round trip, many in one
  message. Commands in (one pickled list per message): ("add", [(request id, prompt ids)],
  params), ("abort", [request ids]), ("warmup", programs or None), ("compile_ahead", programs),
  ("stop",). Out: ("out", rows, snapshot) once per engine step with anything new, a row per
  `RequestOutput` carrying what changed in it (`rosejax.engine.output_rows`): the child
  detokenizes (stop strings need the text), the driver only appends; ("done", error or None,
  snapshot) once a warmup or compile_ahead has ended. The snapshot (`engine_snapshot`): the
  scheduler's and KV cache's gauges, compiles, host seconds.
- A child whose driver dies sees its pipe close and exits. SIGINT (a terminal sends it to the
  whole process group) is the driver's to handle: children ignore it and stop when told to, or
  are terminated.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from rosejax.engine.output_rows import RowWriter
from rosejax.engine.serving import (
    compile_while_idle,
    engine_snapshot,
    gather_seconds,
    idle_wait,
    take_commands,
    warm_for_serving,
)
from rosejax.settings import EngineConfig, freeze_heap

log = logging.getLogger("rosejax")


@dataclasses.dataclass(frozen=True)
class ReplicaInfo:
    """What a child tells its driver once its engine is built."""

    model_config: Any
    max_batch_size: int
    block_size: int
    platform: str
    device_ids: list[int]  # of the devices it runs on, as its process numbers them
    snapshot: dict[str, Any]
    # What an offline engine reports of the replica (`rosejax.engine.process_engine`).
    dtype: Any = None
    kernels: Any = None
    decode_steps: int | None = None
    # Its devices as the driver numbers them ("gpu:1"): each child sees its GPUs from 0.
    devices: tuple[str, ...] = ()
    device_kind: str | None = None
    warmup_programs: tuple[tuple[str, int, int | bool], ...] = ()


# --------------------------------------------------------------------------- the child process


def _replica_engine(config: EngineConfig, replica: int, serving: bool) -> tuple[Any, bool, list]:
    """Replica `replica`'s `LLMEngine` on its own devices, warmed up as a server does
    (`serving`) or as `config.warmup` says; whether programs are left to compile while idle, and
    the positions of its devices among the driver's."""
    import jax

    from rosejax.engine.data_parallel import replica_devices
    from rosejax.engine.llm_engine import LLMEngine
    from rosejax.settings import configure_process, select_gpus

    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    positions = [replica * tp + k for k in range(tp)]
    # Before jax starts its backend: this replica's GPUs only, so it takes no memory on others.
    select_gpus(positions, "--data-parallel-size")
    configure_process(config.compilation_cache_dir)
    try:
        devices = jax.local_devices()
    except RuntimeError as e:  # JAX_PLATFORMS names a platform with no device at this position
        raise ValueError(
            f"replica {replica} of --data-parallel-size {dp} found no device ({e}): lower "
            "--data-parallel-size"
        ) from e
    if devices[0].platform == "cpu":  # host devices are all visible: this replica's by index
        devices = replica_devices(dp, tp, devices)[replica]
    elif len(devices) != tp:
        raise ValueError(
            f"replica {replica} of --data-parallel-size {dp} needs {tp} devices, found "
            f"{len(devices)}: lower --data-parallel-size"
        )
    warmup = False if serving else config.warmup
    one = dataclasses.replace(config, data_parallel_size=1, warmup=warmup)
    engine = LLMEngine(one, devices, replica=replica)
    background = warm_for_serving(engine, config.warmup) if serving else False
    return engine, background, positions


class _EngineLoop:
    """The child's loop: commands in, one message of outputs per step out (see the module).

    Its driver is pipe 0. With several API server processes (`--api-server-count`) it has a
    pipe to each: it
    remembers which one added each request, sends each only its own requests' rows (the
    snapshot to all), takes an abort only from the request's owner and a stop only from API
    server 0, and stops then once every other API server's pipe has closed. A pipe of another
    API server that closes aborts that server's requests; the loop serves the rest on."""

    def __init__(
        self, engine: Any, conns: Sequence[Connection], background: bool, poll_s: float = 0.05
    ):
        self.engine, self.poll_s = engine, poll_s
        self.gather_s = gather_seconds(engine.engine_config)
        self.idle, self.stop = threading.Event(), threading.Event()
        self.stop_asked = False  # API server 0 said stop: stop once no other pipe is open
        self.open = set(range(len(conns)))  # the API servers whose pipe is open
        self.owner: dict[str, int] = {}  # request added and not ended -> its API server
        self.added = [0] * len(conns)  # requests each API server added
        self.rows: list[list[tuple]] = [[] for _ in conns]  # what each next message carries
        self.writer = RowWriter()
        self.programs_left = len(engine.cold_programs()) if background else 0
        self.sent: dict[str, Any] | None = None  # the snapshot last sent
        # Each pipe's two directions each on a thread of their own, so a driver's sends never
        # wait for a step to end and a step never waits for a driver to read.
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
        except OSError:  # that driver has gone; the receiving thread says so
            pass

    def _commands(self, idle: bool) -> None:
        """Handle every command list received (`take_commands`: idle, wait for the first and
        gather a burst's)."""
        if idle:
            take_commands(
                self.inbox, self._take, idle_wait(self.engine, self.poll_s), self.gather_s
            )
        else:
            take_commands(self.inbox, self._take, 0.0)

    def _take(self, item: tuple[int, list | None]) -> None:
        pipe, cmds = item
        if cmds is None:
            self._closed(pipe)
        else:
            for cmd in cmds:
                self._handle(pipe, cmd)

    def run(self) -> None:
        try:
            while not (self.stop_asked and self.open <= {0}):
                busy = self.engine.has_unfinished_requests()
                if not busy:
                    self.idle.set()
                self._commands(idle=not busy)
                self.idle.clear()
                if 0 not in self.open:  # nothing to serve
                    log.warning("the process driving it has gone; this engine process stops")
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
                except Exception as e:  # the driver checked it: not expected
                    log.exception("adding %s failed", rid)
                    self.rows[pipe].append(self.writer.error_row(rid, f"adding it failed: {e}"))
        elif cmd[0] == "abort":
            for rid in cmd[1]:
                if self.owner.get(rid) == pipe:
                    self._abort(rid)
        elif cmd[0] in ("warmup", "compile_ahead"):
            self._compile(pipe, cmd[0], cmd[1])
        elif cmd[0] == "stop" and pipe == 0:
            self.stop_asked = True

    def _compile(self, pipe: int, verb: str, programs: Sequence | None) -> None:
        """`LLMEngine.warmup` or `compile_ahead` of `programs`, then ("done", error, snapshot)."""
        error = None
        try:
            if verb == "warmup":
                self.engine.warmup(programs)
            else:
                self.engine.compile_ahead(*programs)
        except Exception as e:
            log.exception("%s failed", verb)
            error = f"{verb} failed in the engine process: {type(e).__name__}: {e}"
        self.outboxes[pipe].put(("done", error, engine_snapshot(self.engine, self.programs_left)))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # Not one request's fault (the engine ends those itself): a program failed. Every
            # request in flight may have lost its state; end them all, and serve on.
            log.exception("engine step failed; failing the requests in flight")
            why = "the engine failed while generating; see the engine process's log"
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
    conns: list[Connection], config: EngineConfig, replica: int, log_level: int, serving: bool
) -> None:
    # Ctrl-C in a terminal reaches the whole process group: the driver decides when to stop.
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
            except OSError:  # that driver has gone
                pass

    try:
        engine, background, positions = _replica_engine(config, replica, serving)
    except Exception as e:
        if not isinstance(e, ValueError):
            log.exception("building replica %d's engine failed", replica)
        tell_all(("failed", str(e), isinstance(e, ValueError)))
        return
    platform = engine.home_device.platform
    info = ReplicaInfo(
        engine.config,
        engine.max_batch_size,
        engine.block_size,
        platform,
        [d.id for d in engine.devices],
        engine_snapshot(engine, len(engine.cold_programs()) if background else 0),
        dtype=engine.dtype,
        kernels=engine.kernels,
        decode_steps=engine.decode_steps,
        devices=tuple(f"{platform}:{p}" for p in positions),
        device_kind=engine.home_device.device_kind,
        warmup_programs=tuple(engine.warmup_programs()),
    )
    tell_all(("ready", info))
    freeze_heap()
    _EngineLoop(engine, conns, background).run()


# ------------------------------------------------------------------------------ the driver


def _exit_code(code: int | None) -> str:
    if code is not None and code < 0:
        return f"{code} ({signal.Signals(-code).name})"
    return str(code)


class EngineLink:
    """A driver's end of one replica's engine process pipe. This class itself is the end of a
    server's API server process that did not spawn the engine process (`--api-server-count`;
    picklable while spawning that API server): it cannot wait for the engine process, and
    stopping only closes this end (the engine process aborts this API server's requests left
    and serves the others on). `EngineChild` is the spawner's end."""

    def __init__(self, replica: int, conn: Connection, pid: int | None):
        self.replica, self.conn, self.pid = replica, conn, pid
        self.info: ReplicaInfo | None = None

    def join(self) -> None:
        """Wait a few seconds for the engine process to end (only its spawner can)."""

    def exit_code(self) -> str:
        """How the engine process ended, as far as this process can tell."""
        return "unknown (not this process's child)"

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


class EngineChild(EngineLink):
    """One replica's engine process (see the module), spawned now, and the spawner's end of its
    pipe. `serving`: it warms up as a server does (`warm_for_serving`), else as
    `config.warmup` says. With `api_servers` > 1, a pipe more for each other API server
    process, whose ends (`links`) the caller hands to those processes and then closes here."""

    def __init__(
        self,
        ctx: Any,
        config: EngineConfig,
        replica: int,
        log_level: int,
        serving: bool,
        api_servers: int = 1,
    ):
        pipes = [ctx.Pipe() for _ in range(api_servers)]
        child_ends = [child_end for _, child_end in pipes]
        self.process = ctx.Process(
            target=_child_main,
            args=(child_ends, config, replica, log_level, serving),
            name=f"rosejax-engine-{replica}",
            daemon=True,  # multiprocessing terminates it if its spawner exits without stop
        )
        self.process.start()
        for child_end in child_ends:
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


def spawn_children(
    config: EngineConfig, log_level: int, serving: bool, api_servers: int = 1
) -> list[EngineChild]:
    """One child per data-parallel replica of `config` (see `EngineChild`); they build their
    engines while the caller goes on (`wait_ready`)."""
    if config.num_processes > 1:
        raise ValueError("--engine-process does not combine with --num-processes > 1")
    ctx = multiprocessing.get_context("spawn")  # jax must never be forked
    children: list[EngineChild] = []
    try:
        for replica in range(config.data_parallel_size):
            children.append(EngineChild(ctx, config, replica, log_level, serving, api_servers))
    except BaseException:
        for child in children:
            child.stop(0)
        raise
    return children


def wait_ready(children: Sequence[EngineLink]) -> list[ReplicaInfo]:
    """Each child's `ReplicaInfo` once its engine is built; ValueError (a bad configuration:
    the message names the flag) or RuntimeError if one failed. The caller stops them then."""
    infos = [child.wait_ready() for child in children]
    platforms = [info.platform for info in infos]
    if len(set(platforms)) > 1:
        raise ValueError(
            f"the replicas found different devices ({platforms}): --data-parallel-size "
            f"{len(children)} needs that many GPUs; lower it"
        )
    return infos
