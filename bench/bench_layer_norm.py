"""Layer norm microbench: rosejax's Pallas kernel (block rows x warps) against XLA's two kernels
(pallas_kernels.layer_norm.layer_norm_reference) and flax's nn.LayerNorm, fp16, E = GPT-2's 768.

Each implementation runs `--iters` times inside one jitted fori_loop (bench.common.time_in_loop);
GB/s counts x read once and y written once.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

if __package__ in (None, ""):  # run as a file: make `bench` and `pallas_kernels` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    add_kernel_bench_args,
    ints,
    parse_kernel_bench_args,
    report_kernel_bench,
    time_in_loop,
)
from pallas_kernels.layer_norm import layer_norm, layer_norm_reference  # noqa: E402


def flax_layer_norm(x, scale, bias):
    params = {"params": {"scale": scale, "bias": bias}}
    return nn.LayerNorm(epsilon=1e-5, dtype=x.dtype).apply(params, x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=ints, default=[16, 256, 4096], help="comma list of N (rows)")
    p.add_argument("--features", type=int, default=768, help="E, the normalized width")
    p.add_argument("--block-rows", type=ints, default=[1, 2, 4, 8], help="kernel rows/program")
    p.add_argument("--num-warps", type=ints, default=[1, 2, 4, 8], help="kernel warps")
    add_kernel_bench_args(p)
    args = parse_kernel_bench_args(p)
    interpret = args.quick or jax.default_backend() == "cpu"
    if args.quick:
        args.rows, args.block_rows, args.num_warps, args.iters, args.repeats = [5], [4], [4], 2, 1
    rng = np.random.default_rng(0)
    e = args.features
    scale = jnp.asarray(rng.normal(size=e), jnp.float16)
    bias = jnp.asarray(rng.normal(size=e), jnp.float16)
    impls = {"xla": layer_norm_reference, "flax": flax_layer_norm}
    for r in args.block_rows:
        for w in args.num_warps:
            impls[f"pallas_r{r}_w{w}"] = functools.partial(
                layer_norm, block_rows=r, num_warps=w, interpret=interpret
            )
    rows = []
    for n in args.rows:
        x = jnp.asarray(rng.normal(size=(n, e)), jnp.float16)
        want = np.asarray(layer_norm_reference(x, scale, bias), np.float32)
        for name, fn in impls.items():
            err = float(np.abs(np.asarray(fn(x, scale, bias), np.float32) - want).max())
            us = time_in_loop(fn, x, scale, bias, iters=args.iters, repeats=args.repeats)
            gbs = 2 * x.size * 2 / us / 1e3
            rows.append(dict(rows=n, features=e, impl=name, us=us, gbs=gbs, max_err=err))
            print(f"N={n:5d} {name:16s} {us:8.2f} us {gbs:7.1f} GB/s  err {err:.1e}", flush=True)
    report_kernel_bench(args.json, rows)


if __name__ == "__main__":
    main()
