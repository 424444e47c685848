"""Data parallelism's gain: one workload on one replica (one device) and on --data-parallel-size
replicas behind the router, over HTTP (the server: `python -m rosejax.serve` launched with
--data-parallel-size 1, then N) and in process (the engine `LLM` drives: `make_engine`'s engine
of N replicas, each in an engine process of its own, or with --no-engine-process on a thread of
this process; its replica 0 alone as the one-device baseline, runs interleaved), in one command.

The workload is benchmark_serving.py's (random token-id prompts of --input-len, --output-len new
tokens each, EOS ignored, all at once; defaults: GPT-2 124M shape, random weights, 256 x 8-token
prompts, 256 new tokens, max batch 256 per replica). Each side runs --warmup-runs untimed copies
(fresh prompts, same lengths) then --repeat-runs timed ones; a run's output throughput is its
completion tokens over first send to last finish (benchmark_serving's definition). Reported per
side: each run's throughput, their median, and median(N replicas) / median(1 replica). Both
sides run the same requests, or with --per-replica the N-replica side N times as many: half of
256 streams leaves each GPU at 128 rows, where a step costs most of what 256 rows cost. In
process the one-replica side is replica 0 alone, in its engine process (with --no-engine-process
an engine in this process, as `LLM` runs one GPU: its "1" column is that baseline).

    # GPU, 2 cards: issue 21's DP=2 against one GPU (>= 1.8x asked), each GPU at 256 streams
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/benchmark_data_parallel.py \\
        --data-parallel-size 2 --per-replica --json bench/out/dp2.json
    # the same, each replica's engine on a thread (not in a process of its own, the default):
    # of the launched server on the HTTP side, of this process in process (one GIL for both)
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/benchmark_data_parallel.py \\
        --data-parallel-size 2 --no-engine-process --json bench/out/dp2-engine-thread.json
    # CPU smoke test, 2 host devices
    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. python \\
        bench/benchmark_data_parallel.py --model random:tiny --no-warmup --num-prompts 8 \\
        --output-len 8 --max-batch-size 4 --warmup-runs 2 --repeat-runs 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.serving.flags import add_client_arg  # noqa: E402
from bench.serving.http_client import Clients, pick_client, served_model  # noqa: E402
from bench.serving.in_process import records_from_traces  # noqa: E402
from bench.serving.launch import LaunchedServer  # noqa: E402
from bench.serving.records import summarize  # noqa: E402
from bench.serving.workload import Sample, random_dataset, warmup_samples  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = common.new_parser(__doc__)
    p.add_argument(
        "--only", choices=["http", "in-process"], default=None, help="run one side alone"
    )
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=256, help="requests per run")
    g.add_argument(
        "--per-replica",
        action="store_true",
        help="--num-prompts requests per replica: the N-replica side runs N times as many at "
        "once, so each device serves the one-device workload (throughput at capacity); "
        "without it both sides run the same requests",
    )
    g.add_argument("--input-len", type=int, default=8, help="prompt tokens")
    g.add_argument("--output-len", type=int, default=256, help="new tokens per request")
    g.add_argument(
        "--vocab-size",
        type=int,
        default=50257,
        help="prompt ids are uniform in [0, this - 1) (GPT-2's vocabulary without its EOS id)",
    )
    g.add_argument("--warmup-runs", type=int, default=2, help="untimed runs first, per side")
    g.add_argument("--repeat-runs", type=int, default=5, help="timed runs per side")
    g = p.add_argument_group("server")
    g.add_argument(
        "--server-args",
        default="--max-waiting -1",
        help="more flags for the launched servers, one shell-quoted string",
    )
    g.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each replica's engine runs in a process of its own, or with --no-engine-process "
        "on a thread: of the launched servers (one replica and N) on the HTTP side, of this "
        "process on the in-process side (whose one-replica baseline is then an engine in this "
        "process, not in an engine process)",
    )
    g.add_argument(
        "--launch-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for a launched server's /health and its programs' compiles",
    )
    add_client_arg(g)
    g.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds one request may take"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("engine (every side; --data-parallel-size: the replicas compared)")
    common.add_engine_args(g, max_batch_size=256)
    # What benchmark_serving's helpers read: greedy, all at once, streamed without usage.
    p.set_defaults(
        data_parallel_size=2,
        range_ratio=0.0,
        temperature=0.0,
        logprobs=None,
        max_concurrency=None,
        continuous_usage_stats=False,
        disconnect_fraction=0.0,
        served_model_name=None,
        server_log=None,
        no_wait_compiled=False,
    )
    return p


def summary(throughputs: Sequence[float], requests: int) -> dict[str, Any]:
    return {
        "requests": requests,  # per run
        "output_throughput_tok_s": list(throughputs),
        "median": statistics.median(throughputs),
        "min": min(throughputs),
        "max": max(throughputs),
    }


def side_workload(args: argparse.Namespace, samples: list[Sample], replicas: int):
    """What a side of `replicas` replicas runs of one run's `samples` (num_prompts x N of them
    with --per-replica)."""
    return samples if args.per_replica and replicas > 1 else samples[: args.num_prompts]


def run_http(args: argparse.Namespace, replicas: int, workloads: list[list[Sample]]) -> dict:
    """A server of `replicas` replicas: the warm-up workloads, then the timed ones."""
    extra = " --engine-process" if args.engine_process else " --no-engine-process"
    server_args = argparse.Namespace(
        **vars(args)
        | {
            "data_parallel_size": replicas,
            "server_args": args.server_args + extra,
        }
    )
    client = pick_client(args.client)
    runs = []
    with (
        LaunchedServer(server_args) as server,
        Clients(args, server.url, served_model(server.url), client) as clients,
    ):
        for i, samples in enumerate(workloads):
            tag = f"http dp={replicas} run {i}"
            samples = side_workload(args, samples, replicas)
            records, duration = clients.run(samples, [0.0] * len(samples), tag)
            s = summarize(records, duration, [50.0])
            if s["failed"] or s["output_len_mismatches"]:
                raise SystemExit(f"{tag}: {s['failed']} failed, errors {s['errors']}")
            runs.append(s["output_throughput"])
            print(f"{tag}: {s['output_throughput']:,.0f} tok/s", file=sys.stderr)
    timed = summary(runs[args.warmup_runs :], len(samples))
    return timed | {"server_start_seconds": server.start_seconds}


def run_in_process(args: argparse.Namespace, workloads: list[list[Sample]]) -> dict:
    """One engine of N replicas; its replica 0 alone and the whole engine, runs interleaved."""
    from rosejax.sampling import SamplingParams
    from rosejax.settings import configure_process

    configure_process(args.compilation_cache_dir)  # before the backend starts
    engine, build_s = common.make_engine(args, engine_process=args.engine_process)
    sides = {"1": engine.replicas[0], str(args.data_parallel_size): engine}
    runs: dict[str, list[float]] = {k: [] for k in sides}
    for i in common.frozen_from(args.warmup_runs, len(workloads)):  # timed: the heap frozen
        run_samples = workloads[i]
        for key, side in sides.items():
            tag = f"in-process dp={key} run {i}"
            samples = side_workload(args, run_samples, int(key))
            offsets = [0.0] * len(samples)
            params = [
                SamplingParams(max_tokens=s.output_len, temperature=0.0, ignore_eos=True)
                for s in samples
            ]
            traces, _ = common.run_workload(
                side, [s.prompt for s in samples], params, offsets, tag, not args.no_progress
            )
            records, duration = records_from_traces(traces, samples, offsets)
            s = summarize(records, duration, [50.0])
            runs[key].append(s["output_throughput"])
            print(f"{tag}: {s['output_throughput']:,.0f} tok/s", file=sys.stderr)
    n = {k: len(side_workload(args, workloads[0], int(k))) for k in sides}
    out = {k: summary(v[args.warmup_runs :], n[k]) for k, v in runs.items()}
    engine.close()  # its engine processes, if any
    return out | {
        "build_seconds": build_s,
        "engine_process": args.engine_process,
        "environment": common.environment(engine),
        "devices": [[str(d) for d in r.devices] for r in engine.replicas],
        # The host's dispatch / wait / harvest seconds per replica over every run (host-bound?),
        # as each engine counts them (in its engine process: as of its last message).
        "host_seconds": [r.host_seconds for r in engine.replicas],
    }


def ratio(side: dict, n: int) -> float:
    return side[str(n)]["median"] / side["1"]["median"]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(common.glue_flag_values(argv, ["--server-args"]))
    if args.num_prompts < 1 or args.output_len < 1 or args.input_len < 1:
        raise SystemExit("--num-prompts, --input-len and --output-len must be >= 1")
    if args.repeat_runs < 1 or args.warmup_runs < 0:
        raise SystemExit("--repeat-runs must be >= 1 and --warmup-runs >= 0")
    n = args.data_parallel_size
    if n < 2:
        raise SystemExit("--data-parallel-size must be >= 2: the replicas set beside one")
    # Fresh prompts every run (no prefix-cache hits), the same lengths; enough for N replicas.
    total = args.num_prompts * (n if args.per_replica else 1)
    base = random_dataset(argparse.Namespace(**vars(args) | {"num_prompts": total}), args.seed)
    workloads = [warmup_samples(base, r, args) for r in range(args.warmup_runs + args.repeat_runs)]
    result: dict[str, Any] = {"benchmark": "data_parallel", "replicas": n, "args": vars(args)}
    if args.only != "in-process":
        http = {str(k): run_http(args, k, workloads) for k in (1, n)}
        result["http"] = http | {"ratio": ratio(http, n)}
    if args.only != "http":
        local = run_in_process(args, workloads)
        result["environment"] = local.pop("environment")
        result["in_process"] = local | {"ratio": ratio(local, n)}
    else:
        result["environment"] = common.environment()
    print(f"output throughput, median of {args.repeat_runs} runs (tok/s): 1 replica, {n}, ratio")
    for side in ("in_process", "http"):
        if side in result:
            r = result[side]
            one, many = r["1"]["median"], r[str(n)]["median"]
            print(f"  {side:<11} {one:12,.0f} {many:12,.0f}  {r['ratio']:.3f}")
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
