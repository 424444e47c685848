"""Command line of the server: engine flags (as in `rosejax.generate`) plus HTTP flags."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from rosejax.engine_args import add_engine_args, engine_kwargs
from rosejax.models import SUPPORTED_MODEL_TYPES
from rosejax.serve.protocol import Limits
from rosejax.settings import EngineConfig, configure_process


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rosejax.serve",
        description=f"Serve a Hugging Face checkpoint (model_type {SUPPORTED_MODEL_TYPES}) over an "
        "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics).",
    )
    add_engine_args(p)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists; default: --model",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (0.0.0.0 for every interface); default: %(default)s",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port; default: %(default)s")
    p.add_argument(
        "--max-waiting",
        type=int,
        default=512,
        help="most sequences allowed to wait beyond a full batch, a request's n choices each "
        "counting (in flight > max-batch-size + this -> HTTP 429); -1 = no bound; default: "
        "%(default)s",
    )
    p.add_argument(
        "--idle-gather-ms",
        type=float,
        default=EngineConfig.idle_gather_ms,
        metavar="MS",
        help="an idle engine that receives a request goes on taking requests while each comes "
        "within MS of the last (--idle-gather-max-ms in all at most) before it steps, so that a "
        "burst is prefilled together; costs a lone request up to MS of its TTFT; 0 = step at "
        "once; default: %(default)s",
    )
    p.add_argument(
        "--idle-gather-max-ms",
        type=float,
        default=EngineConfig.idle_gather_max_ms,
        metavar="MS",
        help="the longest an idle engine gathers a burst's requests (--idle-gather-ms) before "
        "it steps; default: %(default)s",
    )
    p.add_argument(
        "--generation-config",
        default=EngineConfig.generation_config,
        help="where requests' default sampling comes from, as in vLLM: 'auto', the model's "
        "generation_config.json (the temperature, top_k, top_p, min_p and repetition_penalty it "
        "sets become the defaults of requests that leave them out); 'vllm', none (temperature "
        "1, no filters); or a directory holding a generation_config.json; default: %(default)s",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="engine seed: random:* weights, and sampling of requests without a seed; "
        "default: %(default)s",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file, enabling /v1/chat/completions for a tokenizer "
        "without one (GPT-2 has none)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds to let open requests finish on SIGINT/SIGTERM; then each ends with an "
        "error (a stream with an error event and [DONE], others with a JSON 503); "
        "default: %(default)s",
    )
    limits = Limits()
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=limits.max_body_bytes,
        help="largest request body (HTTP 413 past it); default: %(default)s",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="most characters of one prompt (or chat's messages), checked before tokenizing; "
        "default: the context times the longest token, past which no prompt fits",
    )
    p.add_argument(
        "--max-stop-sequences",
        type=int,
        default=limits.max_stop,
        help="most stop strings, and most stop token ids, per request; default: %(default)s",
    )
    p.add_argument(
        "--max-stop-chars",
        type=int,
        default=limits.max_stop_chars,
        help="most characters of one stop string; default: %(default)s",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=limits.read_timeout,
        help="seconds a client has to send a request's head, and then its body (HTTP 408); "
        "0 = no limit; default: %(default)s",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each replica's engine loop in a process of its own (spawned; with "
        "--data-parallel-size N, N processes), so that HTTP work and the engine loops never "
        "wait for one another's GIL: the API process only does HTTP, JSON, tokenizing and "
        "checks; --no-engine-process runs each replica's engine loop on a thread of the API "
        "process (one process in all). Default: processes with --data-parallel-size > 1 (one "
        "GIL does not hold several engines' host work), a thread with one replica (it served "
        "256 streams faster on an H100); processes with --api-server-count > 1 too",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        metavar="N",
        help="API server processes (HTTP, JSON, tokenizing, checks) in front of the engine "
        "processes, all accepting on one listening socket, as vLLM's flag: one event loop "
        "admitting a burst of hundreds of requests delays every first token. N > 1 runs the "
        "engine in engine processes (not with --no-engine-process); this process is API "
        "server 0 and spawns the others. Each API server bounds its own share of "
        "--max-waiting (429 past max-batch-size + ceil(max-waiting / N) sequences in flight "
        "through it: it cannot see the others' without a round trip). /metrics reports the "
        "whole server whichever process answers: request counters and latency histograms "
        "summed over the API servers (prometheus_client's multiprocess mode, in a temporary "
        "directory removed at the stop), engine gauges from the engine processes; /health is "
        "that process's. Default: 4 per replica, at most a quarter of this machine's cores, at "
        "least 1 (on a 16-core H100 host 4 served 256 streams at 0.81-0.88 of the engine's "
        "in-process throughput, 1 at 0.58-0.64, 8 at 0.80); 1 with --no-engine-process",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level; default: %(default)s",
    )
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    p.add_argument(
        "--http",
        default="auto",
        choices=["auto", "httptools", "h11"],
        help="uvicorn's HTTP implementation: httptools (C, installed with the serve extra's "
        "uvicorn[standard]) or h11 (pure Python: about a third of the streamed events per second); "
        "auto = httptools where installed; default: %(default)s",
    )
    return p


def _read_chat_template(args: argparse.Namespace) -> str | None:
    """The --chat-template file's text, checked on the model's tokenizer with a one-message chat
    (ValueError), so a broken template stops the start rather than every chat request."""
    if not args.chat_template:
        return None
    with open(args.chat_template, encoding="utf-8") as f:
        template = f.read()
    from rosejax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model, args.tokenizer)
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello"}],
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as e:  # jinja2's syntax and render errors, a missing jinja2
        raise ValueError(f"the chat template {args.chat_template} does not work: {e}") from e
    return template


def default_api_server_count(data_parallel_size: int, engine_process: bool | None) -> int:
    """--api-server-count when not given: 4 per replica, at most a quarter of the cores this
    process may run on, at least 1; 1 when the engine runs on a thread of this process."""
    if engine_process is False:
        return 1
    cores = len(os.sched_getaffinity(0))
    return max(1, min(4 * data_parallel_size, cores // 4))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    import uvicorn  # noqa: F401 (the serve extra: fail before loading a model if it is missing)

    from rosejax.engine.data_parallel import make_engine, replica_devices
    from rosejax.engine.serving import warm_for_serving
    from rosejax.models.loader import sampling_defaults

    api_servers = None
    try:
        if args.api_server_count is None:
            args.api_server_count = default_api_server_count(
                args.data_parallel_size, args.engine_process
            )
        if args.api_server_count < 1:
            raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
        if args.api_server_count > 1 and args.engine_process is False:
            raise ValueError(
                "--api-server-count > 1 needs the engine in engine processes (the API server "
                "processes share them): drop --no-engine-process"
            )
        limits = Limits(
            max_body_bytes=args.max_request_bytes,
            max_prompt_chars=args.max_prompt_chars,
            max_stop=args.max_stop_sequences,
            max_stop_chars=args.max_stop_chars,
            read_timeout=args.request_timeout,
        )
        served = {  # EngineConfig fields only the server has flags for
            "idle_gather_ms": args.idle_gather_ms,
            "idle_gather_max_ms": args.idle_gather_max_ms,
            "generation_config": args.generation_config,
        }
        kwargs = engine_kwargs(args) | served
        config = EngineConfig(model=args.model, seed=args.seed, **kwargs | {"warmup": False})
        configure_process(config.compilation_cache_dir)  # before jax starts its backend
        template = _read_chat_template(args)
        defaults = sampling_defaults(config.model, config.generation_config)
        if defaults:
            logging.getLogger("rosejax").info(
                "requests' default sampling, from the model's generation config: %s", defaults
            )
        in_processes = args.engine_process
        if in_processes is None:  # the default: processes for several replicas, or API servers
            in_processes = config.data_parallel_size > 1 or args.api_server_count > 1
        if in_processes:
            # Spawned first: the children import jax and build their engines (each warms up as
            # below) while this process imports its HTTP stack and starts listening.
            from rosejax.serve.engine_process import EngineProcesses

            processes = EngineProcesses(
                dataclasses.replace(config, warmup=kwargs["warmup"]),
                wait=False,
                api_servers=args.api_server_count,
            )
            if args.api_server_count > 1:
                from rosejax.serve.api_servers import ApiServers

                # On failure it closes the engine processes.
                api_servers = ApiServers(args, config, limits, template, defaults, processes)
        else:
            # Too few devices: refused before listening. Engine processes check their own:
            # jax's backend here would take GPU memory from them.
            replica_devices(config.data_parallel_size, config.tensor_parallel_size)
    except (ValueError, OSError) as e:  # bad flags, a chat template missing or broken, a port
        print(f"error: {e}", file=sys.stderr)
        return 2

    def build() -> tuple[Any, bool, Callable[[], None] | None]:
        if in_processes:
            processes.wait_ready()
            return processes, False, processes.close
        engine = make_engine(dataclasses.replace(config, engine_process=False))  # threads
        return engine, warm_for_serving(engine, kwargs["warmup"]), None

    if api_servers is None:
        return run_server(args, limits, template, defaults, build, max_waiting(args, 1))
    try:
        return run_server(
            args,
            limits,
            template,
            defaults,
            build,
            max_waiting(args, args.api_server_count),
            sock=api_servers.sock,
            on_shutdown=api_servers.begin_shutdown,
            metrics_dir=api_servers.metrics_dir,
            ready_together=api_servers.ready_together,
        )
    finally:
        api_servers.stop()


def configure_logging(log_level: str, name: str = "") -> None:
    """The server's log format at `log_level`, naming the process (`name`) where it is one of
    several API servers."""
    level = log_level.upper()
    logging.basicConfig(level=level, format=f"%(levelname)s: %(name)s{name}: %(message)s")
    if level != "DEBUG":  # jax's INFO lines (backends it probed and did not find) are noise here
        logging.getLogger("jax").setLevel(logging.WARNING)


def max_waiting(args: argparse.Namespace, api_servers: int) -> int | None:
    """The --max-waiting bound of one of `api_servers` API server processes: its share,
    rounded up (None: no bound)."""
    if args.max_waiting < 0:
        return None
    return -(-args.max_waiting // api_servers)


def run_server(
    args: argparse.Namespace,
    limits: Limits,
    template: str | None,
    defaults: dict[str, Any],
    build: Callable[[], tuple[Any, bool, Callable[[], None] | None]],
    max_waiting: int | None,
    sock: socket.socket | None = None,
    on_shutdown: Callable[[], None] | None = None,
    metrics_dir: str | None = None,
    ready_together: Any = None,
) -> int:
    """Serve until SIGINT/SIGTERM: at once a `LoadingApp` (503s) on `sock` (or on --host and
    --port), then the app over the engine that `build()` returns on a thread of its own (the
    engine, whether to compile the rest while idle, and how to close it if a stop comes first),
    with the chat `template` and the requests' sampling `defaults`.
    `metrics_dir`: this is one of several API server processes, which keep their metrics there
    (`ServerMetrics(shared_dir=...)`); `ready_together` (`api_servers.ReadyTogether`): they all
    start serving at once. Returns the exit code."""
    from rosejax.serve.app import create_app
    from rosejax.serve.loading import LoadingApp
    from rosejax.serve.metrics import ServerMetrics
    from rosejax.serve.server import make_server
    from rosejax.settings import freeze_heap
    from rosejax.tokenizer import warm_tokenizer

    # The server listens at once, answering 503 while the engine loads on another thread.
    loading = LoadingApp(limits)
    server = make_server(
        loading,
        shutdown_timeout=args.shutdown_timeout,
        on_shutdown=on_shutdown,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        http=args.http,
    )
    failed: list[str] = []

    def load() -> None:
        try:
            engine, background, close = build()
            if template is not None:
                engine.tokenizer.chat_template = template
            app = create_app(
                engine,
                served_model_name=args.served_model_name or args.model,
                max_waiting=max_waiting,
                metrics=None if metrics_dir is None else ServerMetrics(shared_dir=metrics_dir),
                limits=limits,
                warm_in_background=background,
                sampling_defaults=defaults,
            )
            if ready_together is not None:
                ready_together.arrive_and_wait(lambda: server.should_exit)
            if not server.should_exit:  # a stop asked for while loading: nothing to serve
                loading.ready(app)
                warm_tokenizer(engine.tokenizer)
                freeze_heap()
            elif close is not None:
                close()
        except (ValueError, OSError, RuntimeError) as e:
            failed.append(str(e))
            print(f"error: {e}", file=sys.stderr)
            server.should_exit = True
        except BaseException:
            failed.append("loading failed")
            server.should_exit = True
            raise

    threading.Thread(target=load, name="rosejax-load", daemon=True).start()
    # uvicorn stops gracefully on SIGINT/SIGTERM and then re-raises the signal under the handlers
    # it found; no-op ones make a requested stop exit 0 (the lifespan stopped the engines).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=None if sock is None else [sock])
    return 2 if failed else 0
