"""The in-process side: the same workload through `LLMEngine` stepping in this process."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from typing import Any

from bench import common
from bench import metrics as m
from bench.serving.records import Record
from bench.serving.workload import Sample


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
    repeats: int = 1,
) -> tuple[list[tuple[list[Record], float]], dict[str, Any]]:
    """The workload through LLMEngine stepping in this process (bench/common.run_workload),
    after the warm-ups: `repeats` timed runs on one engine, each as (records, duration)."""
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
    runs = []
    with common.frozen_heap():  # as the server's engine, once compiled
        for r in range(repeats):
            traces, steps = run(samples, "in-process" if repeats == 1 else f"in-process {r}")
            runs.append(records_from_traces(traces, samples, offsets))
    view = m.summarize(traces, steps)  # the last run's
    info = {
        "environment": env,
        "build_seconds": build_s,
        "compiles_in_timed_runs": engine.num_compiles - compiles,
        "decode_throughput_tok_s": view["decode_throughput_tok_s"],
        "steps": view["steps"],
    }
    return runs, info
