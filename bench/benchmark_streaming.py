"""Streaming benchmark: requests arrive (all at once or on a schedule) and tokens are taken as
they reach the host, step by step, as a streaming client would see them.

Reports per run: prompt and completion token totals, TTFT / TPOT / ITL / end-to-end latency
(p50, p95, p99), throughput (completion tokens / (last finish - first submit)) and the decode
roofline (bytes the decode steps must read, weights + KV attended, over their time: GB/s, % of
--bandwidth-gbs, FLOPs per step; mean running batch and context from the traces); then a summary
over the runs. Definitions: bench/metrics.py. The engine is single-threaded: before each
`step()` the loop adds every request whose submit time has passed (--submit-interval-ms).

    # the seed's workloads (GPT-2 124M shape, random weights, fp16 on GPU, EOS off)
    python bench/benchmark_streaming.py --num-requests 256 --max-new-tokens 256 \
        --max-batch-size 16 --no-stop-on-eos
    python bench/benchmark_streaming.py --num-requests 128 --prompt-repeats 1,4 \
        --max-new-tokens 128 --max-batch-size 128 --no-stop-on-eos
    # CPU smoke test
    python bench/benchmark_streaming.py --model random:tiny --num-requests 4 \
        --max-new-tokens 8 --no-warmup --warmup-runs 0 --repeat-runs 1
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from bench import common  # noqa: E402
from rosejax.engine_args import sampling_params  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = common.new_parser(__doc__)
    common.add_engine_args(p, max_batch_size=16)
    p.add_argument("--prompt", default="Hello", help="the prompt text")
    p.add_argument(
        "--prompt-repeats",
        type=common.ints,
        default=[1],
        metavar="R1,R2,...",
        help="request i's prompt is --prompt repeated R[i mod len] times, joined by "
        "spaces (e.g. 1,4 alternates 1 and 4 copies)",
    )
    p.add_argument(
        "--unique-prompts",
        action="store_true",
        help="make every prompt distinct with a '<run>-<i> ' prefix (so no two "
        "requests, in this run or another, share a prefix-cache block)",
    )
    p.add_argument(
        "--pretok",
        action="store_true",
        help="tokenize the prompts before the timed loop and submit token ids "
        "(else add_request tokenizes, inside the timed loop)",
    )
    p.add_argument(
        "--submit-interval-ms",
        type=float,
        default=0.0,
        help="request i is due at i x this many ms after the run starts; 0 = all at once",
    )
    common.add_workload_args(p)
    return p


def make_prompts(args: argparse.Namespace, run: int, tokenizer=None) -> list:
    prompts = []
    for i in range(args.num_requests):
        reps = args.prompt_repeats[i % len(args.prompt_repeats)]
        text = " ".join([args.prompt] * reps)
        if args.unique_prompts:
            text = f"{run}-{i} {text}"
        prompts.append(tokenizer.encode(text) if args.pretok else text)
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_requests < 1 or args.max_new_tokens < 1 or args.repeat_runs < 1:
        raise SystemExit("--num-requests, --max-new-tokens and --repeat-runs must be >= 1")
    engine, result = common.start(args, "streaming")
    params = sampling_params(args)
    offsets = [i * args.submit_interval_ms / 1e3 for i in range(args.num_requests)]

    runs = common.run_repeated(
        engine, args, lambda run: make_prompts(args, run, engine.tokenizer), params, offsets
    )
    return common.finish(
        args,
        engine,
        result,
        runs,
        "streaming",
        [
            ("itl_ms.p50", "ITL p50 ms"),
            ("itl_ms.p99", "ITL p99 ms"),
            ("e2e_ms.p50", "e2e p50 ms"),
            ("e2e_ms.p99", "e2e p99 ms"),
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
