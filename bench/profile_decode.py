"""Where a decode step's time goes: rosejax's engine against its own parts, at one batch size.

Runs B requests of P-token prompts and N new tokens through the engine 1 + --timed-runs times for
each `decode_steps` value given (the first run compiles) and reports the median timed run: ms per
decode step (and each run's) and tokens/s, the step's least bytes (bench/metrics.py) against the
card's copy bandwidth, the host's dispatch/wait/harvest seconds over the timed runs, and a
jax.profiler trace of the first timed run when --trace-dir is set (a traced run is slower: read
its kernel shares, not its times). Requests are greedy unless --temperature/--top-k/--top-p say
otherwise (the sampled decode program); --logprobs N: every request asks for N alternatives (the
decode program with the extras, and the host reading logprobs back).

The engine's kernels are a `KernelConfig` built from the engine's own flags: --kernel FIELD=VALUE
(an op's implementation, a threshold) and --kernel-tile OP.PARAM=INT, a keyword every call of
one op's kernels gets (a tile size, warps, stages), checked here against the kernels' keyword
parameters, so a sweep needs no edit of the kernels' defaults:

    python bench/profile_decode.py --batch 1 --decode-steps 32 \
        --kernel-tile layer_norm.block_rows=4 --kernel-tile layer_norm.num_warps=4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import metrics as m  # noqa: E402
from bench.common import configure_process, copy_bandwidth_gbs, frozen_from  # noqa: E402
from rosejax import EngineConfig, KernelConfig, LLMEngine, SamplingParams  # noqa: E402
from rosejax.engine_args import (  # noqa: E402
    add_draw_args,
    add_kernel_args,
    add_logprobs_arg,
    draw_fields,
    kernel_overrides,
)


def resolve_kernels(
    p: argparse.ArgumentParser, settings: list[tuple[str, str]], tiles: list[tuple[str, str, int]]
) -> KernelConfig:
    """The backend's KernelConfig with --kernel / --kernel-tile applied (p.error if a value is
    bad). Starts jax's backend (after setting rosejax's XLA flags)."""
    try:
        return KernelConfig.for_backend(**dict(kernel_overrides(settings, tiles)))
    except ValueError as e:
        p.error(str(e))


def engine_config(
    model: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    block_size: int,
    decode_steps: int,
    kernels: KernelConfig | None = None,
    /,
    **fields,
) -> EngineConfig:
    """An fp16 engine's config for `batch` concurrent requests of this shape (KV for all of
    them), with `kernels` (None: the backend's defaults) and any other EngineConfig `fields`,
    which override the shape's (a variant's block_size, say)."""
    values = dict(
        dtype="float16",
        max_batch_size=batch,
        block_size=block_size,
        decode_steps=decode_steps,
        warmup=False,
        kernels=kernels,
    )
    values |= fields
    if values.get("kv_cache_memory_fraction") is None:
        values.setdefault(
            "kv_cache_tokens", batch * (prompt_len + new_tokens + 2 * values["block_size"])
        )
    return EngineConfig(model=model, **values)


def make_engine(*args, **kwargs) -> LLMEngine:
    """The engine of `engine_config(*args, **kwargs)`."""
    return LLMEngine(engine_config(*args, **kwargs))


def timed_run(
    engine: LLMEngine,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    rng: np.random.Generator,
    tag: object,
    **sampling: Any,
) -> tuple[float, float, int]:
    """`batch` requests of random `prompt_len`-token prompts, `new_tokens` tokens each (greedy
    unless `sampling`, SamplingParams fields, says otherwise), all at once -> (decode seconds:
    from every request holding its first token to the end, end-to-end seconds, tokens)."""
    params = SamplingParams(
        **({"temperature": 0.0} | sampling), max_tokens=new_tokens, ignore_eos=True
    )
    for i in range(batch):
        prompt = rng.integers(0, engine.config.vocab_size, prompt_len).tolist()
        engine.add_request(f"{tag}-{i}", prompt, params)
    t0 = time.perf_counter()
    decode_t = None
    tokens = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if decode_t is None and len(outs) == batch and all(len(o.token_ids) for o in outs):
            decode_t = time.perf_counter()
        tokens += sum(len(o.new_token_ids) for o in outs)
    t1 = time.perf_counter()
    return t1 - (decode_t or t0), t1 - t0, tokens


def add_workload_args(p: argparse.ArgumentParser, *, batch: int) -> None:
    """The requests `timed_run` sends (--model, --batch, --prompt-len, --new-tokens, greedy
    unless the draw's flags say otherwise) and the engine's --block-size."""
    p.add_argument("--model", default="random:gpt2", help="model to load (default: %(default)s)")
    p.add_argument(
        "--batch", type=int, default=batch, help="concurrent requests (default: %(default)s)"
    )
    p.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per request")
    p.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help="KV block size; default: %(default)s",
    )
    add_draw_args(p)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(p, batch=256)
    p.add_argument("--decode-steps", default="1,8,32", help="comma list of steps per device call")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the context the engine serves, if less than the model's (Llama-style models)",
    )
    p.add_argument(
        "--timed-runs",
        type=int,
        default=3,
        help="timed runs after the compiling one; the median is reported (a card's "
        "step time wanders by several %% between runs)",
    )
    p.add_argument(
        "--trace-dir", default=None, help="write a jax.profiler trace of the first timed run here"
    )
    add_logprobs_arg(p)
    add_kernel_args(p)
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args(argv)
    configure_process()  # before the backend starts: XLA flags set later are ignored
    kernels = resolve_kernels(p, args.kernel, args.kernel_tile)
    bw = copy_bandwidth_gbs()
    sampling = draw_fields(args) | {"logprobs": args.logprobs}  # every request's
    rows = []
    rng = np.random.default_rng(0)
    for k in [int(s) for s in args.decode_steps.split(",")]:
        engine = make_engine(
            args.model,
            args.batch,
            args.prompt_len,
            args.new_tokens,
            args.block_size,
            k,
            kernels,
            max_model_len=args.max_model_len,
        )
        runs = []  # (decode seconds, end-to-end seconds, tokens) of each timed run
        # the first run compiles what it meets; the timed ones run with the heap frozen
        for run in frozen_from(1, 1 + args.timed_runs):
            if run == 1:
                engine.host_seconds = dict.fromkeys(engine.host_seconds, 0.0)
            trace = run == 1 and args.trace_dir
            if trace:
                jax.profiler.start_trace(args.trace_dir, create_perfetto_trace=True)
            timed = timed_run(
                engine,
                args.batch,
                args.prompt_len,
                args.new_tokens,
                rng,
                run,
                **sampling,
            )
            if trace:
                jax.profiler.stop_trace()
            if run >= 1:
                runs.append(timed)
        steps = args.new_tokens - 1
        all_ms = [d / steps * 1e3 for d, _, _ in runs]
        decode_s, e2e_s, tokens = sorted(runs)[len(runs) // 2]  # the median run
        ms = decode_s / steps * 1e3
        ctx = m.mean_decode_context(args.prompt_len, args.new_tokens)
        step_bytes = m.decode_step_bytes(engine.config, args.batch, ctx, engine.dtype.itemsize)
        gbs = step_bytes["total"] / (ms / 1e3) / 1e9
        row = dict(
            decode_steps=k,
            host_seconds={name: round(v, 3) for name, v in engine.host_seconds.items()},
            batch=args.batch,
            e2e_s=e2e_s,
            e2e_tok_s=tokens / e2e_s,
            decode_ms_per_step=ms,
            decode_ms_per_step_runs=[round(x, 4) for x in all_ms],
            decode_tok_s=args.batch * steps / decode_s,
            gbs=gbs,
            pct_copy_bw=100 * gbs / bw,
            compiles=engine.num_compiles,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\ncard: {jax.devices()[0].device_kind}, jax {jax.__version__}, copy bandwidth {bw:.0f} GB/s"
    )
    print(f"kernels: {kernels}")
    print(
        f"{'K':>4} {'ms/step':>9} {'decode tok/s':>13} {'e2e tok/s':>10} {'GB/s':>7} {'%bw':>5}"
        "  ms/step of each run"
    )
    for r in rows:
        print(
            f"{r['decode_steps']:>4} {r['decode_ms_per_step']:>9.3f} {r['decode_tok_s']:>13.0f} "
            f"{r['e2e_tok_s']:>10.0f} {r['gbs']:>7.0f} {r['pct_copy_bw']:>5.1f}  "
            + " ".join(f"{x:.3f}" for x in r["decode_ms_per_step_runs"])
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    rows=rows,
                    sampling=sampling,
                    copy_gbs=bw,
                    device=jax.devices()[0].device_kind,
                    kernels=dataclasses.asdict(kernels),
                    kernel_settings=[f"{name}={value}" for name, value in args.kernel],
                    kernel_tiles=[f"{o}.{p}={n}" for o, p, n in args.kernel_tile],
                ),
                f,
            )


if __name__ == "__main__":
    main()
