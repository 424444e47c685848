"""Scheduler benchmark: end-to-end and decode-only throughput, TTFT and TPOT of a batch workload.

--mode offline: every request is submitted at once (vLLM's benchmark_throughput); nothing is
streamed to a client, though tokens are still timed per step (the engine's only interface).
--mode online: requests arrive as a Poisson process of --request-rate requests per second (a
fixed seed, so every run sees the same arrival times); the loop adds each when it is due.

Decode-only throughput counts only the tokens of steps that decode (no prefill) over those
steps' time, each from the previous step's end (its window ran on the device from there); in
offline mode with every request in one wave (num-requests <= max batch)
it also gives the decode roofline: bytes a step must read (weights + the KV attended) over the
measured step time. Definitions: bench/metrics.py.

    # 256 requests of 8 random tokens, 256 new each, batch 256 (GPT-2 124M shape, fp16 on GPU)
    python bench/benchmark_scheduler.py --num-requests 256 --input-len 8 --max-new-tokens 256 \
        --max-batch-size 256 --no-stop-on-eos --bandwidth-gbs 4000
    # online: 8 requests per second
    python bench/benchmark_scheduler.py --mode online --request-rate 8 --num-requests 128
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from rosejax.engine_args import sampling_params  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = common.new_parser(__doc__)
    p.add_argument(
        "--mode",
        choices=["offline", "online"],
        default="offline",
        help="offline: all requests at once; online: Poisson arrivals at --request-rate",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=8.0,
        help="online mode: mean requests per second (Poisson arrivals)",
    )
    common.add_engine_args(p, max_batch_size=256)
    p.add_argument(
        "--input-len",
        type=int,
        default=8,
        help="prompt length in tokens: random token ids (seeded, distinct per "
        "request and run, so the prefix cache shares nothing)",
    )
    p.add_argument(
        "--prompt",
        default=None,
        help="use this text as every prompt instead of random ids of --input-len",
    )
    common.add_workload_args(p)
    return p


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random token ids (EOS, the last id, never drawn)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size - 1, size=(n, length)).tolist()


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate` per second; the first at 0."""
    if rate <= 0 or np.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_requests < 1 or args.max_new_tokens < 1 or args.repeat_runs < 1:
        raise SystemExit("--num-requests, --max-new-tokens and --repeat-runs must be >= 1")
    engine, result = common.start(args, "scheduler", mode=args.mode)
    cfg = engine.config
    params = sampling_params(args)
    offsets = (
        poisson_offsets(args.num_requests, args.request_rate, args.seed)
        if args.mode == "online"
        else None
    )

    def make_prompts(run: int) -> list:
        if args.prompt is not None:
            return [args.prompt] * args.num_requests
        return random_prompts(
            args.num_requests, args.input_len, cfg.vocab_size, seed=args.seed * 1000 + run
        )

    runs = common.run_repeated(engine, args, make_prompts, params, offsets)
    return common.finish(args, engine, result, runs, args.mode)


if __name__ == "__main__":
    sys.exit(main())
