"""Tensor parallelism on several GPUs: TP=1 against TP=N greedy tokens, B=1 TPOT, and one engine
over N processes (jax.distributed) against one process; one JSON in --out-dir.

1. processes: `python -m rosejax.generate` as N processes, one GPU each (CUDA_VISIBLE_DEVICES),
   joined by `jax.distributed` at TP=N, against the same command as one process at TP=N and at
   TP=1 (run first, while this process holds no GPU).
2. parity: per model and dtype, N random-id prompts served greedily at TP=1, then at TP=N: how
   many requests' tokens are equal, and where the first differing one parts.
3. tpot: one request (B=1) of --tpot-new-tokens on --tpot-model (default Llama-3.1-8B's shape,
   random bf16 weights) at TP=1 and TP=N in this process, one engine at a time: TPOT median
   over --repeat-runs after a warm-up run, and TP=N / TP=1.

On two H100s:  JAX_PLATFORMS=cuda python bench/benchmark_parallel.py --out-dir OUT
On a CPU (smoke test, four host devices):
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python bench/benchmark_parallel.py \\
        --out-dir OUT --parity-models random:tiny --tpot-model random:tiny-qwen3 --skip-processes
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time

import numpy as np

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench import metrics as m  # noqa: E402
from bench.serving.launch import free_port  # noqa: E402

REPO = common.REPO


def build_parser() -> argparse.ArgumentParser:
    p = common.new_parser(__doc__)
    p.add_argument("--out-dir", required=True, help="where benchmark_parallel.json goes")
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel size against TP=1")
    p.add_argument(
        "--parity-models",
        default="random:gpt2,random:qwen3-0.6b",
        help="comma-separated models whose greedy tokens are compared",
    )
    p.add_argument(
        "--parity-dtypes",
        default="float32,float16",
        help="comma-separated dtypes the parity runs in",
    )
    p.add_argument("--parity-prompts", type=int, default=16, help="prompts per parity run")
    p.add_argument("--parity-new-tokens", type=int, default=64, help="tokens per parity request")
    p.add_argument("--tpot-model", default="random:llama-3.1-8b", help="the TPOT run's model")
    p.add_argument("--tpot-dtype", default="bfloat16", help="the TPOT run's dtype")
    p.add_argument("--tpot-prompt-tokens", type=int, default=128, help="its prompt length")
    p.add_argument("--tpot-new-tokens", type=int, default=256, help="tokens it generates")
    p.add_argument("--repeat-runs", type=int, default=3, help="timed TPOT runs per size")
    p.add_argument("--process-model", default="random:gpt2", help="the multi-process run's model")
    p.add_argument("--max-model-len", type=int, default=1024, help="context of every engine")
    for name in ("processes", "parity", "tpot"):
        p.add_argument(f"--skip-{name}", action="store_true", help=f"leave out the {name} check")
    p.add_argument(
        "--compilation-cache-dir",
        default=None,
        help="jax's persistent compilation cache; default: rosejax's",
    )
    return p


def _engine_kwargs(args, tp: int, dtype: str, max_batch_size: int) -> dict:
    kwargs = dict(
        tensor_parallel_size=tp,
        dtype=dtype,
        max_batch_size=max_batch_size,
        max_model_len=args.max_model_len,
        kv_cache_tokens=max_batch_size * args.max_model_len,
        warmup=False,
    )
    if args.compilation_cache_dir:
        kwargs["compilation_cache_dir"] = args.compilation_cache_dir
    return kwargs


def _first_difference(a: list[list[int]], b: list[list[int]]) -> dict:
    equal = sum(x == y for x, y in zip(a, b, strict=True))
    parts = [
        next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), None)
        for x, y in zip(a, b, strict=True)
        if x != y
    ]
    return {"requests": len(a), "equal_requests": equal, "first_differences_at": parts}


# ------------------------------------------------------------------------------- processes


def _generate_command(args, tp: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rosejax.generate",
        "--model",
        args.process_model,
        "--prompt",
        "Hello, my name is",
        "--prompt",
        "The capital of France is",
        "--max-new-tokens",
        "64",
        "--ignore-eos",
        "--no-warmup",
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-tokens",
        str(4 * args.max_model_len),
        "--tensor-parallel-size",
        str(tp),
        *extra,
    ]


def _text(stdout: str) -> str:
    """The generated text: without the line gloo prints on connecting (CPU runs)."""
    return "".join(line for line in stdout.splitlines(True) if not line.startswith("[Gloo]"))


def _run(cmd: list[str], env: dict) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return _text(proc.stdout)


def check_processes(args) -> dict:
    """N processes of one GPU each, then one process of N GPUs and one of one GPU."""
    env = os.environ | {"PYTHONPATH": REPO}
    address = f"127.0.0.1:{free_port()}"
    start = time.perf_counter()
    procs = []
    for i in range(args.tp):
        cmd = _generate_command(
            args,
            args.tp,
            "--distributed-coordinator-address",
            address,
            "--num-processes",
            str(args.tp),
            "--process-id",
            str(i),
        )
        # One GPU each (on a CPU, one host device each: XLA_FLAGS without the device count).
        child = env | {"CUDA_VISIBLE_DEVICES": str(i), "XLA_FLAGS": ""}
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=child, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"a distributed process failed:\n{err[-3000:]}")
    seconds = time.perf_counter() - start
    texts = [_text(out) for out, _ in outs]
    one_process_tp = _run(_generate_command(args, args.tp), env)
    one_process_tp1 = _run(_generate_command(args, 1), env)
    result = {
        "model": args.process_model,
        "processes": args.tp,
        "seconds": seconds,
        "process_0_text": texts[0],
        "others_print_nothing": all(t == "" for t in texts[1:]),
        "equal_to_one_process_same_tp": texts[0] == one_process_tp,
        "equal_to_one_process_tp1": texts[0] == one_process_tp1,
        "one_process_tp1_text": one_process_tp1,
    }
    print(
        f"processes: {args.tp} x 1 device == 1 x {args.tp} devices: "
        f"{result['equal_to_one_process_same_tp']}; == TP=1: {result['equal_to_one_process_tp1']}",
        file=sys.stderr,
    )
    return result


# ---------------------------------------------------------------------------------- parity


def _greedy_tokens(args, model: str, tp: int, dtype: str, prompts) -> tuple[list, float]:
    from rosejax import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, **_engine_kwargs(args, tp, dtype, max_batch_size=len(prompts)))
    params = SamplingParams(max_tokens=args.parity_new_tokens, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    del llm
    gc.collect()  # the engine's cache and params go before the next engine is built
    return tokens, seconds


def check_parity(args) -> list[dict]:
    import jax

    from rosejax.models import preset

    results = []
    for model in args.parity_models.split(","):
        vocab = preset(model.removeprefix("random:")).vocab_size
        rng = np.random.default_rng(0)
        lengths = rng.integers(4, 64, args.parity_prompts)
        prompts = [rng.integers(0, vocab, n).tolist() for n in lengths]
        for dtype in args.parity_dtypes.split(","):
            # float32 means float32 matmuls (no TF32) then; half precision is left as served.
            precision = "highest" if dtype == "float32" else None
            r = {"model": model, "dtype": dtype, "tp": args.tp}
            try:  # a failing pair is reported, and the others still run (a GPU call is dear)
                with jax.default_matmul_precision(precision):
                    one, s1 = _greedy_tokens(args, model, 1, dtype, prompts)
                    many, sn = _greedy_tokens(args, model, args.tp, dtype, prompts)
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}"
            if "error" in r:  # out of the handler: its traceback no longer holds the engine
                gc.collect()
                results.append(r)
                print(f"parity {model} {dtype} FAILED: {r['error']}", file=sys.stderr)
                continue
            r |= _first_difference(one, many)
            r |= {"seconds_tp1": s1, f"seconds_tp{args.tp}": sn}
            r["distinct_tokens"] = len({t for row in one for t in row})
            results.append(r)
            print(
                f"parity {model} {dtype}: {r['equal_requests']}/{r['requests']} requests equal "
                f"at TP={args.tp} and TP=1 (first differences at {r['first_differences_at']})",
                file=sys.stderr,
            )
    return results


# ------------------------------------------------------------------------------------ tpot


def _tpot(args, tp: int) -> dict:
    from rosejax import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(args.tpot_model, **_engine_kwargs(args, tp, args.tpot_dtype, max_batch_size=1))
    build = time.perf_counter() - start
    vocab = llm.engine.config.vocab_size
    prompt = np.random.default_rng(1).integers(0, vocab, args.tpot_prompt_tokens).tolist()
    params = SamplingParams(max_tokens=args.tpot_new_tokens, temperature=0.0, ignore_eos=True)
    runs, tokens = [], None
    for run in common.frozen_from(1, args.repeat_runs + 1):  # the first compiles
        traces, _ = common.run_workload(llm.engine, [prompt], params, progress=False)
        if run:
            runs.append(m.tpot(traces[0]) * 1e3)
        tokens = traces[0].num_tokens
    out = {
        "tp": tp,
        "build_seconds": build,
        "compile_seconds": llm.engine.compile_seconds,
        "tokens": tokens,
        "tpot_ms_runs": runs,
        "tpot_ms": statistics.median(runs),
        "environment": common.environment(llm.engine),
    }
    del llm
    gc.collect()
    print(f"tpot {args.tpot_model} TP={tp}: {out['tpot_ms']:.3f} ms ({runs})", file=sys.stderr)
    return out


def check_tpot(args) -> dict:
    one = _tpot(args, 1)
    many = _tpot(args, args.tp)
    ratio = many["tpot_ms"] / one["tpot_ms"]
    print(f"tpot TP={args.tp} / TP=1: {ratio:.3f}", file=sys.stderr)
    return {
        "model": args.tpot_model,
        "dtype": args.tpot_dtype,
        "tp1": one,
        "tpn": many,
        "ratio": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    result: dict = {"benchmark": "parallel", "args": vars(args)}
    out = os.path.join(args.out_dir, "benchmark_parallel.json")
    # The child processes first: this process has not started jax, so holds no GPU memory.
    if not args.skip_processes:
        result["processes"] = check_processes(args)
        common.write_json(out, result)
    from rosejax.settings import configure_process

    configure_process(args.compilation_cache_dir)
    import jax

    result["environment"] = common.environment()
    result["devices"] = [str(d) for d in jax.devices()]
    if not args.skip_parity:
        result["parity"] = check_parity(args)
        common.write_json(out, result)
    if not args.skip_tpot:
        result["tpot"] = check_tpot(args)
    common.write_json(out, result)
    print(f"wrote {out}", file=sys.stderr)
    return 1 if any("error" in r for r in result.get("parity", ())) else 0


if __name__ == "__main__":
    sys.exit(main())
