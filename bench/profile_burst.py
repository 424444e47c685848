"""The first step of a burst, by phase: --num-prompts requests added at once to an idle engine,
then the step that prefills them all and hands out their first tokens (the TTFT of a burst that
an engine pays in process and in a server alike), timed around the engine's parts. With
--groups G the burst comes in G equal groups, each added right before one step, as a server's
arrivals split a burst into G prefills; the phases are then summed over those G steps.

Each --variant NAME=FLAGS runs in processes of its own: FLAGS' leading VAR=VALUE words are its
environment (XLA flags are process-wide), the rest engine flags after this script's. Each of
--rounds runs every variant once (the order reversed every other round); a process runs one
untimed burst (it compiles), then --bursts timed ones, each of new prompts (the same in every
variant), greedy to --output-len tokens (--no-warmup: the untimed burst compiles only what a
burst needs; the heap is frozen after it, as a server's is once built). Phases, ms: `add` (the
requests added), `step` (the whole first step), `admit` (admission and the prefill's call),
`prefill_call` (the prefill program's call: on a GPU mostly XLA launching it), `decode_call`
(the first decode window's call), `harvest` (reading the prefill back, `wait` of it for the
device); and over the whole burst, `ttft` (the first add to the last request's first token) and
`burst` (to its last request's last token: what a burst's throughput sees). Prints each
process's medians, then each variant's over all its bursts beside the
first variant's, with the requests whose tokens differ from the first variant's; --json writes
it all; --trace-dir DIR writes a jax.profiler trace of each variant's first timed step
(DIR/NAME; a traced step is slower).

    # GPU: XLA's CUDA graphs updated only where parameters and results moved
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/profile_burst.py --max-batch-size 256 \\
        --kv-cache-tokens 131072 --no-warmup --compilation-cache-dir /tmp/jax-cache \\
        --variant base= --variant skip="XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    # A burst in three prefills (a server's) against one (in process)
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/profile_burst.py --max-batch-size 256 \\
        --kv-cache-tokens 131072 --no-warmup --variant one= --variant three="--groups 3"
    # CPU smoke run
    PYTHONPATH=. python bench/profile_burst.py --model random:tiny --max-batch-size 8 \\
        --bursts 2 --rounds 1 --variant a= --variant b="--decode-steps 4"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench import common  # noqa: E402

# The driver's flags, not passed to a variant's process.
DRIVER_FLAGS = ("--variant", "--rounds", "--json", "--trace-dir")
PHASES = ("add", "step", "admit", "prefill_call", "decode_call", "harvest", "wait", "ttft", "burst")
# The engine's parts timed inside the step: phase -> (attribute of the engine or "", method).
_TIMED = {
    "admit": ("", "_admit"),
    "prefill_call": ("runner", "prefill"),
    "decode_call": ("runner", "decode"),
    "harvest": ("", "_harvest"),
}


def build_parser() -> argparse.ArgumentParser:
    p = common.new_parser(__doc__)
    common.add_engine_args(p, max_batch_size=256)
    g = p.add_argument_group("burst")
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests a burst (default None: --max-batch-size)",
    )
    g.add_argument("--input-len", type=int, default=8, help="prompt tokens (random ids)")
    g.add_argument("--output-len", type=int, default=16, help="new tokens a request")
    g.add_argument("--bursts", type=int, default=5, help="timed bursts a process")
    g.add_argument(
        "--groups",
        type=int,
        default=1,
        help="the burst's requests come in this many equal groups, each added before one step",
    )
    g = p.add_argument_group("variants")
    g.add_argument(
        "--variant",
        type=common.variant,
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a process to compare: NAME, then its environment's VAR=VALUE words and its engine "
        "flags (repeatable; NAME= for this script's flags as given)",
    )
    g.add_argument("--rounds", type=int, default=2, help="processes a variant")
    g.add_argument(
        "--trace-dir",
        default=None,
        help="a profiler trace of each variant's first timed burst, up to its last group's step",
    )
    g.add_argument("--json", default=None, metavar="PATH", help="write every figure here")
    g.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)  # one process's run
    return p


# ---------------------------------------------------------------------------- one process


def time_phases(engine: Any, totals: dict[str, float]) -> None:
    """Wrap the engine's `_TIMED` parts so each call adds its seconds to `totals[phase]`."""
    for phase, (owner, name) in _TIMED.items():
        obj = getattr(engine, owner) if owner else engine
        fn = getattr(obj, name)

        def timed(*a, _fn=fn, _phase=phase, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_phase] += time.perf_counter() - t0

        setattr(obj, name, timed)


def burst_prompts(args: argparse.Namespace, burst: int, vocab: int) -> list[list[int]]:
    """Burst `burst`'s prompts: random ids, the same in every process."""
    rng = np.random.default_rng([args.seed, burst])
    return rng.integers(0, vocab, (args.num_prompts, args.input_len)).tolist()


def take(outputs: Sequence[Any], out: dict[str, list[int]], first: dict[str, float]) -> None:
    """A step's outputs into `out` (request -> its tokens so far) and `first` (request -> when
    its first token was out)."""
    now = time.perf_counter()
    for o in outputs:
        out[o.request_id] = o.outputs[0].token_ids
        if o.outputs[0].token_ids:
            first.setdefault(o.request_id, now)


def run_bursts(args: argparse.Namespace, trace_dir: str | None) -> dict[str, Any]:
    """This process's run: an untimed burst, then --bursts timed ones. Returns each timed
    burst's phases (ms) and every request's tokens."""
    import jax

    from rosejax.sampling import SamplingParams

    common.configure_process(args.compilation_cache_dir)  # before the backend starts
    engine, build_s = common.make_engine(args, engine_process=False)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    totals: dict[str, float] = collections.defaultdict(float)
    time_phases(engine, totals)
    phases, tokens = [], []
    for burst in range(1 + args.bursts):
        prompts = burst_prompts(args, burst, engine.config.vocab_size)
        totals.clear()
        waited = engine.host_seconds["wait"]
        traced = trace_dir is not None and burst == 1
        if traced:
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        t0 = time.perf_counter()
        out: dict[str, list[int]] = {}
        first: dict[str, float] = {}  # request -> when its first token was out
        add_s = step_s = 0.0
        for group in np.array_split(np.arange(len(prompts)), args.groups):
            t1 = time.perf_counter()
            for i in group:
                engine.add_request(f"{burst}-{i}", prompts[i], params)
            t2 = time.perf_counter()
            take(engine.step(), out, first)
            add_s, step_s = add_s + t2 - t1, step_s + time.perf_counter() - t2
        if traced:
            jax.profiler.stop_trace()
        # The groups' steps' (a part they never called: 0), before the rest's.
        ms = {k: 1e3 * totals[k] for k in _TIMED}
        ms |= {"add": 1e3 * add_s, "step": 1e3 * step_s}
        ms["wait"] = 1e3 * (engine.host_seconds["wait"] - waited)
        ms["first_tokens"] = len(first)
        while engine.has_unfinished_requests():
            take(engine.step(), out, first)
        ms["ttft"] = 1e3 * (max(first.values()) - t0)
        ms["burst"] = 1e3 * (time.perf_counter() - t0)
        if burst == 0:  # compiled: out of the collector's view, as a server's heap
            common.freeze_heap()
            continue
        phases.append(ms)
        tokens.append([list(out[f"{burst}-{i}"]) for i in range(len(prompts))])
    env = common.environment(engine)
    return {"build_seconds": build_s, "phases": phases, "tokens": tokens, "environment": env}


# ---------------------------------------------------------------------------- the driver


def run_process(argv: Sequence[str], v: common.Variant, trace_dir: str | None) -> dict[str, Any]:
    """One process of variant `v` (this script, `argv` then the variant's flags); its result."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, *shlex.split(v.flags)]
        cmd += ["--worker-json", path] + (["--trace-dir", trace_dir] if trace_dir else [])
        env = common.child_env(v.env)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=common.REPO)
        if proc.returncode:
            raise RuntimeError(
                f"variant {v.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        with open(path) as f:
            return json.load(f)


def medians(phases: Sequence[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(p[k] for p in phases) for k in PHASES}


def row(label: str, med: dict[str, float], base: dict[str, float] | None = None) -> str:
    text = f"{label:<22}" + " ".join(f"{k} {med[k]:7.2f}" for k in PHASES)
    if base:
        ratios = ("step", "prefill_call", "ttft", "burst")
        text += "  | " + ", ".join(f"{k} {med[k] / base[k]:.3f}x" for k in ratios)
    return text


def driver_argv(argv: Sequence[str]) -> list[str]:
    """This script's argv for a variant's process: without the driver's own flags."""
    return [a for a in argv if not a.startswith(tuple(f"{f}=" for f in DRIVER_FLAGS))]


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    glued = common.glue_flag_values(argv, DRIVER_FLAGS)
    args = p.parse_args(glued)
    args.num_prompts = args.num_prompts or args.max_batch_size
    if (
        args.num_prompts > args.max_batch_size
        or min(args.bursts, args.input_len, args.output_len, args.groups) < 1
        or args.groups > args.num_prompts
    ):
        p.error(
            "--num-prompts must fit in --max-batch-size; --bursts, --input-len, --output-len, "
            "--groups >= 1, --groups <= --num-prompts"
        )
    if args.data_parallel_size > 1:
        p.error("one engine in a process: --data-parallel-size 1")
    if args.worker_json:
        result = run_bursts(args, args.trace_dir)
        common.write_json(args.worker_json, result)
        return 0
    names = [v.name for v in args.variant]
    if not names or len(set(names)) != len(names) or args.rounds < 1:
        p.error("give each --variant NAME once, at least one, and --rounds >= 1")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r, v in common.run_order(args.variant, args.rounds):
        trace = os.path.join(args.trace_dir, v.name) if args.trace_dir and r == 0 else None
        # One workload for all: the burst's size given, whatever a variant's batch size.
        res = run_process([*driver_argv(glued), f"--num-prompts={args.num_prompts}"], v, trace)
        runs[v.name].append(res)
        print(row(f"round {r} {v.name}", medians(res["phases"])), flush=True)
    print(f"medians over {args.rounds} x {args.bursts} bursts of {args.num_prompts} requests")
    base_tokens = runs[names[0]][0]["tokens"]
    base = None
    result: dict[str, Any] = {"benchmark": "profile_burst", "variants": {}}
    for v in args.variant:
        med = medians([ph for res in runs[v.name] for ph in res["phases"]])
        base = base or med
        differ = sum(
            a != b
            for res in runs[v.name]
            for burst, ref in zip(res["tokens"], base_tokens, strict=True)
            for a, b in zip(burst, ref, strict=True)
        )
        print(row(v.name, med, base if v.name != names[0] else None) + f"  | {differ} differ")
        result["variants"][v.name] = {
            "flags": v.flags,
            "env": v.env,
            "median": med,
            "requests_differing": differ,
            "runs": [{k: res[k] for k in ("build_seconds", "phases")} for res in runs[v.name]],
        }
    result["args"] = {k: str(val) for k, val in vars(args).items()}
    result["environment"] = runs[names[0]][0]["environment"]
    common.write_json(args.json, result)
    return 0 if all(x["requests_differing"] == 0 for x in result["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
