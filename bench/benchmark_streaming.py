"""Streaming benchmark: requests arrive (all at once or on a schedule) and tokens are taken as
they reach the host, step by step, as a streaming client would see them.

Reports per run: prompt and completion token totals, TTFT / TPOT / ITL / end-to-end latency
(p50, p95, p99) and throughput (completion tokens / (last finish - first submit)); then a summary
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
from bench import metrics as m  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    common.add_engine_args(p, max_batch_size=16)
    p.add_argument("--prompt", default="Hello", help="the prompt text")
    p.add_argument("--prompt-repeats", type=common.ints, default=[1], metavar="R1,R2,...",
                   help="request i's prompt is --prompt repeated R[i mod len] times, joined by "
                        "spaces (e.g. 1,4 alternates 1 and 4 copies)")
    p.add_argument("--unique-prompts", action="store_true",
                   help="make every prompt distinct with a '<run>-<i> ' prefix (so no two "
                        "requests, in this run or another, share a prefix-cache block)")
    p.add_argument("--pretok", action="store_true",
                   help="tokenize the prompts before the timed loop and submit token ids "
                        "(else add_request tokenizes, inside the timed loop)")
    p.add_argument("--num-requests", type=int, default=256, help="requests per run")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="tokens to generate per request at most (exactly, with "
                        "--no-stop-on-eos)")
    p.add_argument("--submit-interval-ms", type=float, default=0.0,
                   help="request i is due at i x this many ms after the run starts; 0 = all "
                        "at once")
    common.add_sampling_args(p)
    common.add_run_args(p, warmup_runs=1, repeat_runs=3)
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
    engine, build_s = common.make_engine(args)
    env = common.environment(engine)
    print(f"engine: {args.model} {env['dtype']} on {env.get('device')} (jax {env.get('jax')}), "
          f"max batch {engine.max_batch_size}, decode_steps {env['decode_steps']}; built in "
          f"{build_s:.1f} s ({engine.compile_seconds:.1f} s warm-up compile, "
          f"{engine.num_compiles} traces)", file=sys.stderr)
    params = common.sampling_params(args, args.max_new_tokens)
    offsets = [i * args.submit_interval_ms / 1e3 for i in range(args.num_requests)]
    result: dict = {
        "benchmark": "streaming", "args": vars(args), "environment": env,
        "engine": {"build_seconds": build_s, "warmup_compile_seconds": engine.compile_seconds,
                   "num_compiles_after_build": engine.num_compiles},
        "warmup_runs": [], "runs": [],
    }  # fmt: skip
    series = {}
    total = args.warmup_runs + args.repeat_runs
    for run in range(total):
        warm = run < args.warmup_runs
        tag = f"warmup{run}" if warm else f"run{run - args.warmup_runs}"
        prompts = make_prompts(args, run, engine.tokenizer)
        compiles = engine.num_compiles
        traces, steps = common.run_workload(
            engine, prompts, params, offsets, tag=tag, progress=not args.no_progress
        )
        summary = m.summarize(traces, steps)
        summary["new_compiles"] = engine.num_compiles - compiles
        print(m.format_summary(summary, f"[{tag}]" + (" (warm-up, not counted)" if warm else "")),
              file=sys.stderr if warm else sys.stdout)
        if summary["new_compiles"] and not warm:
            print(f"  note: {summary['new_compiles']} compiles inside this timed run",
                  file=sys.stdout)
        entry = {"tag": tag, "summary": summary}
        if warm:
            result["warmup_runs"].append(entry)
            continue
        entry["requests"] = common.trace_lists(traces)
        result["runs"].append(entry)
        series[tag] = {"ttft_ms": entry["requests"]["ttft_ms"],
                       "itl_ms": [g * 1e3 for t in traces for g in m.itl(t)]}
    result["summary"] = m.summarize_runs([r["summary"] for r in result["runs"]])
    result["engine"]["num_compiles_at_end"] = engine.num_compiles
    _print_summary(result["summary"], len(result["runs"]))
    common.write_json(args.json, result)
    if args.plot:
        common.plot_distributions(
            args.plot, series,
            f"rosejax streaming: {args.num_requests} requests, {args.max_new_tokens} new, "
            f"max batch {args.max_batch_size}, {env.get('device')}",
        )  # fmt: skip
    return 0


def _print_summary(summary: dict, n: int) -> None:
    print(f"summary over {n} timed run(s): mean [min, max]")
    for key, label in [
        ("throughput_tok_s", "throughput tok/s"),
        ("decode_throughput_tok_s", "decode-only tok/s"),
        ("ttft_ms.p50", "TTFT p50 ms"), ("ttft_ms.p99", "TTFT p99 ms"),
        ("tpot_ms.p50", "TPOT p50 ms"), ("tpot_ms.p99", "TPOT p99 ms"),
        ("itl_ms.p50", "ITL p50 ms"), ("itl_ms.p99", "ITL p99 ms"),
        ("e2e_ms.p50", "e2e p50 ms"), ("e2e_ms.p99", "e2e p99 ms"),
    ]:  # fmt: skip
        s = summary.get(key)
        if s:
            print(f"  {label:<18} {s['mean']:12,.2f}  [{s['min']:,.2f}, {s['max']:,.2f}]")


if __name__ == "__main__":
    sys.exit(main())
