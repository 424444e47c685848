"""Serving benchmark: drive the OpenAI-compatible HTTP server as `vllm bench serve` does, and
(with --in-process) the same workload through the engine in this process, for the HTTP cost.

Requests come from a dataset (`--dataset random`: token-id prompts of --input-len, --output-len
new tokens, both uniform in [len x (1 - r), len x (1 + r)] with --range-ratio r; or `--dataset
jsonl`: one {"prompt": text or token ids, "output_len": N} per line) and arrive all at once
(--request-rate inf) or as a seeded Poisson process (exponential gaps; --burstiness b != 1: gamma
gaps), at most --max-concurrency in flight. Each is a streamed /v1/completions call with
`ignore_eos` and `max_tokens` = its output length, so every length is exact.

Per request (times on the client): TTFT = first streamed text - send; E2EL = end of the stream -
send; TPOT = (E2EL - TTFT) / (output tokens - 1), output tokens from the stream's final `usage`.
ITL (inter-token latency): each SSE event's gap from the one before it, spread evenly over the
tokens it brought (an event carries a whole multi-step decode window, up to 32 tokens in rosejax).
How many tokens an event brought is exact when the server streams cumulative usage in every
chunk (--continuous-usage-stats, vLLM's `stream_options.continuous_usage_stats`; rosejax refuses
it today); otherwise the first event counts one token (the prefill's) and the rest share the
remaining tokens evenly (integers, in order), which is exact when the windows are equal and keeps
every request's ITLs summing to its decode time. The gaps between events themselves (exact) are
reported as "event gap". The --in-process run knows each delivery's tokens exactly.
Over the run (duration = first send to last stream's end, as vLLM): completed and failed requests,
input and output tokens, request / output-token / total-token throughput, TTFT, TPOT, ITL, E2EL
(mean, median, --percentiles), and with --goodput the rate of requests that met every given SLO.

--in-process runs the same prompts at the same arrival times through `LLMEngine` stepping in this
process (bench/common.py's loop, as benchmark_streaming.py; after the launched server stopped)
and prints HTTP / in-process for each figure; issue 17 asks 256 streams x 256 tokens over HTTP
for >= 90% of the in-process output throughput with TTFT p50 within 2x. Each side first runs
--warmup-runs untimed copies of the workload (same lengths and arrivals, fresh random prompts, so
the timed run finds no cached prefix). Where programs compile on first use (a CPU, or
--no-warmup) one warm-up run may not meet every shape the timed run will (batches form with
other timings) and a compile then lands in the timed run: give 2 or 3; the in-process engine also
finds the programs the server compiled in jax's persistent compilation cache.

    # CPU quick run: launch a tiny server, 16 requests at 20 req/s, and the same in process
    PYTHONPATH=. python bench/benchmark_serving.py --launch --model random:tiny --no-warmup \\
        --num-prompts 16 --input-len 16 --output-len 32 --range-ratio 0.5 --request-rate 20 \\
        --warmup-runs 3 --in-process --goodput ttft:50 tpot:5
    # GPU, issue 17's acceptance (the defaults: GPT-2 124M shape, random weights, max batch 256,
    # 256 x 8-token prompts, 256 new tokens each, all at once), HTTP against in process
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/benchmark_serving.py --launch --in-process \\
        --json bench/out/serve256.json --plot bench/out/serve256.png
    # the same with the engine loop on a thread of the server's process (--no-engine-process;
    # the server's default runs it in a process of its own)
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/benchmark_serving.py --launch --in-process \\
        --server-args "--max-waiting -1 --no-engine-process" --json bench/out/serve256-thread.json
    # GPU, Poisson arrivals toward saturation (a starting rate: raise it until TTFT climbs), SLOs
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/benchmark_serving.py --launch \\
        --num-prompts 2000 --input-len 128 --output-len 128 --range-ratio 0.5 \\
        --request-rate 400 --goodput ttft:100 tpot:2 --json bench/out/serve-poisson.json
    # against a server that is already up (nothing launched; engine flags then only serve
    # --in-process, and must match the server's for a fair ratio)
    python -m rosejax.serve --model gpt2 --max-batch-size 256 --max-waiting -1 &
    python bench/benchmark_serving.py --base-url http://127.0.0.1:8000 --num-prompts 512 \\
        --request-rate 100 --max-concurrency 256
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import itertools
import json
import math
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench import metrics as m  # noqa: E402
from rosejax.engine_args import add_logprobs_arg  # noqa: E402

SLO_METRICS = ("ttft", "tpot", "e2el")
LOOPBACK = "127.0.0.1"

# ------------------------------------------------------------------------------------ flags


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


def build_parser() -> argparse.ArgumentParser:
    p = common.new_parser(__doc__)
    g = p.add_argument_group("server")
    where = g.add_mutually_exclusive_group()
    where.add_argument(
        "--base-url",
        default=f"http://{LOOPBACK}:8000",
        help="the running server to drive (its /v1/completions)",
    )
    where.add_argument(
        "--launch",
        action="store_true",
        help="start `python -m rosejax.serve` with this script's engine flags on a free "
        "loopback port, wait for /health, run, then stop it (SIGINT)",
    )
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
        "programs its first requests did not need (it does so only while idle); by default "
        "the runs wait for it, to time the steady state",
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
        "continuous_usage_stats) for exact tokens per event; rosejax answers 400 to it today",
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
        "engine flags; after --launch's server stopped) and print HTTP / in-process",
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
    host = args.base_url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    if not args.launch and host not in (LOOPBACK, "localhost"):
        p.error(f"--base-url must be a loopback address ({LOOPBACK}), got {args.base_url}")


# --------------------------------------------------------------------------------- workload


@dataclasses.dataclass
class Sample:
    """One request of the workload."""

    prompt: str | list[int]
    output_len: int

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens if the prompt is token ids (text: the server's usage tells)."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


def uniform_lengths(length: int, ratio: float, n: int, rng: np.random.Generator) -> list[int]:
    """n integers uniform in [floor(length (1 - ratio)), floor(length (1 + ratio))], at least 1."""
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_dataset(args: argparse.Namespace, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    n = args.num_prompts
    in_lens = uniform_lengths(args.input_len, args.range_ratio, n, rng)
    out_lens = uniform_lengths(args.output_len, args.range_ratio, n, rng)
    return [
        Sample([int(t) for t in rng.integers(0, args.vocab_size - 1, size=k)], o)
        for k, o in zip(in_lens, out_lens, strict=True)
    ]


def jsonl_dataset(path: str, num_prompts: int, output_len: int) -> list[Sample]:
    out: list[Sample] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(out) == num_prompts:
                break
            if not line.strip():
                continue
            obj = json.loads(line)
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
            if not (isinstance(prompt, str) and prompt) and not ids:
                raise SystemExit(f"{path}:{lineno}: 'prompt' must be non-empty text or token ids")
            n = obj.get("output_len", output_len)
            if type(n) is not int or n < 1:
                raise SystemExit(f"{path}:{lineno}: 'output_len' must be an int >= 1")
            out.append(Sample(prompt, n))
    if not out:
        raise SystemExit(f"{path}: no prompts")
    if len(out) < num_prompts:
        print(f"{path}: {len(out)} prompts (fewer than --num-prompts)", file=sys.stderr)
    return out


def warmup_samples(samples: Sequence[Sample], run: int, args: argparse.Namespace) -> list[Sample]:
    """Warm-up run `run`: each sample's lengths with fresh random ids (text: a prefix added)."""
    rng = np.random.default_rng([args.seed, 1000 + run])
    return [
        Sample(f"warm-up {run}-{i}: {s.prompt}", s.output_len)
        if isinstance(s.prompt, str)
        else Sample(
            [int(t) for t in rng.integers(0, args.vocab_size - 1, len(s.prompt))], s.output_len
        )
        for i, s in enumerate(samples)
    ]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start each request is due: 0 for the first; then gaps drawn from
    gamma(shape = burstiness, scale = 1 / (rate x burstiness)) (burstiness 1: exponential, a
    Poisson process of `rate` per second). rate inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


# ------------------------------------------------------------------------- per request


def even_counts(tokens: int, events: int) -> list[int]:
    """Tokens per event when only the total is known: the first event brings 1 (the prefill's),
    the rest share tokens - 1 as evenly as integers allow (in order). Sums to `tokens`."""
    if events == 0:
        return []
    if events == 1 or tokens <= 1:
        return [tokens] + [0] * (events - 1)
    rest, k = tokens - 1, events - 1
    return [1] + [(j + 1) * rest // k - j * rest // k for j in range(k)]


def token_itls(times: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Inter-token latencies from event times and the tokens each event brought: the gap before
    an event is spread evenly over its tokens; tokens of the first event after the first one
    have gap 0; an event that brought no token hands its gap on to the next one. One value per
    token after the first (when the last event brought a token)."""
    if not times:
        return []
    out = [0.0] * max(0, counts[0] - 1)
    gap = 0.0
    for prev, t, k in zip(times, times[1:], counts[1:], strict=False):
        gap += t - prev
        if k > 0:
            out += [gap / k] * k
            gap = 0.0
    return out


@dataclasses.dataclass
class Record:
    """One request as its client saw it; times in seconds from the run's start."""

    index: int
    expected_output_len: int
    scheduled_s: float  # when it was due
    prompt_len: int | None = None  # from the final usage (or the token-id prompt)
    sent_s: float | None = None  # when it was sent (after waiting for a concurrency slot)
    event_s: list[float] = dataclasses.field(default_factory=list)  # each event bringing text
    event_tokens: list[int] | None = None  # tokens each event brought, where known exactly
    output_tokens: int = 0  # from the final usage
    end_s: float | None = None  # the stream's end ([DONE] read)
    error: str | None = None
    disconnect_after: int | None = None  # events read before the client leaves on purpose

    @property
    def disconnected(self) -> bool:
        return self.disconnect_after is not None and len(self.event_s) >= self.disconnect_after

    @property
    def ok(self) -> bool:
        done = self.error is None and self.end_s is not None and bool(self.event_s)
        return done and self.disconnect_after is None

    @property
    def counts(self) -> list[int]:
        """Tokens per event: exact where known, else even_counts."""
        if self.event_tokens is not None:
            return self.event_tokens
        return even_counts(self.output_tokens, len(self.event_s))

    def ttft(self) -> float | None:
        return self.event_s[0] - self.sent_s if self.ok else None

    def e2el(self) -> float | None:
        return self.end_s - self.sent_s if self.ok else None

    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2el() - self.ttft()) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return token_itls(self.event_s, self.counts) if self.ok else []

    def event_gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.event_s)] if self.ok else []

    def as_json(self) -> dict[str, Any]:
        def ms(v):
            return None if v is None else v * 1e3

        return dataclasses.asdict(self) | {
            "ttft_ms": ms(self.ttft()),
            "tpot_ms": ms(self.tpot()),
            "e2el_ms": ms(self.e2el()),
        }


def meets_slos(r: Record, slos: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (ms); a one-token request's TPOT counts as 0."""
    value = {"ttft": r.ttft(), "tpot": r.tpot() or 0.0, "e2el": r.e2el()}
    return all(value[k] * 1e3 <= ms for k, ms in slos.items())


def summarize(
    records: Sequence[Record],
    duration: float,
    percentiles: Sequence[float],
    slos: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's figures, as `vllm bench serve` reports them; latencies in ms."""
    ok = [r for r in records if r.ok]

    def stats(values) -> dict:
        return m.scaled(m.percentiles(values, percentiles), 1e3)

    total_in = sum(r.prompt_len or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    events = sum(len(r.event_s) for r in ok)
    out: dict[str, Any] = {
        "completed": len(ok),
        "disconnected": sum(r.disconnected for r in records),
        "failed": sum(not r.ok and not r.disconnected for r in records),
        "output_len_mismatches": sum(r.output_tokens != r.expected_output_len for r in ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": stats(r.ttft() for r in ok),
        "tpot_ms": stats(r.tpot() for r in ok),
        "itl_ms": stats(x for r in ok for x in r.itls()),
        "e2el_ms": stats(r.e2el() for r in ok),
        "event_gap_ms": stats(g for r in ok for g in r.event_gaps()),
        "event_gap_max_ms": max((g * 1e3 for r in ok for g in r.event_gaps()), default=None),
        "tokens_per_event": total_out / events if events else None,
        "itl_token_counts": (
            "exact" if ok and all(r.event_tokens is not None for r in ok) else "even_spread"
        ),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        out["goodput"] = {"slo_ms": slos, "good_requests": good, "request_goodput": good / duration}
    return out


# -------------------------------------------------------------------------------- HTTP side


def pick_client(name: str) -> str:
    if name != "auto":
        return name
    try:
        import aiohttp  # noqa: F401

        return "aiohttp"
    except ImportError:
        return "httpx"


def client_version(name: str) -> str:
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def run_client(coro: Any) -> Any:
    """Run the client's coroutine on uvloop where it is installed (uvicorn[standard] brings it):
    a client that reads hundreds of streams must not be what the figures measure."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def client_loop() -> str:
    return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


class HTTPStatusError(Exception):
    pass


@contextlib.asynccontextmanager
async def open_session(client: str, connections: int | None):
    """An HTTP session of `client` whose post_lines(url, body) yields the response's lines."""
    if client == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=connections or 0)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:

            async def post_lines(url: str, body: dict) -> AsyncIterator[bytes]:
                async with session.post(url, json=body) as r:
                    if r.status != 200:
                        raise HTTPStatusError(f"HTTP {r.status}: {(await r.text())[:300]}")
                    async for line in r.content:
                        yield line

            yield post_lines
    else:
        import httpx

        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        async with httpx.AsyncClient(limits=limits, timeout=None) as session:

            async def post_lines(url: str, body: dict) -> AsyncIterator[bytes]:
                async with session.stream("POST", url, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        raise HTTPStatusError(f"HTTP {r.status_code}: {r.text[:300]}")
                    async for line in r.aiter_lines():
                        yield line.encode()

            yield post_lines


def completion_body(model: str, s: Sample, args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"include_usage": True}
    if args.continuous_usage_stats:
        options["continuous_usage_stats"] = True
    return {
        "model": model,
        "prompt": s.prompt,
        "max_tokens": s.output_len,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": options,
    } | ({} if args.logprobs is None else {"logprobs": args.logprobs})


class _StreamReader:
    """Feeds one response's SSE lines into its Record."""

    def __init__(self, rec: Record):
        self.rec = rec
        self.done = False
        self.exact = True  # every text event carried cumulative usage so far
        self.seen = 0  # cumulative completion tokens at the last text event
        self.pending = 0  # tokens of chunks without text, for the next text event

    def line(self, raw: bytes, now: float) -> None:
        raw = raw.strip()
        if not raw.startswith(b"data:"):
            return
        data = raw[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        rec = self.rec
        if "error" in obj:
            err = obj["error"]
            rec.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return
        usage = obj.get("usage") or None
        choices = obj.get("choices") or []
        if not choices:  # the final usage chunk
            if usage:
                rec.output_tokens = int(usage.get("completion_tokens") or 0)
                rec.prompt_len = usage.get("prompt_tokens", rec.prompt_len)
            return
        text = choices[0].get("text") or ""
        new = None
        if usage and usage.get("completion_tokens") is not None:  # continuous usage stats
            total = int(usage["completion_tokens"])
            new, self.seen = total - self.seen, total
        if not text:
            self.pending += new or 0
            return
        rec.event_s.append(now)
        if new is None:
            self.exact = False
        elif self.exact:
            if rec.event_tokens is None:
                rec.event_tokens = []
            rec.event_tokens.append(new + self.pending)
            self.pending = 0

    def finish(self) -> None:
        rec = self.rec
        if not self.exact:
            rec.event_tokens = None
        elif rec.event_tokens and self.pending:  # tokens after the last text: the last event's
            rec.event_tokens[-1] += self.pending
        if rec.disconnected:  # left on purpose: no [DONE], no usage
            return
        if rec.error is None and not self.done:
            rec.error = "the stream ended without data: [DONE]"
        if rec.error is None and not rec.event_s:
            rec.error = "no text streamed"
        if rec.error is None and not rec.output_tokens:  # no usage: count what was streamed
            rec.output_tokens = sum(rec.event_tokens) if rec.event_tokens else len(rec.event_s)


async def run_http(
    url: str,
    model: str,
    samples: Sequence[Sample],
    offsets: Sequence[float],
    args: argparse.Namespace,
    client: str,
    tag: str = "http",
    indexes: Sequence[int] | None = None,
    start_at: float | None = None,
    max_concurrency: int | None = None,
) -> tuple[list[Record], float]:
    """Send samples[i] at offsets[i] after `start_at` (a `time.monotonic()` instant; default:
    now), at most `max_concurrency` in flight, and stream each answer; returns one Record per
    sample (numbered by `indexes`, default 0, 1, ...) and the duration (start to the last
    stream's end)."""
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(samples), desc=tag, unit="req", leave=False, mininterval=0.5)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    indexes = range(len(samples)) if indexes is None else indexes
    records = [
        Record(i, s.output_len, offsets[k], prompt_len=s.prompt_len)
        for k, (i, s) in enumerate(zip(indexes, samples, strict=True))
    ]
    f = args.disconnect_fraction
    for rec in records:  # evenly spread: request i leaves when floor(i * f) steps up
        if int((rec.index + 1) * f) > int(rec.index * f):
            rec.disconnect_after = args.disconnect_after
    async with open_session(client, max_concurrency) as post_lines:
        start = time.monotonic() if start_at is None else start_at

        async def consume(rec: Record, body: dict) -> None:
            reader = _StreamReader(rec)
            try:
                async with contextlib.aclosing(post_lines(url, body)) as lines:
                    async for raw in lines:
                        reader.line(raw, time.monotonic() - start)
                        if rec.disconnected:  # closing the response drops the connection
                            return
            except Exception as e:  # refused, reset, HTTP error, bad JSON
                rec.error = rec.error or f"{type(e).__name__}: {e}"[:300]
            finally:
                rec.end_s = time.monotonic() - start
                reader.finish()

        async def one(rec: Record, body: dict) -> None:
            # Again while early: uvloop's timers have millisecond resolution and may fire early.
            while (wait := start + rec.scheduled_s - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            async with sem or contextlib.nullcontext():
                rec.sent_s = time.monotonic() - start
                try:
                    await asyncio.wait_for(consume(rec, body), args.request_timeout)
                except asyncio.TimeoutError:
                    rec.error = f"timed out after {args.request_timeout:g} s"
            if bar is not None:
                bar.update(1)

        await asyncio.gather(
            *(
                one(r, completion_body(model, s, args))
                for r, s in zip(records, samples, strict=True)
            )
        )
        duration = time.monotonic() - start
    if bar is not None:
        bar.close()
    return records, duration


def http_get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def served_model(base_url: str) -> str:
    try:
        return http_get_json(base_url + "/v1/models")["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"no model from {base_url}/v1/models ({e}); is the server up?") from None


# ----------------------------------------------------------------------------- the server


def _unparse(value: Any) -> str:
    """A parsed value of an engine flag back as its text (--kernel, --kernel-tile items too)."""
    if isinstance(value, tuple):
        if len(value) == 2:
            return f"{value[0]}={value[1]}"
        return f"{value[0]}.{value[1]}={value[2]}"
    return str(value)


def server_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags (and --seed) of `args` as `python -m rosejax.serve` arguments."""
    p = argparse.ArgumentParser(add_help=False)
    common.add_engine_args(p)
    out: list[str] = []
    for action in p._actions:
        value = getattr(args, action.dest, None)
        if value is None or value is False or value == []:
            continue
        flag = action.option_strings[0]
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            for item in value:
                out += [flag, _unparse(item)]
        else:
            out += [flag, _unparse(value)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def programs_to_compile(base_url: str) -> int:
    """The server's rosejax_programs_to_compile gauge, summed over its replicas (0 if it has
    none or does not answer)."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
    except OSError:
        return 0
    name = "rosejax_programs_to_compile"
    return sum(int(float(x.split()[-1])) for x in lines if x.startswith((name + " ", name + "{")))


class LaunchedServer:
    """`python -m rosejax.serve` in a subprocess on a free loopback port, up once /health is."""

    def __init__(self, args: argparse.Namespace):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "rosejax.serve",
            *server_argv(args),
            *(["--served-model-name", args.served_model_name] if args.served_model_name else []),
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            "--no-access-log",
            *shlex.split(args.server_args),
        ]
        self.timeout = args.launch_timeout
        if args.server_log:
            self.log_path = args.server_log
        else:
            fd, self.log_path = tempfile.mkstemp(prefix="rosejax-serve-", suffix=".log")
            os.close(fd)
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self.wait_compiled = not args.no_wait_compiled
        self.compiled_seconds: float | None = None

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def __enter__(self) -> LaunchedServer:
        print(f"launching: {shlex.join(self.cmd)} (log {self.log_path})", file=sys.stderr)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [common.REPO, env.get("PYTHONPATH")]))
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO, env=env
            )
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if http_get_json(self.url + "/health", timeout=2).get("status") == "ok":
                    break
            except (OSError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(
                    f"the server did not come up in {self.timeout:.0f} s "
                    f"(exit {self.proc.returncode}); its log's end:\n{self.log_tail()}"
                )
            time.sleep(0.25)
        self.start_seconds = time.perf_counter() - t0
        print(f"server up at {self.url} in {self.start_seconds:.1f} s", file=sys.stderr)
        if self.wait_compiled:
            while programs_to_compile(self.url) and time.monotonic() < deadline:
                time.sleep(0.25)
            self.compiled_seconds = time.perf_counter() - t0
            print(
                f"every program compiled {self.compiled_seconds:.1f} s after launch",
                file=sys.stderr,
            )
        return self

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def __exit__(self, *exc) -> None:
        rc = self.stop()
        if rc not in (0, None):
            print(f"the server exited {rc}; its log's end:\n{self.log_tail()}", file=sys.stderr)


# ----------------------------------------------------------------------- in-process side


def records_from_traces(
    traces: Sequence[m.RequestTrace], samples: Sequence[Sample], offsets: Sequence[float]
) -> tuple[list[Record], float]:
    """bench/common.run_workload's traces as Records (token deliveries as events, exact counts);
    the start is the first request's submit time (it is due at 0 and never waits for a slot)."""
    start = min(t.submit_time - o for t, o in zip(traces, offsets, strict=True))
    records = []
    for i, (t, s) in enumerate(zip(traces, samples, strict=True)):
        groups = [(when, len(list(g))) for when, g in itertools.groupby(t.token_times)]
        records.append(
            Record(
                index=i,
                expected_output_len=s.output_len,
                scheduled_s=offsets[i],
                prompt_len=t.prompt_tokens,
                sent_s=t.submit_time - start,
                event_s=[when - start for when, _ in groups],
                event_tokens=[k for _, k in groups],
                output_tokens=t.num_tokens,
                end_s=(t.finish_time - start) if t.token_times else None,
                error=None if t.finish_reason else "unfinished",
            )
        )
    return records, max((r.end_s or 0.0) for r in records)


def run_in_process(
    args: argparse.Namespace,
    samples: Sequence[Sample],
    offsets: Sequence[float],
    warmups: Sequence[Sequence[Sample]],
) -> tuple[list[Record], float, dict[str, Any]]:
    """The workload through LLMEngine stepping in this process (bench/common.run_workload)."""
    from rosejax.sampling import SamplingParams
    from rosejax.settings import configure_process

    configure_process(args.compilation_cache_dir)  # before the backend starts
    engine, build_s = common.make_engine(args)
    env = common.environment(engine)
    print(
        f"in-process engine: {args.model} {env['dtype']} on {env.get('device')}, max batch "
        f"{engine.max_batch_size}; built in {build_s:.1f} s",
        file=sys.stderr,
    )

    def run(ss: Sequence[Sample], tag: str):
        params = [
            SamplingParams(
                max_tokens=s.output_len,
                temperature=args.temperature,
                ignore_eos=True,
                logprobs=args.logprobs,
            )
            for s in ss
        ]
        return common.run_workload(
            engine,
            [s.prompt for s in ss],
            params,
            offsets,
            tag=tag,
            progress=not args.no_progress,
            max_concurrency=args.max_concurrency,
        )

    for r, ws in enumerate(warmups):
        run(ws, f"in-process warm-up {r}")
    compiles = engine.num_compiles
    traces, steps = run(samples, "in-process")
    records, duration = records_from_traces(traces, samples, offsets)
    view = m.summarize(traces, steps)
    info = {
        "environment": env,
        "build_seconds": build_s,
        "compiles_in_timed_run": engine.num_compiles - compiles,
        "decode_throughput_tok_s": view["decode_throughput_tok_s"],
        "steps": view["steps"],
    }
    return records, duration, info


# --------------------------------------------------------------------------------- report

ROWS = [  # (label, key, format)
    ("Successful requests", "completed", ",d"),
    ("Failed requests", "failed", ",d"),
    ("Disconnected requests", "disconnected", ",d"),
    ("Benchmark duration (s)", "duration_s", ",.3f"),
    ("Total input tokens", "total_input_tokens", ",d"),
    ("Total generated tokens", "total_output_tokens", ",d"),
    ("Request throughput (req/s)", "request_throughput", ",.2f"),
    ("Output token throughput (tok/s)", "output_throughput", ",.1f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ",.1f"),
]
SECTIONS = [  # (title, key, short name)
    ("Time to First Token", "ttft_ms", "TTFT"),
    ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
    ("Inter-token Latency", "itl_ms", "ITL"),
    ("End-to-end Latency", "e2el_ms", "E2EL"),
    ("Gap between streamed events", "event_gap_ms", "event gap"),
]


def _pkey(p: float) -> str:
    return "p" + (str(int(p)) if float(p).is_integer() else str(p).replace(".", "_"))


def format_table(results: dict[str, dict], percentiles: Sequence[float]) -> str:
    """vLLM's result table, one column per result (e.g. HTTP, in-process), and their ratio
    (first / second) when there are two."""
    labels = list(results)
    ratio = len(labels) == 2
    width = 46
    head = f"{'':<{width}}" + "".join(f"{x:>14}" for x in labels) + ("   ratio" if ratio else "")

    def fmt(v, f) -> str:
        return f"{'n/a':>14}" if v is None else f"{format(v, f):>14}"

    def row(label: str, values: list, f: str) -> str:
        line = f"{label + ':':<{width}}" + "".join(fmt(v, f) for v in values)
        if ratio and all(isinstance(v, (int, float)) for v in values) and values[1]:
            line += f"{values[0] / values[1]:8.3f}"
        return line

    rule = "=" * len(head)
    lines = [" Serving Benchmark Result ".center(len(head), "="), head]
    res = list(results.values())
    for label, key, f in ROWS:
        lines.append(row(label, [r[key] for r in res], f))
    if "goodput" in res[0]:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in res[0]["goodput"]["slo_ms"].items())
        lines.append(row("Good requests", [r["goodput"]["good_requests"] for r in res], ",d"))
        lines.append(
            row("Request goodput (req/s)", [r["goodput"]["request_goodput"] for r in res], ",.2f")
        )
        lines.append(f"  (SLOs: {slos})")
    for title, key, short in SECTIONS:
        lines.append(f" {title} ".center(len(head), "-"))
        lines.append(row(f"Mean {short} (ms)", [r[key]["mean"] for r in res], ",.2f"))
        lines.append(row(f"Median {short} (ms)", [r[key]["p50"] for r in res], ",.2f"))
        for p in percentiles:
            if p != 50:
                lines.append(row(f"P{p:g} {short} (ms)", [r[key][_pkey(p)] for r in res], ",.2f"))
    lines.append(row("Max event gap (ms)", [r["event_gap_max_ms"] for r in res], ",.2f"))
    lines.append(
        row("Tokens per streamed event (mean)", [r["tokens_per_event"] for r in res], ",.2f")
    )
    lines.append(rule)
    return "\n".join(lines)


def compare(http: dict, local: dict) -> dict[str, Any]:
    """HTTP / in-process for issue 17's two figures, and whether each meets its bound."""
    tput = http["output_throughput"] / local["output_throughput"]
    a, b = http["ttft_ms"]["p50"], local["ttft_ms"]["p50"]
    ttft = a / b if a is not None and b else None
    return {
        "output_throughput_ratio": tput,
        "ttft_p50_ratio": ttft,
        "throughput_at_least_90pct": tput >= 0.9,
        "ttft_p50_within_2x": ttft is not None and ttft <= 2.0,
    }


def series_of(records: Sequence[Record]) -> dict[str, list]:
    return {
        "ttft_ms": [r.ttft() * 1e3 for r in records if r.ok],
        "itl_ms": [x * 1e3 for r in records for x in r.itls()],
    }


def plot_timeline(path: str, runs: dict[str, Sequence[Record]], title: str) -> None:
    """Per request TTFT and E2EL against send time, and output tokens/s over the run."""
    plt = common.load_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, records in runs.items():
        ok = [r for r in records if r.ok]
        if not ok:
            continue
        sent = [r.sent_s for r in ok]
        axes[0].scatter(sent, [r.ttft() * 1e3 for r in ok], s=8, label=f"{label} TTFT")
        axes[0].scatter(sent, [r.e2el() * 1e3 for r in ok], s=8, marker="x", label=f"{label} E2EL")
        times = [t for r in ok for t in r.event_s]
        weights = [k for r in ok for k in r.counts]
        end = max(r.end_s for r in ok)
        bins = np.linspace(0.0, end, min(100, max(10, len(times) // 20)) + 1)
        hist, edges = np.histogram(times, bins=bins, weights=weights)
        axes[1].step(edges[:-1], hist / np.diff(edges), where="post", label=label)
    axes[0].set(xlabel="sent at (s)", ylabel="ms", title="latency per request")
    axes[1].set(xlabel="time (s)", ylabel="output tokens / s", title="output throughput")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


# ----------------------------------------------------------------------------------- main


def workload(args: argparse.Namespace) -> list[Sample]:
    if args.dataset == "jsonl":
        return jsonl_dataset(args.dataset_path, args.num_prompts, args.output_len)
    return random_dataset(args, args.seed)


def _import_client(client: str) -> None:
    importlib.import_module(client)
    if importlib.util.find_spec("uvloop"):
        importlib.import_module("uvloop")


def _client_process(
    url: str,
    model: str,
    samples: list[Sample],
    offsets: list[float],
    indexes: list[int],
    args: argparse.Namespace,
    client: str,
    start_at: float,
    max_concurrency: int | None,
) -> tuple[list[Record], float]:
    return run_client(
        run_http(url, model, samples, offsets, args, client, "", indexes, start_at, max_concurrency)
    )


class Clients:
    """Runs workloads against one server's /v1/completions: in this process, or with request i
    in client process i mod --client-processes, all timed from one instant (CLOCK_MONOTONIC is
    the machine's, not a process's) and --max-concurrency shared out among them."""

    def __init__(self, args: argparse.Namespace, url: str, model: str, client: str):
        self.args, self.endpoint, self.model, self.client = (
            args,
            url + "/v1/completions",
            model,
            client,
        )
        self.processes = min(args.client_processes, args.max_concurrency or args.client_processes)
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None

    def __enter__(self) -> Clients:
        if self.processes > 1 or self.args.client_nice:
            ctx = multiprocessing.get_context("spawn")  # never fork a process that may run jax
            self.pool = concurrent.futures.ProcessPoolExecutor(
                self.processes,
                mp_context=ctx,
                initializer=os.nice,
                initargs=(self.args.client_nice,),
            )
            # Each process started and its client imported before any clock starts.
            for f in [self.pool.submit(_import_client, self.client) for _ in range(self.processes)]:
                f.result()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def run(
        self, samples: Sequence[Sample], offsets: Sequence[float], tag: str
    ) -> tuple[list[Record], float]:
        """One Record per sample, and the duration (start to the last stream's end)."""
        args, n = self.args, min(self.processes, len(samples))
        if self.pool is None:
            return run_client(
                run_http(
                    self.endpoint,
                    self.model,
                    samples,
                    offsets,
                    args,
                    self.client,
                    tag,
                    max_concurrency=args.max_concurrency,
                )
            )
        quiet = argparse.Namespace(**vars(args) | {"no_progress": True})
        start_at = time.monotonic() + 0.2  # every process waiting when it comes
        futures = []
        for k in range(n):
            idx = list(range(k, len(samples), n))
            limit = None
            if args.max_concurrency:
                limit = args.max_concurrency // n + (k < args.max_concurrency % n)
            part = ([samples[i] for i in idx], [offsets[i] for i in idx], idx)
            job = (self.endpoint, self.model, *part, quiet, self.client, start_at, limit)
            futures.append(self.pool.submit(_client_process, *job))
        parts = [f.result() for f in futures]
        records = sorted((r for recs, _ in parts for r in recs), key=lambda r: r.index)
        return records, max(d for _, d in parts)


def run_http_side(
    args: argparse.Namespace,
    url: str,
    samples: list[Sample],
    offsets: list[float],
    warmups: list[list[Sample]],
    client: str,
) -> tuple[list[Record], float, str]:
    model = args.served_model_name or served_model(url)
    with Clients(args, url, model, client) as clients:
        for r, ws in enumerate(warmups):
            recs, _ = clients.run(ws, offsets, f"warm-up {r}")
            bad = [x.error for x in recs if not x.ok and not x.disconnected]
            if bad:
                print(f"warm-up {r}: {len(bad)} requests failed, e.g. {bad[0]}", file=sys.stderr)
        records, duration = clients.run(samples, offsets, "http")
    return records, duration, model


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(common.glue_flag_values(argv, ["--server-args"]))
    check_args(p, args)
    samples = workload(args)
    offsets = arrival_offsets(len(samples), args.request_rate, args.burstiness, args.seed)
    warmups = [warmup_samples(samples, r, args) for r in range(args.warmup_runs)]
    client = pick_client(args.client)
    slos = dict(args.goodput) if args.goodput else None
    config: dict[str, Any] = {
        "dataset": args.dataset,
        "num_prompts": len(samples),
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "client": f"{client_version(client)} on {client_loop()}",
        "client_processes": args.client_processes,
        "launched": args.launch,
    }

    if args.launch:
        with LaunchedServer(args) as server:
            config.update(
                server_cmd=server.cmd,
                server_start_seconds=server.start_seconds,
                server_compiled_seconds=server.compiled_seconds,
            )
            records, duration, model = run_http_side(
                args, server.url, samples, offsets, warmups, client
            )
        config["base_url"] = server.url
    else:
        records, duration, model = run_http_side(
            args, args.base_url, samples, offsets, warmups, client
        )
        config["base_url"] = args.base_url
    config["model"] = model
    summaries = {"HTTP": summarize(records, duration, args.percentiles, slos)}
    detailed = {"http": records}

    result: dict[str, Any] = {"benchmark": "serving", "config": config}
    if args.in_process:
        local, local_duration, info = run_in_process(args, samples, offsets, warmups)
        summaries["in-process"] = summarize(local, local_duration, args.percentiles, slos)
        detailed["in_process"] = local
        result["in_process_engine"] = info
    else:
        info = None
    print(format_table(summaries, args.percentiles))
    for label, s in summaries.items():
        for err in s["errors"]:
            print(f"{label} error: {err}")
        if s["output_len_mismatches"]:
            print(f"{label}: {s['output_len_mismatches']} requests got another output length")
    if summaries["HTTP"]["completed"] and summaries["HTTP"]["itl_token_counts"] != "exact":
        print(
            "HTTP ITL: tokens per event not streamed; the first event counts 1, the rest share "
            "the others evenly"
        )
    if args.in_process:
        cmp = compare(summaries["HTTP"], summaries["in-process"])
        result["comparison"] = cmp
        ttft = "n/a" if cmp["ttft_p50_ratio"] is None else f"{cmp['ttft_p50_ratio']:.3f}"
        print(
            f"HTTP / in-process: output throughput {cmp['output_throughput_ratio']:.3f} "
            f"(issue 17: >= 0.90: {'yes' if cmp['throughput_at_least_90pct'] else 'NO'}), "
            f"TTFT p50 {ttft} (<= 2: {'yes' if cmp['ttft_p50_within_2x'] else 'NO'})"
        )

    def finite(v):  # inf is no JSON number
        return "inf" if isinstance(v, float) and math.isinf(v) else v

    config["request_rate"] = finite(config["request_rate"])
    result.update(
        args={k: finite(v) for k, v in vars(args).items()},
        environment=info["environment"] if info else common.environment(),
        results={k.lower().replace("-", "_"): v for k, v in summaries.items()},
    )
    if args.save_detailed:
        result["requests"] = {k: [r.as_json() for r in v] for k, v in detailed.items()}
    common.write_json(args.json, result)
    if args.plot:
        runs = dict(zip(summaries, detailed.values(), strict=True))
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
        title = (
            f"rosejax serving: {len(samples)} requests at {rate}, {model}, "
            f"{config['client']}, {result['environment'].get('device', 'device n/a')}"
        )
        common.plot_distributions(args.plot, {k: series_of(v) for k, v in runs.items()}, title)
        stem, _ = os.path.splitext(args.plot)
        plot_timeline(stem + ".timeline.png", runs, title)
    return 0 if all(s["completed"] for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
