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

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.serving.flags import build_parser, check_args  # noqa: E402
from bench.serving.http_client import (  # noqa: E402
    client_loop,
    client_version,
    pick_client,
    run_http_side,
    ttft_parts,
)
from bench.serving.in_process import run_in_process  # noqa: E402
from bench.serving.launch import LaunchedServer  # noqa: E402
from bench.serving.records import summarize  # noqa: E402
from bench.serving.report import compare, format_table, plot_timeline, series_of  # noqa: E402
from bench.serving.workload import timed_workload  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser(__doc__)
    args = p.parse_args(common.glue_flag_values(argv, ["--server-args"]))
    check_args(p, args)
    samples, offsets, warmups = timed_workload(args)
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
            records, duration, model, counts = run_http_side(
                args, server.url, samples, offsets, warmups, client
            )
        config["base_url"] = server.url
    else:
        records, duration, model, counts = run_http_side(
            args, args.base_url, samples, offsets, warmups, client
        )
        config["base_url"] = args.base_url
    config["model"] = model
    summaries = {"HTTP": summarize(records, duration, args.percentiles, slos) | counts}
    detailed = {"http": records}

    result: dict[str, Any] = {"benchmark": "serving", "config": config}
    if args.in_process:
        ((local, local_duration),), info = run_in_process(args, samples, offsets, warmups)
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
    if counts:
        print(
            f"HTTP: the engine ran {counts['prefill_steps']} prefill steps and preempted "
            f"{counts['preemptions']} requests in the timed run"
        )
    if "back_ms" in counts:
        print(f"HTTP: the server's TTFT, mean ms a request: {ttft_parts(counts)}")
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
