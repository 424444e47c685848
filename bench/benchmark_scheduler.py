"""Scheduler benchmark: end-to-end and decode-only throughput, TTFT and TPOT of a batch workload.

--mode offline: every request is submitted at once (vLLM's benchmark_throughput); nothing is
streamed to a client, though tokens are still timed per step (the engine's only interface).
--mode online: requests arrive as a Poisson process of --request-rate requests per second (a
fixed seed, so every run sees the same arrival times); the loop adds each when it is due.

Decode-only throughput counts only the tokens of steps that decode (no prefill) over the time
inside those steps; in offline mode with every request in one wave (num-requests <= max batch)
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
from bench import metrics as m  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--mode", choices=["offline", "online"], default="offline",
                   help="offline: all requests at once; online: Poisson arrivals at "
                        "--request-rate")
    p.add_argument("--request-rate", type=float, default=8.0,
                   help="online mode: mean requests per second (Poisson arrivals)")
    common.add_engine_args(p, max_batch_size=256)
    p.add_argument("--num-requests", type=int, default=256, help="requests per run")
    p.add_argument("--input-len", type=int, default=8,
                   help="prompt length in tokens: random token ids (seeded, distinct per "
                        "request and run, so the prefix cache shares nothing)")
    p.add_argument("--prompt", default=None,
                   help="use this text as every prompt instead of random ids of --input-len")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="tokens to generate per request at most (exactly, with "
                        "--no-stop-on-eos)")
    common.add_sampling_args(p)
    common.add_run_args(p, warmup_runs=1, repeat_runs=3)
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
    engine, build_s = common.make_engine(args)
    env = common.environment(engine)
    cfg = engine.config
    print(f"engine: {args.model} {env['dtype']} on {env.get('device')} (jax {env.get('jax')}), "
          f"max batch {engine.max_batch_size}, decode_steps {env['decode_steps']}; built in "
          f"{build_s:.1f} s ({engine.compile_seconds:.1f} s warm-up compile)", file=sys.stderr)
    params = common.sampling_params(args, args.max_new_tokens)
    offsets = (poisson_offsets(args.num_requests, args.request_rate, args.seed)
               if args.mode == "online" else None)
    one_wave = args.mode == "offline" and args.num_requests <= engine.max_batch_size
    result: dict = {
        "benchmark": "scheduler", "mode": args.mode, "args": vars(args), "environment": env,
        "engine": {"build_seconds": build_s, "warmup_compile_seconds": engine.compile_seconds,
                   "num_compiles_after_build": engine.num_compiles},
        "warmup_runs": [], "runs": [],
    }  # fmt: skip
    series = {}
    for run in range(args.warmup_runs + args.repeat_runs):
        warm = run < args.warmup_runs
        tag = f"warmup{run}" if warm else f"run{run - args.warmup_runs}"
        if args.prompt is not None:
            prompts = [args.prompt] * args.num_requests
        else:
            prompts = random_prompts(args.num_requests, args.input_len, cfg.vocab_size,
                                     seed=args.seed * 1000 + run)
        compiles = engine.num_compiles
        traces, steps = common.run_workload(engine, prompts, params, offsets, tag=tag,
                                            progress=not args.no_progress)
        summary = m.summarize(traces, steps)
        summary["new_compiles"] = engine.num_compiles - compiles
        full = all(t.num_tokens == args.max_new_tokens for t in traces)
        lens = {t.prompt_tokens for t in traces}
        if one_wave and full and len(lens) == 1 and args.max_new_tokens > 1:
            summary["roofline"] = m.decode_run_roofline(
                cfg, args.num_requests, lens.pop(), args.max_new_tokens,
                summary["decode_time_s"], args.bandwidth_gbs,
                dtype_bytes=np.dtype(engine.dtype).itemsize,
            )  # fmt: skip
        out = sys.stderr if warm else sys.stdout
        print(m.format_summary(summary, f"[{tag}]" + (" (warm-up, not counted)" if warm else "")),
              file=out)
        if "roofline" in summary:
            print(_format_roofline(summary["roofline"]), file=out)
        if summary["new_compiles"] and not warm:
            print(f"  note: {summary['new_compiles']} compiles inside this timed run")
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
    print(f"summary over {len(result['runs'])} timed run(s): mean [min, max]")
    for key, label in [
        ("throughput_tok_s", "end-to-end tok/s"), ("decode_throughput_tok_s", "decode-only tok/s"),
        ("ttft_ms.p50", "TTFT p50 ms"), ("ttft_ms.p99", "TTFT p99 ms"),
        ("tpot_ms.p50", "TPOT p50 ms"), ("tpot_ms.p99", "TPOT p99 ms"),
        ("roofline.step_seconds", "decode step s"), ("roofline.achieved_gbs", "decode GB/s"),
    ]:  # fmt: skip
        s = result["summary"].get(key)
        if s:
            print(f"  {label:<18} {s['mean']:12,.4g}  [{s['min']:,.4g}, {s['max']:,.4g}]")
    common.write_json(args.json, result)
    if args.plot:
        common.plot_distributions(
            args.plot, series,
            f"rosejax {args.mode}: {args.num_requests} requests, {args.max_new_tokens} new, "
            f"max batch {args.max_batch_size}, {env.get('device')}",
        )  # fmt: skip
    return 0


def _format_roofline(r: dict) -> str:
    line = (f"  decode roofline: {r['decode_steps']} steps of {r['step_seconds'] * 1e3:.3f} ms, "
            f"{r['bytes'] / 1e9:.3f} GB/step at mean context {r['mean_context']:.0f} -> "
            f"{r['achieved_gbs']:,.0f} GB/s, {r['achieved_tflops']:.2f} TFLOP/s")
    if r.get("pct_of_bandwidth") is not None:
        line += (f" ({r['pct_of_bandwidth']:.0f}% of {r['bandwidth_gbs']:,.0f} GB/s; floor "
                 f"{r['floor_seconds'] * 1e3:.3f} ms/step, {r['tokens_per_s_ceiling']:,.0f} tok/s)")
    return line


if __name__ == "__main__":
    sys.exit(main())
