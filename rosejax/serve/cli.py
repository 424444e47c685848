"""Command line of the server: engine flags (as in `rosejax.generate`) plus HTTP flags."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from rosejax.engine_args import add_engine_args, engine_kwargs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rosejax.serve",
        description="Serve a GPT-2 checkpoint over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
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
        help="most requests allowed to wait beyond a full batch (in flight > "
        "max-batch-size + this -> HTTP 429); -1 = no bound; default: %(default)s",
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
        help="seconds to let open requests finish on SIGINT/SIGTERM before they are "
        "cut; default: %(default)s",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level; default: %(default)s",
    )
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    import uvicorn

    from rosejax.engine.llm_engine import LLMEngine
    from rosejax.serve.app import create_app

    try:
        engine = LLMEngine.from_args(args.model, seed=args.seed, **engine_kwargs(args))
        if args.chat_template:
            with open(args.chat_template) as f:
                engine.tokenizer.chat_template = f.read()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(
        engine,
        served_model_name=args.served_model_name or args.model,
        max_waiting=None if args.max_waiting < 0 else args.max_waiting,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    # uvicorn stops gracefully on SIGINT/SIGTERM and then re-raises the signal under the handlers
    # it found; no-op ones make a requested stop exit 0 (the lifespan stopped the engine thread).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0
