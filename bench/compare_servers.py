"""Server variants on one workload, alternated in one process: which server flags serve a burst
(or a Poisson run) better, with the host's drift over the call landing on every variant alike.

Each --variant NAME=FLAGS is `python -m rosejax.serve` with this script's engine flags, then
--server-args (shared), then FLAGS; FLAGS' leading VAR=VALUE words, as on a shell's command line,
are that server's environment (what only a process can differ in: XLA_FLAGS). All variants are
launched first, one after another (a compilation cache makes the later ones quick), each with
an equal share of the GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION, unless set) and one KV
budget (twice what the workload holds at once, unless --kv-cache-tokens says; all then run one
set of programs); an idle server costs the others nothing. Then each of --rounds runs the
workload (as bench/benchmark_serving.py does, --warmup-runs first) against every variant in
turn, the order reversed every other round. With
--in-process the same workload then runs --rounds times through one `LLMEngine` in this process,
after the servers stopped, and each variant's median throughput and TTFT p50 is put beside its
median (issue 17's ratios). With --floor TPOT_MS one more variant, `floor`, is
bench/serving/floor_server.py: no engine, each request's tokens streamed at that TPOT, so its
row is what these clients and HTTP leave of the in-process figures on this host.

Prints a row per run and the medians per variant; --json writes every run's summary.

    # GPU: what gathering a burst's arrivals gives: 3 rounds, issue 17's burst, in process last
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/compare_servers.py --rounds 3 --in-process \\
        --variant base= --variant nogather="--idle-gather-ms 0" --floor 0.9 \\
        --json bench/out/gather.json
    # GPU: an XLA flag, process-wide, as a server's environment
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/compare_servers.py --rounds 3 --in-process \\
        --variant base= \\
        --variant skip="XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    # CPU smoke run
    PYTHONPATH=. python bench/compare_servers.py --model random:tiny --num-prompts 16 \\
        --output-len 8 --rounds 2 --variant a= --variant b="--open-decode-steps 4"
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.common import Variant, run_order, variant  # noqa: E402
from bench.serving.flags import build_parser, check_args  # noqa: E402
from bench.serving.http_client import (  # noqa: E402
    ENGINE_TIMES,
    pick_client,
    run_http_side,
    ttft_parts,
)
from bench.serving.in_process import run_in_process  # noqa: E402
from bench.serving.launch import LaunchedServer  # noqa: E402
from bench.serving.records import summarize  # noqa: E402
from bench.serving.workload import Sample, timed_workload  # noqa: E402

FLOOR = "floor"  # --floor's variant


def shared_kv_tokens(args: argparse.Namespace, samples: Sequence[Sample]) -> int | None:
    """One KV budget for every server and the in-process engine, unless one is given: twice what
    the workload holds at once. Left to each, they size it from the memory they find (each
    server gets a share of it) and each compiles every program again for its own cache shape.
    None for text prompts, whose token counts only the server knows."""
    lengths = [s.prompt_len for s in samples]
    if args.kv_cache_tokens or args.kv_cache_memory_fraction or None in lengths:
        return args.kv_cache_tokens
    longest = max(n + s.output_len for n, s in zip(lengths, samples, strict=True))
    return 2 * min(len(samples), args.max_batch_size) * longest


def figures(summary: dict[str, Any]) -> dict[str, float]:
    """A run's headline figures (ms, tok/s)."""
    return {
        "output_throughput": summary["output_throughput"],
        "ttft_p50": summary["ttft_ms"]["p50"],
        "ttft_p90": summary["ttft_ms"].get("p90", math.nan),  # unless --percentiles left it out
        "ttft_p99": summary["ttft_ms"]["p99"],
        "tpot_p50": summary["tpot_ms"]["p50"],
        "event_gap_max": summary["event_gap_max_ms"],
        # a server's runs only: a burst admitted in one prefill or in several, and where its
        # TTFT went (ENGINE_TIMES)
        **{k: summary[k] for k in ("prefill_steps", *ENGINE_TIMES, "back_ms") if k in summary},
    }


def medians(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def row(label: str, f: dict[str, float], base: dict[str, float] | None = None) -> str:
    text = (
        f"{label:<28} {f['output_throughput']:>10,.0f} tok/s  TTFT p50 {f['ttft_p50']:7.1f} "
        f"p90 {f['ttft_p90']:7.1f} p99 {f['ttft_p99']:7.1f} ms  TPOT p50 {f['tpot_p50']:.3f} ms  "
        f"max gap {f['event_gap_max']:6.1f} ms"
    )
    if "prefill_steps" in f:
        text += f"  prefills {f['prefill_steps']:g}"
    if "back_ms" in f:
        text += f"  server TTFT: {ttft_parts(f)}"
    if base:
        text += (
            f"  | / in process: {f['output_throughput'] / base['output_throughput']:.3f}, "
            f"TTFT {f['ttft_p50'] / base['ttft_p50']:.2f}x"
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser(__doc__, where=False)
    g = p.add_argument_group("variants")
    g.add_argument(
        "--variant",
        type=variant,
        action="append",
        required=True,
        metavar="NAME=FLAGS",
        help="a server to compare: NAME, then its flags after --server-args, led by any "
        "VAR=VALUE words of its environment (repeatable; NAME= for the server as --server-args "
        "leaves it)",
    )
    g.add_argument(
        "--rounds", type=int, default=3, help="runs against each variant; default: %(default)s"
    )
    g.add_argument(
        "--floor",
        type=float,
        metavar="TPOT_MS",
        help="also a variant `floor`: bench/serving/floor_server.py, no engine, streaming each "
        "request's tokens at TPOT_MS (give the in-process TPOT): the HTTP floor of this host, "
        "what no server can beat with these clients",
    )
    args = p.parse_args(common.glue_flag_values(argv, ["--server-args", "--variant"]))
    check_args(p, args)
    floor_variant = [Variant(FLOOR, "")] if args.floor is not None else []
    variants: list[Variant] = args.variant + floor_variant
    if args.rounds < 1 or len({v.name for v in variants}) != len(variants):
        p.error(
            f"--rounds must be >= 1 and each --variant NAME given once ({FLOOR!r} with --floor)"
        )
    samples, offsets, warmups = timed_workload(args)
    args.kv_cache_tokens = shared_kv_tokens(args, samples)
    client = pick_client(args.client)
    slos = dict(args.goodput) if args.goodput else None
    # the floor takes no GPU memory
    share = {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.9 / len(args.variant):.3f}"}
    env = {} if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ else share

    runs: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    servers: dict[str, LaunchedServer] = {}
    with contextlib.ExitStack() as stack:
        for v in variants:
            log = f"{args.server_log}.{v.name}" if args.server_log else None
            v_args = argparse.Namespace(
                **vars(args) | {"server_args": f"{args.server_args} {v.flags}", "server_log": log}
            )
            floor = args.floor if v.name == FLOOR else None
            servers[v.name] = stack.enter_context(LaunchedServer(v_args, env | v.env, floor))
        for r, v in run_order(variants, args.rounds):
            records, duration, _, counts = run_http_side(
                args, servers[v.name].url, samples, offsets, warmups, client
            )
            summary = summarize(records, duration, args.percentiles, slos) | counts
            runs[v.name].append(summary)
            print(row(f"round {r} {v.name}", figures(summary)), flush=True)
    base, local_runs = None, []
    if args.in_process:
        local, _ = run_in_process(args, samples, offsets, warmups, repeats=args.rounds)
        for r, (records, duration) in enumerate(local):
            local_runs.append(summarize(records, duration, args.percentiles, slos))
            print(row(f"round {r} in process", figures(local_runs[-1])))
        base = medians([figures(s) for s in local_runs])
    print("medians over the rounds")
    if base:
        print(row("in process", base))
    result: dict[str, Any] = {"benchmark": "compare_servers", "variants": {}}
    for v in variants:
        med = medians([figures(s) for s in runs[v.name]])
        print(row(v.name, med, base))
        failed = sum(s["failed"] for s in runs[v.name])
        if failed:
            print(f"{v.name}: {failed} requests failed over its runs")
        server = servers[v.name]
        result["variants"][v.name] = {
            "flags": v.flags,
            "env": v.env,
            "server_cmd": server.cmd,
            "start_seconds": server.start_seconds,
            "compiled_seconds": server.compiled_seconds,
            "median": med,
            "runs": runs[v.name],
        }
    result["in_process"] = {"median": base, "runs": local_runs} if base else None
    result["args"] = {k: str(val) for k, val in vars(args).items()}
    result["environment"] = common.environment()
    common.write_json(args.json, result)
    return 0 if all(s["completed"] for ss in runs.values() for s in ss) else 1


if __name__ == "__main__":
    sys.exit(main())
