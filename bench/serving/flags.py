"""The benchmark's command line: its flags, their parsers and checks."""

from __future__ import annotations

import argparse
import math
import os

from bench import common
from rosejax.engine_args import add_logprobs_arg

SLO_METRICS = ("ttft", "tpot", "e2el")
LOOPBACK = "127.0.0.1"


def request_rate(text: str) -> float:
    """argparse type of --request-rate: a positive number or 'inf'."""
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not rate > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a positive number or 'inf', got {text!r}")
    return rate


def percentile_list(text: str) -> list[float]:
    """argparse type of --percentiles: '90,99' -> [50.0, 90.0, 99.0] (the median always)."""
    try:
        ps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not ps or any(not 0 < p < 100 for p in ps):
        raise argparse.ArgumentTypeError(f"percentiles must lie in (0, 100), got {text!r}")
    return sorted({50.0, *ps})


def slo(text: str) -> tuple[str, float]:
    """argparse type of one --goodput item: 'ttft:200' -> ('ttft', 200.0) (milliseconds)."""
    name, sep, value = text.partition(":")
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not sep or name not in SLO_METRICS or not ms > 0:
        raise argparse.ArgumentTypeError(
            f"expected NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}, got {text!r}"
        )
    return name, ms


def default_client_processes() -> int:
    """A client process per two cores, at most 8: against a server that answers at once
    (a raw uvicorn app, 256 streams, a 16-core H100 host) the client alone made TTFT p50
    53 ms with one process, 18 ms with four and 13 ms with eight."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def add_client_arg(g: argparse._ActionsContainer) -> None:
    """--client: the HTTP library (`pick_client`); --client-processes."""
    g.add_argument(
        "--client",
        choices=["auto", "aiohttp", "httpx"],
        default="auto",
        help="HTTP library; auto = aiohttp if installed, else httpx",
    )
    g.add_argument(
        "--client-processes",
        type=int,
        default=default_client_processes(),
        help="client processes sharing the requests (request i goes to process i mod N, all on "
        "one clock), so the client is not what the latencies measure; default: one per two "
        "cores, at most 8 (%(default)s here)",
    )
    g.add_argument(
        "--client-nice",
        type=int,
        default=0,
        choices=range(20),
        metavar="N",
        help="niceness (0-19) of the client processes: on a host they share with the server, "
        "N > 0 gives the server the first call on the cores, as the in-process side has them "
        "(the clients then run in processes of their own even if there is one)",
    )


def build_parser(doc: str, where: bool = True) -> argparse.ArgumentParser:
    """The parser, described by `doc` (the script's docstring); `where=False`: no --base-url or
    --launch, the script launches its own servers."""
    p = common.new_parser(doc)
    g = p.add_argument_group("server")
    if where:
        where_group = g.add_mutually_exclusive_group()
        where_group.add_argument(
            "--base-url",
            default=f"http://{LOOPBACK}:8000",
            help="the running server to drive (its /v1/completions)",
        )
        where_group.add_argument(
            "--launch",
            action="store_true",
            help="start `python -m rosejax.serve` with this script's engine flags on a free "
            "loopback port, wait for /health, run, then stop it (SIGINT)",
        )
    else:
        p.set_defaults(launch=True, base_url=None)
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name sent in each request; default: the first of /v1/models",
    )
    g.add_argument(
        "--server-args",
        default="--max-waiting -1",
        help="more flags for the launched server, one shell-quoted string (the default lets any "
        "number of requests wait instead of answering 429)",
    )
    g.add_argument(
        "--launch-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the launched server's /health (a GPU start compiles)",
    )
    g.add_argument(
        "--no-wait-compiled",
        action="store_true",
        help="start the runs once /health answers, while the server still compiles the "
        "programs its first requests did not need and runs each once (it does so only while "
        "idle); by default the runs wait for it, to time the steady state",
    )
    g.add_argument(
        "--server-log",
        default=None,
        metavar="PATH",
        help="the launched server's output; default: a temporary file (printed on failure)",
    )

    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        choices=["random", "jsonl"],
        default="random",
        help="where prompts come from: random token ids, or --dataset-path",
    )
    g.add_argument(
        "--dataset-path",
        default=None,
        metavar="FILE",
        help="--dataset jsonl: one JSON object a line, 'prompt' (text or a list of token ids) "
        "and optionally 'output_len' (default --output-len); its first --num-prompts lines",
    )
    g.add_argument("--num-prompts", type=int, default=256, help="requests in the timed run")
    g.add_argument("--input-len", type=int, default=8, help="--dataset random: prompt tokens")
    g.add_argument(
        "--output-len", type=int, default=256, help="new tokens per request (max_tokens, EOS off)"
    )
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="--dataset random: lengths uniform in [len x (1 - r), len x (1 + r)], r in [0, 1)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=50257,
        help="--dataset random: prompt ids are uniform in [0, this - 1) (GPT-2's vocabulary "
        "without its end-of-text id 50256)",
    )
    g.add_argument(
        "--request-rate",
        type=request_rate,
        default=math.inf,
        help="requests per second, a Poisson process (seeded); inf = all at once",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gaps between arrivals are gamma(shape = this, mean = 1 / rate): 1 = Poisson, "
        "< 1 burstier, > 1 more even",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight; a due request waits for a slot and is "
        "timed from when it is sent",
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy"
    )
    add_logprobs_arg(g)
    g.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="untimed runs first, on each side: the timed workload's lengths and arrivals, "
        "fresh random prompts (text prompts get a prefix), so nothing is served from the "
        "prefix cache in the timed run; give 2-3 where programs compile on first use (a CPU, "
        "--no-warmup)",
    )

    g = p.add_argument_group("client and report")
    add_client_arg(g)
    g.add_argument(
        "--continuous-usage-stats",
        action="store_true",
        help="ask for cumulative usage in every chunk (vLLM's stream_options."
        "continuous_usage_stats) for exact tokens per event",
    )
    g.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.0,
        help="HTTP side: this fraction of the requests (spread evenly) close their stream after "
        "--disconnect-after events, as clients that leave; they count as disconnected, not "
        "failed, and the figures are the other requests'",
    )
    g.add_argument(
        "--disconnect-after",
        type=int,
        default=3,
        help="text events a disconnecting client reads before it closes the stream",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one request may take, from its send to the stream's end",
    )
    g.add_argument(
        "--percentiles",
        type=percentile_list,
        default=[50.0, 90.0, 99.0],
        metavar="P1,P2,...",
        help="percentiles of TTFT, TPOT, ITL and E2EL (the median is always in)",
    )
    g.add_argument(
        "--goodput",
        type=slo,
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs in ms (ttft, tpot, e2el), e.g. ttft:200 tpot:10: goodput is the rate of "
        "completed requests that met every one (a one-token request's TPOT counts as 0)",
    )
    g.add_argument(
        "--in-process",
        action="store_true",
        help="also run the same workload through LLMEngine in this process (built from the "
        "engine flags; after --launch's server stopped) and print HTTP / in-process. Beside a "
        "--base-url server on the same GPU, give XLA_PYTHON_CLIENT_PREALLOCATE=false and "
        "--kv-cache-tokens: jax's preallocation of 75%% of the GPU aborts this process",
    )
    g.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="write config, environment and every figure here",
    )
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="put every request's record (send, event times and tokens, end) into --json",
    )
    g.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="TTFT and ITL distributions here, latency and throughput over time beside it "
        "(STEM.timeline.png); needs matplotlib",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")

    g = p.add_argument_group("engine (--launch and --in-process)")
    common.add_engine_args(g, max_batch_size=256)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_prompts < 1 or args.output_len < 1 or args.input_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be >= 1")
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must lie in [0, 1)")
    if args.burstiness <= 0:
        p.error("--burstiness must be > 0")
    if not 0 <= args.disconnect_fraction < 1 or args.disconnect_after < 1:
        p.error("--disconnect-fraction must be in [0, 1) and --disconnect-after >= 1")
    if args.client_processes < 1:
        p.error("--client-processes must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.warmup_runs < 0 or args.request_timeout <= 0:
        p.error("--warmup-runs must be >= 0 and --request-timeout > 0")
    if (args.dataset == "jsonl") != (args.dataset_path is not None):
        p.error("--dataset-path goes with --dataset jsonl (and only with it)")
    if args.vocab_size < 2:
        p.error("--vocab-size must be >= 2")
    if not args.launch:
        host = args.base_url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
        if host not in (LOOPBACK, "localhost"):
            p.error(f"--base-url must be a loopback address ({LOOPBACK}), got {args.base_url}")
