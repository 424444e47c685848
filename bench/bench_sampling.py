"""Sampling microbench: `rosejax.sampling.sample` at B rows x V tokens for each filter setting,
beside the engine's greedy step (an argmax) in the same run.

Each step is a [B, H] x [H, V] head and then the draw, `--iters` steps inside one jitted
fori_loop (bench.common.time_in_loop), each step's tokens feeding the next step's hidden state so
every step sees new logits. The head is in both, so `over argmax` is what a setting costs beyond
greedy decoding. Random weights: every row is flat unless the case scales its logits up
("peaked": a nucleus the 64 candidates hold).

    # GPU: Qwen3's vocabulary at 16 and 256 rows
    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/bench_sampling.py --batch 16,256 --vocab 151936
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: make `bench` and `rosejax` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.common import (  # noqa: E402
    add_kernel_bench_args,
    ints,
    parse_kernel_bench_args,
    report_kernel_bench,
    time_in_loop,
)
from rosejax.sampling import sample  # noqa: E402

# name: (logit scale, temperature, top_k, top_p); "argmax" is the baseline, "greedy" the same
# through `sample` (temperature 0: what a greedy row of a sampling program pays).
CASES = {
    "argmax": (1.0, 0.0, 0, 1.0),
    "greedy": (1.0, 0.0, 0, 1.0),
    "temperature": (1.0, 0.7, 0, 1.0),
    "top_k=50": (1.0, 1.0, 50, 1.0),
    "qwen3: t 0.6 k 20 p 0.95": (1.0, 0.6, 20, 0.95),
    "top_p=0.9 peaked": (6.0, 1.0, 0, 0.9),
    "top_p=0.9 flat": (1.0, 1.0, 0, 0.9),
    "top_k=200": (1.0, 1.0, 200, 1.0),
}


def step_fn(case: str):
    """One step: h [B, H] -> the head's logits -> tokens -> the next h (tokens fold back in)."""
    scale = CASES[case][0]

    def step(h, w, *params):
        logits = (h @ w) * jnp.asarray(scale, w.dtype)  # [B, V]
        if case == "argmax":
            tokens = jnp.argmax(logits, axis=1).astype(jnp.int32)
        else:
            tokens = sample(logits, *params)
        return h + ((tokens % 7)[:, None] * 1e-3).astype(h.dtype)

    return step


def sampling_params(batch: int, case: str) -> tuple[jax.Array, ...]:
    """The case's per-row sampling arrays, as the engine hands them to `sample`."""
    _, temperature, top_k, top_p = CASES[case]
    return (
        jnp.full((batch,), temperature, jnp.float32),
        jnp.full((batch,), top_k, jnp.int32),
        jnp.full((batch,), top_p, jnp.float32),
        jnp.arange(batch, dtype=jnp.uint32),  # seeds
        jnp.zeros((batch,), jnp.int32),  # steps
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=ints, default=[16, 256], help="comma list of B (rows)")
    p.add_argument(
        "--vocab", type=int, default=151_936, help="V (Qwen3's: 151,936; GPT-2's 50,257)"
    )
    p.add_argument("--hidden", type=int, default=1024, help="H, the head's input width")
    p.add_argument("--dtype", default="bfloat16", help="the head's and so the logits' dtype")
    p.add_argument(
        "--cases", default=",".join(CASES), help="comma list of cases (argmax always runs)"
    )
    add_kernel_bench_args(p)
    args = parse_kernel_bench_args(p)
    cases = ["argmax", *(c for c in args.cases.split(",") if c != "argmax")]
    if unknown := [c for c in cases if c not in CASES]:
        p.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if args.quick:
        args.batch, args.vocab, args.hidden, args.iters, args.repeats = [4], 1000, 32, 2, 1
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    w = (jax.random.normal(k1, (args.hidden, args.vocab)) * args.hidden**-0.5).astype(args.dtype)
    rows = []
    for b in args.batch:
        h = jax.random.normal(k2, (b, args.hidden)).astype(args.dtype)
        base = None
        for case in cases:
            us = time_in_loop(
                step_fn(case),
                h,
                w,
                *sampling_params(b, case),
                iters=args.iters,
                repeats=args.repeats,
            )
            base = us if base is None else base
            rows.append(dict(batch=b, vocab=args.vocab, case=case, us=us, over_argmax_us=us - base))
            print(
                f"B={b:4d} V={args.vocab} {case:28s} {us:9.2f} us  {us - base:+9.2f} us over argmax"
            )
    report_kernel_bench(args.json, rows, args=vars(args))


if __name__ == "__main__":
    main()
