"""What the benchmark scripts share: engine flags, the timed request loop and its repeated runs,
the card's copy bandwidth, environment, JSON, plots.

The loop drives `LLMEngine` through its public API only (add_request / step /
has_unfinished_requests). The engine is single-threaded, so the "submitter" is the loop itself:
before each `step()` it adds every request whose submit time has passed. A request's submit time
is when it was due (start + its offset), so time spent adding earlier requests or waiting for the
engine's current step counts toward its TTFT, as it would for a client.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import heapq
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from bench import metrics as m
from bench.metrics import RequestTrace, StepRecord, step_kind
from rosejax.engine_args import add_engine_args as add_engine_args_
from rosejax.engine_args import add_sampling_args, engine_kwargs
from rosejax.settings import configure_process, freeze_heap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------ flags


def new_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph as description, defaults in --help."""
    return argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


def glue_flag_values(argv: Sequence[str] | None, flags: Sequence[str]) -> list[str]:
    """argv (default: sys.argv[1:]) with each of `flags` joined to its value (`--server-args
    --no-engine-process` -> `--server-args=--no-engine-process`): argparse takes a lone value that
    starts with "-" for a flag of its own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in flags and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def ints(text: str) -> list[int]:
    """'1,4' -> [1, 4]."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a benchmark's child process (a launched server, a variant's run):
    this process's with `extra` set, and this repository first on PYTHONPATH."""
    env = dict(os.environ) | extra
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    flags: str  # command-line flags (compare_servers: the server's after --server-args)
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # its process's, beside ours


def variant(text: str) -> Variant:
    """argparse type of a --variant run in a process of its own: NAME=FLAGS (FLAGS may be
    empty), FLAGS' leading VAR=VALUE words its environment, as on a shell's command line."""
    name, sep, flags = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS with NAME a word, got {text!r}")
    try:
        words = shlex.split(flags)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--variant {name}: {e}") from None
    env = {}
    while words and _ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return Variant(name, shlex.join(words) if env else flags, env)


def run_order(variants: Sequence[Variant], rounds: int) -> list[tuple[int, Variant]]:
    """(round, variant) in the order they run: each round all variants, every other one
    reversed, so that no variant always runs first."""
    return [(r, v) for r in range(rounds) for v in (variants if r % 2 == 0 else variants[::-1])]


def add_engine_args(p: argparse.ArgumentParser, max_batch_size: int = 64) -> None:
    """The engine's flags (rosejax.engine_args) with the benchmarks' defaults, and --seed."""
    add_engine_args_(
        p,
        model_default="random:gpt2",
        model_aliases=("--hf-model-id",),
        max_batch_size=max_batch_size,
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights and of the sampling seeds"
    )


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """--num-requests and --max-new-tokens, the sampling flags and the run flags."""
    p.add_argument("--num-requests", type=int, default=256, help="requests per run")
    add_sampling_args(p, max_new_tokens=256)
    add_run_args(p, warmup_runs=1, repeat_runs=3)


def add_run_args(p: argparse.ArgumentParser, warmup_runs: int = 1, repeat_runs: int = 3) -> None:
    p.add_argument(
        "--warmup-runs",
        type=int,
        default=warmup_runs,
        help="untimed runs of the whole workload first (they compile what it uses)",
    )
    p.add_argument(
        "--repeat-runs",
        type=int,
        default=repeat_runs,
        help="timed runs; each is reported, then a summary over them",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure here")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="write a PNG here (needs matplotlib: pip install -e '.[bench]')",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=None,
        help="the card's memory bandwidth in GB/s, for the roofline's %% column; "
        "default: its copy bandwidth measured here on a GPU (none on CPU)",
    )


def make_engine(
    args: argparse.Namespace, max_batch_size: int | None = None, engine_process: bool = True
):
    """Build the engine (`make_engine`: with --data-parallel-size > 1 the replicas in engine
    processes, or on threads of this process without `engine_process`); returns (engine,
    seconds to build it: load, cache, warm-up compile)."""
    from rosejax.engine.data_parallel import make_engine
    from rosejax.settings import EngineConfig

    start = time.perf_counter()
    kwargs = engine_kwargs(args) | {"seed": args.seed, "engine_process": engine_process}
    if max_batch_size:  # compare_hf: one engine per batch size
        kwargs["max_batch_size"] = max_batch_size
    engine = make_engine(EngineConfig(model=args.model, **kwargs))
    return engine, time.perf_counter() - start


def copy_bandwidth_gbs(size_mb: int = 1024, iters: int = 20) -> float:
    """The card's copy bandwidth, the denominator of every roofline here: GB/s (bytes read +
    written) of `iters` in-place negations of a `size_mb` float32 buffer inside one jitted loop
    (no dispatch gaps), median of 5 calls."""

    import jax

    n = size_mb * (1 << 20) // 4
    x = jax.numpy.ones((n,), jax.numpy.float32)
    f = jax.jit(lambda x: jax.lax.fori_loop(0, iters, lambda _, x: -x, x), donate_argnums=(0,))
    return 2 * n * 4 * iters / median_chained_seconds(f, x) / 1e9


def matmul_tflops(n: int = 8192, iters: int = 10) -> float:
    """Dense bf16 TFLOP/s of an n^3 product, `iters` of them in one jitted loop, median of 5."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.bfloat16) * 0.01
    f = jax.jit(lambda x: jax.lax.fori_loop(0, iters, lambda _, y: (y @ a).astype(y.dtype), x))
    return 2 * n**3 * iters / median_chained_seconds(f, a) / 1e12


def median_chained_seconds(f: Callable, x, calls: int = 5) -> float:
    """Median seconds of `calls` calls x = f(x), after one that compiles."""
    import statistics

    x = f(x).block_until_ready()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        x = f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def add_kernel_bench_args(p: argparse.ArgumentParser) -> None:
    """The timing and output flags of the kernel microbenchmarks (bench_attention,
    bench_layer_norm, bench_sampling)."""
    p.add_argument("--iters", type=int, default=200, help="calls per timed loop")
    p.add_argument("--repeats", type=int, default=5, help="timed loops; the median is kept")
    p.add_argument("--quick", action="store_true", help="tiny sizes, interpret mode (CPU smoke)")
    p.add_argument("--json", default=None, help="write results here")


def parse_kernel_bench_args(
    p: argparse.ArgumentParser, argv: list[str] | None = None
) -> argparse.Namespace:
    """p's arguments, with rosejax's process XLA flags set before jax starts its backend, so a
    timed loop (`loop_times`) runs as one CUDA graph as the engine's decode windows do, not as
    a launch from the host per call (which a call of a few microseconds would wait on)."""
    from rosejax.settings import set_xla_flags

    args = p.parse_args(argv)
    set_xla_flags()
    return args


# Calls per trip of loop_times' loops: a trip of a `while` loop in a CUDA graph costs ~9 µs of
# its own on an H200 (an x + 1 loop: 9.8 µs a call, 1.3 unrolled 10 times, 1.0 unrolled 50).
LOOP_UNROLL = 20


_LOOPS: dict = {}  # loop_times' jitted loops


def loop_times(
    calls: Sequence[tuple[Callable, Any, tuple]],
    *,
    iters: int,
    repeats: int,
    unroll: int = LOOP_UNROLL,
) -> list[list[float]]:
    """Microseconds per call of each `(fn, x, operands)`: `fn(x, *operands) -> array (or pytree)
    shaped like x`, called `iters` times inside one jitted fori_loop unrolled `unroll` calls a
    trip (each output feeds the next call, so Python dispatch stays out; a CUDA graph under
    `parse_kernel_bench_args`' flags). Every loop runs once untimed, then `repeats` rounds time
    each loop once in turn: a drift of the GPU's clock or heat reaches every call alike, where
    timed one after another each would get a stretch of its own. Each call's `repeats` times.
    The operands (caches, weights) are arguments of the loop, as the engine's are of its
    windows: closed over, they would be constants of the program. A loop is made once for each
    (fn, iters, unroll): operands of the same shapes reuse its compiled program."""
    import jax

    loops = []
    for fn, x, operands in calls:
        key = (fn, iters, unroll)
        if key not in _LOOPS:
            _LOOPS[key] = jax.jit(
                lambda x, *ops, fn=fn: jax.lax.fori_loop(
                    0, iters, lambda _, y: fn(y, *ops), x, unroll=min(iters, unroll)
                )
            )
        loops.append(functools.partial(_LOOPS[key], x, *operands))
    for loop in loops:
        jax.block_until_ready(loop())
    times: list[list[float]] = [[] for _ in loops]
    for _ in range(repeats):
        for loop, out in zip(loops, times, strict=True):
            t = time.perf_counter()
            jax.block_until_ready(loop())
            out.append((time.perf_counter() - t) / iters * 1e6)
    return times


def time_in_loop(
    fn: Callable, x, *operands, iters: int, repeats: int, unroll: int = LOOP_UNROLL
) -> float:
    """Microseconds per call of `fn(x, *operands)` (`loop_times` of it alone): the median of
    `repeats` loops."""
    (times,) = loop_times([(fn, x, operands)], iters=iters, repeats=repeats, unroll=unroll)
    return float(np.median(times))


def resolve_bandwidth(args: argparse.Namespace) -> float | None:
    """--bandwidth-gbs, else the copy bandwidth measured now on a GPU (before the engine takes
    its memory; not with --data-parallel-size > 1), else None (CPU: no % of bandwidth). Sets
    args.bandwidth_gbs and args.bandwidth_measured (so both land in the JSON's args)."""
    args.bandwidth_measured = False
    if args.bandwidth_gbs is None and args.data_parallel_size > 1:
        # The replicas run in engine processes: jax's backend here would take their GPU memory.
        print("copy bandwidth not measured: give --bandwidth-gbs", file=sys.stderr)
    elif args.bandwidth_gbs is None:
        import jax

        if jax.default_backend() == "gpu":
            try:
                args.bandwidth_gbs = copy_bandwidth_gbs()
            except Exception as e:  # e.g. out of memory beside torch (--hf-in-process)
                print(
                    f"copy bandwidth not measured: {type(e).__name__}: {e}"[:300], file=sys.stderr
                )
                return None
            args.bandwidth_measured = True
            print(f"copy bandwidth (measured): {args.bandwidth_gbs:,.0f} GB/s", file=sys.stderr)
    return args.bandwidth_gbs


def start(
    args: argparse.Namespace,
    benchmark: str,
    label: str = "engine",
    max_batch_size: int | None = None,
    **extra,
) -> tuple[Any, dict]:
    """Resolve the bandwidth, build the engine and say so on stderr; returns (engine, result):
    the JSON's head ({'benchmark', **extra, 'args', 'environment', 'engine'})."""
    configure_process(args.compilation_cache_dir)  # before the backend starts
    resolve_bandwidth(args)
    engine, build_s = make_engine(args, max_batch_size)
    env = environment(engine)
    print(
        f"{label}: {args.model} {env['dtype']} on {env.get('device')} (jax {env.get('jax')}), "
        f"max batch {engine.max_batch_size}, decode_steps {env['decode_steps']}; built in "
        f"{build_s:.1f} s ({engine.compile_seconds:.1f} s warm-up compile, "
        f"{engine.num_compiles} traces)",
        file=sys.stderr,
    )
    result = {
        "benchmark": benchmark,
        **extra,
        "args": vars(args),
        "environment": env,
        "engine": {
            "build_seconds": build_s,
            "warmup_compile_seconds": engine.compile_seconds,
            "num_compiles_after_build": engine.num_compiles,
        },
    }
    return engine, result


# ------------------------------------------------------------------------------- the loop


class GcPause(NamedTuple):
    """One garbage collection: its wall seconds, the seconds of CPU this thread spent in it (far
    fewer: it waited, for the GIL or the OS), its generation and the objects it freed."""

    seconds: float
    thread_seconds: float
    generation: int
    collected: int


@contextlib.contextmanager
def frozen_heap():
    """Timed work with the heap frozen (`freeze_heap`), as a server freezes it once its programs
    are compiled: a full collection would walk what compiling left (~200k objects on a GPU
    machine: 90-160 ms pauses inside timed runs). Frozen whatever was frozen before (a Python
    may freeze a few hundred objects as it starts); unfrozen after, so engines the caller drops
    can be collected (what was frozen before thaws too: harmless, a freeze only hides live
    objects from the collector)."""
    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def frozen_from(first: int, total: int) -> Iterator[int]:
    """range(total), the heap frozen (`frozen_heap`) from `first` on: the runs before it compile
    and warm up, the rest are timed without a full collection in them."""
    yield from range(first)
    with frozen_heap():
        yield from range(first, total)


@contextlib.contextmanager
def gc_pauses():
    """Yields a list that fills with a `GcPause` for each garbage collection inside the block."""
    pauses: list[GcPause] = []
    began = began_cpu = 0.0

    def on_gc(phase: str, info: dict) -> None:
        nonlocal began, began_cpu
        if phase == "start":
            began, began_cpu = time.perf_counter(), time.thread_time()
        else:
            pauses.append(
                GcPause(
                    time.perf_counter() - began,
                    time.thread_time() - began_cpu,
                    info["generation"],
                    info["collected"],
                )
            )

    gc.callbacks.append(on_gc)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(on_gc)


def run_workload(
    engine,
    prompts: Sequence[str | Sequence[int]],
    params,
    offsets: Sequence[float] | None = None,
    tag: str = "run",
    progress: bool = True,
    max_concurrency: int | None = None,
) -> tuple[list[RequestTrace], list[StepRecord]]:
    """Submit prompts[i] at start + offsets[i] seconds (None: all at once), step the engine until
    every request finished; return one trace per request (in prompt order) and one record per
    step. Token times are taken right after `step()` returns.

    `max_concurrency`: at most this many requests in the engine at once, as a client with that
    many connections: a due request waits for one to finish, and its submit time is then the end
    of the step that finished it (the client's clock starts when it sends)."""
    n = len(prompts)
    offsets = [0.0] * n if offsets is None else list(offsets)
    if len(offsets) != n:
        raise ValueError("one offset per prompt")
    order = sorted(range(n), key=lambda i: offsets[i])
    params_list = params if isinstance(params, (list, tuple)) else [params] * n
    traces = [RequestTrace(f"{tag}-{i}", 0.0) for i in range(n)]
    by_id = {t.request_id: t for t in traces}
    steps: list[StepRecord] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc=tag, unit="req", leave=False, mininterval=0.5)
    nxt = 0
    start = time.perf_counter()
    # max_concurrency: when each free slot became free (a min-heap; empty = all taken)
    slots = [start] * max_concurrency if max_concurrency else None
    while nxt < n or engine.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < n and offsets[order[nxt]] <= now - start:
            i = order[nxt]
            traces[i].submit_time = start + offsets[i]
            if slots is not None:
                if not slots:
                    break
                traces[i].submit_time = max(traces[i].submit_time, heapq.heappop(slots))
            engine.add_request(traces[i].request_id, prompts[i], params_list[i])
            nxt += 1
        if not engine.has_unfinished_requests():  # idle until the next arrival
            time.sleep(max(0.0, start + offsets[order[nxt]] - time.perf_counter()))
            continue
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        tokens = first = 0
        for out in outputs:
            trace = by_id[out.request_id]
            k = len(out.new_token_ids)
            if k and not trace.token_times:
                first += 1
                trace.prompt_tokens = len(out.prompt_token_ids)
            trace.add_tokens(k, t1)
            tokens += k
            if out.finished:
                trace.finish_reason = out.finish_reason
                if slots is not None:
                    heapq.heappush(slots, t1)
                if bar is not None:
                    bar.update(1)
        steps.append(StepRecord(t0, t1, tokens, step_kind(len(outputs), first)))
    if bar is not None:
        bar.close()
    return traces, steps


def run_repeated(
    engine,
    args: argparse.Namespace,
    make_prompts: Callable[[int], Sequence],
    params,
    offsets: Sequence[float] | None = None,
    *,
    tag_prefix: str = "",
    report: bool = True,
) -> dict:
    """--warmup-runs untimed runs, then --repeat-runs timed ones, of one workload.

    Run r submits make_prompts(r) at `offsets`. Each run's summary (bench/metrics.summarize) gets
    'new_compiles' (engine compiles inside the run) and, where any step decoded, 'roofline'
    (bench/metrics.traced_decode_roofline: any mix of waves, windows and prompt lengths). With
    `report`, each run's summary is printed (timed runs on stdout, warm-up runs on stderr).
    Returns {'warmup_runs': [{'tag', 'summary'}], 'runs': [{'tag', 'summary', 'requests'}]
    (timed; requests: trace_lists), 'summary': summarize_runs over the timed runs, 'series':
    tag -> {'ttft_ms', 'itl_ms'} for plot_distributions (not JSON)}.

    The timed runs run with the heap frozen (`frozen_heap`). Each summary gets 'gc_pause_ms' (the
    run's garbage collections: count, total, longest)."""
    out: dict = {"warmup_runs": [], "runs": [], "summary": {}, "series": {}}
    for run in frozen_from(args.warmup_runs, args.warmup_runs + args.repeat_runs):
        warm = run < args.warmup_runs
        tag = tag_prefix + (f"warmup{run}" if warm else f"run{run - args.warmup_runs}")
        compiles = engine.num_compiles
        with gc_pauses() as pauses:
            traces, steps = run_workload(
                engine,
                make_prompts(run),
                params,
                offsets,
                tag=tag,
                progress=not args.no_progress,
            )
        summary = m.summarize(traces, steps)
        summary["new_compiles"] = engine.num_compiles - compiles
        longest = max(pauses, default=GcPause(0.0, 0.0, 0, 0))
        summary["gc_pause_ms"] = {
            "count": len(pauses),
            "total": 1e3 * sum(p.seconds for p in pauses),
            "max": 1e3 * longest.seconds,
            # what the longest one was: a full walk (generation 2), a free of many objects,
            # or a wait (its thread's CPU far below its wall time)
            "max_thread_ms": 1e3 * longest.thread_seconds,
            "max_generation": longest.generation,
            "max_collected": longest.collected,
        }
        roof = m.traced_decode_roofline(
            engine.config,
            traces,
            steps,
            args.bandwidth_gbs,
            dtype_bytes=np.dtype(engine.dtype).itemsize,
        )
        if roof is not None:
            summary["roofline"] = roof
        if report:
            dest = sys.stderr if warm else sys.stdout
            print(
                m.format_summary(summary, f"[{tag}]" + (" (warm-up, not counted)" if warm else "")),
                file=dest,
            )
            if roof is not None:
                print(m.format_roofline(roof), file=dest)
            if summary["new_compiles"] and not warm:
                print(f"  note: {summary['new_compiles']} compiles inside this timed run")
            gcs = summary["gc_pause_ms"]
            if gcs["max"] >= 10:
                print(
                    f"  note: {gcs['count']} garbage collections took {gcs['total']:.1f} ms "
                    f"(longest {gcs['max']:.1f} ms: generation {gcs['max_generation']}, "
                    f"{gcs['max_collected']} objects freed, {gcs['max_thread_ms']:.1f} ms "
                    "of this thread's CPU)",
                    file=dest,
                )
        entry = {"tag": tag, "summary": summary}
        if warm:
            out["warmup_runs"].append(entry)
            continue
        entry["requests"] = trace_lists(traces)
        out["runs"].append(entry)
        out["series"][tag] = {
            "ttft_ms": entry["requests"]["ttft_ms"],
            "itl_ms": [g * 1e3 for t in traces for g in m.itl(t)],
        }
    out["summary"] = m.summarize_runs([r["summary"] for r in out["runs"]])
    return out


def print_runs_summary(summary: dict, n: int, rows: Sequence[tuple], fmt: str = ",.2f") -> None:
    """One line per row (key of summarize_runs, label[, scale]) present: mean [min, max] over
    the runs, times scale (default 1)."""
    print(f"summary over {n} timed run(s): mean [min, max]")
    for key, label, *scale in rows:
        s = summary.get(key)
        if s:
            k = scale[0] if scale else 1
            print(
                f"  {label:<18} {s['mean'] * k:12{fmt}}  [{s['min'] * k:{fmt}}, "
                f"{s['max'] * k:{fmt}}]"
            )


# print_runs_summary rows of finish(): (summarize_runs key, label[, scale]).
SUMMARY_ROWS = [
    ("throughput_tok_s", "end-to-end tok/s"),
    ("decode_throughput_tok_s", "decode-only tok/s"),
    ("ttft_ms.p50", "TTFT p50 ms"),
    ("ttft_ms.p99", "TTFT p99 ms"),
    ("tpot_ms.p50", "TPOT p50 ms"),
    ("tpot_ms.p99", "TPOT p99 ms"),
]
ROOFLINE_ROWS = [
    ("roofline.mean_batch", "decode mean batch"),
    ("roofline.step_seconds", "decode step ms", 1e3),
    ("roofline.flops", "decode GFLOP/step", 1e-9),
    ("roofline.achieved_gbs", "decode GB/s"),
    ("roofline.pct_of_bandwidth", "% of bandwidth"),
]


def finish(
    args: argparse.Namespace,
    engine,
    result: dict,
    runs: dict,
    name: str,
    extra_rows: Sequence[tuple] = (),
) -> int:
    """Put run_repeated's `runs` into `result`, print the summary over the timed runs
    (SUMMARY_ROWS, extra_rows, ROOFLINE_ROWS), write the JSON (--json) and the TTFT / ITL plot
    (--plot, titled 'rosejax <name>: ...'). Returns 0 (the exit status)."""
    series = runs.pop("series")
    result.update(runs)
    result["engine"]["num_compiles_at_end"] = engine.num_compiles
    print_runs_summary(
        result["summary"], len(result["runs"]), [*SUMMARY_ROWS, *extra_rows, *ROOFLINE_ROWS]
    )
    write_json(args.json, result)
    if args.plot:
        plot_distributions(
            args.plot,
            series,
            f"rosejax {name}: {args.num_requests} requests, {args.max_new_tokens} new, "
            f"max batch {args.max_batch_size}, {result['environment'].get('device')}",
        )
    return 0


def trace_lists(traces: Sequence[RequestTrace]) -> dict[str, list]:
    """Per-request raw figures (for the JSON and plots): ms, in request order."""

    def ms(v):
        return None if v is None else v * 1e3

    return {
        "prompt_tokens": [t.prompt_tokens for t in traces],
        "completion_tokens": [t.num_tokens for t in traces],
        "ttft_ms": [ms(m.ttft(t)) for t in traces],
        "tpot_ms": [ms(m.tpot(t)) for t in traces],
        "e2e_ms": [ms(m.e2e(t)) for t in traces],
    }


# ------------------------------------------------------------------------- environment, IO


def _git(*cmd: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except Exception:
        return None


def environment(engine=None) -> dict[str, Any]:
    """Where and when this ran: versions, device, git commit (and whether the tree was dirty)."""
    env: dict[str, Any] = {
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "argv": sys.argv,
        "git_commit": _git("rev-parse", "--short", "HEAD"),
    }
    # A copy of the tree without its history (as on the lent GPU machines) has no commit: then
    # "dirty" means nothing, so it is left None.
    env["git_dirty"] = bool(_git("status", "--porcelain")) if env["git_commit"] else None
    if getattr(engine, "device_kind", None):  # replicas in engine processes: their devices
        import jax  # (jax's backend here would take GPU memory from them)

        env.update(jax=jax.__version__, backend=engine.platform, device=engine.device_kind)
    elif "jax" in sys.modules:
        import jax

        dev = jax.devices()[0]
        env.update(
            jax=jax.__version__,
            backend=jax.default_backend(),
            device=getattr(dev, "device_kind", str(dev)),
        )
    if engine is not None:
        import dataclasses

        import numpy as np

        env.update(
            dtype=np.dtype(engine.dtype).name,
            config=dataclasses.asdict(engine.config),
            kernels=dataclasses.asdict(engine.kernels) if hasattr(engine, "kernels") else None,
            max_batch_size=getattr(engine, "max_batch_size", None),
            block_size=getattr(engine, "block_size", None),
            decode_steps=getattr(engine, "decode_steps", None),
        )
    return env


def report_kernel_bench(path: str | None, rows: list[dict], **extra) -> None:
    """A kernel microbench's ending: the device line, then {"device", **extra, "rows"} as JSON
    to `path` (if given)."""
    import jax

    device = jax.devices()[0].device_kind
    print(f"\ndevice: {device}, jax {jax.__version__}")
    write_json(path, {"device": device, **extra, "rows": rows})


def write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(f"wrote {path}", file=sys.stderr)


def random_hf_model(model_type: str, seed: int = 0, **config: Any) -> Any:
    """A random HF causal LM of `model_type` (qwen3, llama, qwen2, gpt2) built from
    `config` after `torch.manual_seed(seed)`, in eval mode, its norms drawn around 1 and its
    biases around 0 (HF starts them at 1 and 0, which would hide a missing or swapped one). No
    bos or eos id unless `config` gives one: HF's min_new_tokens would mask an eos logit inside a
    small vocabulary. torch and transformers are imported here: only references need them."""
    import torch
    import transformers

    name = {"qwen3": "Qwen3", "llama": "Llama", "qwen2": "Qwen2", "gpt2": "GPT2"}[model_type]
    config_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(
        transformers, f"{name}LMHeadModel" if name == "GPT2" else f"{name}ForCausalLM"
    )
    torch.manual_seed(seed)
    config = dict(bos_token_id=None, eos_token_id=None) | config
    model = model_cls(config_cls(**config)).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0.0, 0.3)
            elif "norm" in param_name or ".ln_" in param_name:  # GPT-2's ln_1, ln_2, ln_f
                param.normal_(1.0, 0.3)
    return model


def load_pyplot():
    """matplotlib's pyplot on the Agg backend, imported only when a plot is asked for."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e}); pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt: Any, fig: Any, path: str, title: str | None = None) -> None:
    """Title `fig` (if a title is given), write it to `path` as a PNG and close it."""
    if title is not None:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


def plot_distributions(path: str, series: dict[str, dict[str, list]], title: str) -> None:
    """TTFT and ITL: a histogram and a CDF each. `series`: label -> {'ttft_ms': [...],
    'itl_ms': [...]} (one label per run or per engine)."""
    import numpy as np

    plt = load_pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for row, key in enumerate(("ttft_ms", "itl_ms")):
        for label, data in series.items():
            vals = np.asarray([v for v in data.get(key, []) if v is not None], float)
            if vals.size == 0:
                continue
            axes[row, 0].hist(vals, bins=50, alpha=0.6, label=label)
            xs = np.sort(vals)
            axes[row, 1].plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label)
        name = key[:-3].upper()
        axes[row, 0].set(xlabel=f"{name} (ms)", ylabel="count", title=f"{name} histogram")
        axes[row, 1].set(xlabel=f"{name} (ms)", ylabel="fraction <= x", title=f"{name} CDF")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    save_figure(plt, fig, path, title)


def plot_throughput(
    path: str,
    batch_sizes: Sequence[int],
    curves: dict[str, list],
    title: str,
    ylabel: str = "tokens / s",
) -> None:
    """Throughput vs batch size, one line per engine (None values skipped), log-log."""
    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for label, ys in curves.items():
        pts = [(b, y) for b, y in zip(batch_sizes, ys, strict=True) if y]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel=ylabel, title=title)
    ax.set_xticks(list(batch_sizes), [str(b) for b in batch_sizes])
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    save_figure(plt, fig, path)
