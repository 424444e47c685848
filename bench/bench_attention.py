"""Paged decode attention microbench: rosejax's Pallas kernel, jax's Pallas GPU paged_attention op,
the engine's chunked XLA path (`paged_decode_attention_xla`, per `--xla-chunk-pages`) and the XLA
gather reference, at GPT-2 dims (H=12, D=64, fp16) unless `--q-heads`, `--kv-heads`, `--head-dim`
and `--dtype` say otherwise (Qwen3-0.6B: 16, 8, 128, bfloat16). `--table-tokens` gives each row a
block table longer than its context, padded with scratch block 0 as the engine pads it (its max
model len): what the gather reference reads, and the chunked path does not.

Each implementation runs `--iters` times inside one jitted fori_loop (each output feeds the next
query), so Python dispatch stays out; median over `--repeats` calls. GB/s counts the K and V bytes
the rows attend (B x context x H x D x 2 x 2 bytes at 16 bits).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys

if __package__ in (None, ""):  # run as a file: make `bench` and `pallas_kernels` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    add_kernel_bench_args,
    parse_kernel_bench_args,
    report_kernel_bench,
    time_in_loop,
)
from pallas_kernels.paged_attention import (  # noqa: E402
    DEFAULT_MATRIX_MIN_GROUP,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from rosejax.layers.attention import paged_decode_attention_xla  # noqa: E402
from rosejax.settings import EngineConfig  # noqa: E402


def jax_op(q, k, v, tables, lengths, *, pages_per_compute_block, k_splits):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)  # the op does not scale
    return paged_attention(
        q,
        k,
        v,
        tables,
        jnp.maximum(lengths, 1),
        pages_per_compute_block=pages_per_compute_block,
        k_splits=k_splits,
    )


def impls(
    interpret: bool,
    hq: int,
    warps: list[int],
    stages: list[int],
    splits: list[int],
    matrix: list[int],
    heads: list[int],
    pages: list[int],
    chunk_pages: list[int],
) -> dict:
    out = {"xla": functools.partial(paged_decode_attention_reference, num_q_heads=hq)}
    for n in chunk_pages:
        out[f"xla_chunked_p{n}" if n else "xla_chunked"] = functools.partial(
            paged_decode_attention_xla, pages_per_chunk=n or None, num_q_heads=hq
        )
    for w, s, n, g, hp, pp in itertools.product(warps, stages, splits, matrix, heads, pages):
        if hp > 1 and not g:  # several heads a program only on the matrix units
            continue
        name = (
            f"rosejax_w{w}_s{s}"
            + (f"_k{n}" if n > 1 else "")
            + (f"_mma{g}" if g else "")
            + (f"_hp{hp}" if hp > 1 else "")
            + (f"_pp{pp}" if pp else "")
        )
        out[name] = functools.partial(
            paged_decode_attention,
            num_q_heads=hq,
            heads_per_program=hp,
            pages_per_tile=pp or None,
            num_warps=w,
            num_stages=s,
            num_splits=n,
            matrix_min_group=g,
            interpret=interpret,
        )
    if not interpret:
        out["jax_op_ppcb4"] = functools.partial(jax_op, pages_per_compute_block=4, k_splits=1)
        out["jax_op_ppcb8_ks4"] = functools.partial(jax_op, pages_per_compute_block=8, k_splits=4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch-sizes", default="1,16,64,256", help="comma list of B")
    p.add_argument("--contexts", default="136,512", help="comma list of tokens per row")
    p.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help="tokens per KV block; default: the engine's, %(default)s",
    )
    p.add_argument("--num-warps", default="1,2,4,8", help="comma list of the kernel's warps")
    p.add_argument("--num-stages", default="2", help="comma list of the kernel's pipeline stages")
    p.add_argument(
        "--num-splits",
        default="1",
        help="comma list of the kernel's splits of each row's pages (split-K; the merge kernel "
        "after it is timed with it)",
    )
    p.add_argument(
        "--matrix-min-group",
        default=str(DEFAULT_MATRIX_MIN_GROUP),
        help="comma list of the kernel's matrix_min_group (groups of at least this many query "
        "heads on the matrix units; 0: vector arithmetic)",
    )
    p.add_argument(
        "--heads-per-program",
        default="1",
        help="comma list of the kernel's heads_per_program (KV heads a program attends; above 1 "
        "on the matrix units only)",
    )
    p.add_argument(
        "--pages-per-tile",
        default="0",
        help="comma list of the kernel's pages_per_tile (pages of each head a loop trip loads; "
        "0: the kernel's default for the batch and page size)",
    )
    p.add_argument("--q-heads", type=int, default=12, help="query heads (Hq)")
    p.add_argument("--kv-heads", type=int, default=12, help="KV heads (H), dividing Hq")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (D)")
    p.add_argument("--dtype", default="float16", help="q and cache dtype (float16, bfloat16)")
    p.add_argument("--no-jax-op", action="store_true", help="skip jax's paged_attention op")
    p.add_argument(
        "--no-xla",
        action="store_true",
        help="skip the XLA paths (compiling them with the caches as constants takes minutes at "
        "256 rows); the reference still checks every kernel's output",
    )
    p.add_argument(
        "--xla-chunk-pages",
        default="0",
        help="comma list of the chunked XLA path's pages per chunk (0: its default)",
    )
    p.add_argument(
        "--table-tokens",
        type=int,
        default=0,
        help="tokens each row's block table covers, past the context in scratch block 0 "
        "(the engine's max model len, e.g. 40960); 0: the context",
    )
    add_kernel_bench_args(p)
    args = parse_kernel_bench_args(p)
    interpret = args.quick or jax.default_backend() == "cpu"
    hq, h, d, bs = args.q_heads, args.kv_heads, args.head_dim, args.block_size
    dtype = jnp.dtype(args.dtype)
    sizes = [
        (b, c)
        for b in map(int, args.batch_sizes.split(","))
        for c in map(int, args.contexts.split(","))
    ]
    if args.quick:
        sizes, args.iters, args.repeats = [(2, 20)], 2, 1
    rng = np.random.default_rng(0)
    rows = []
    for b, ctx in sizes:
        mb = -(-ctx // bs)
        nb = 1 + b * mb
        k = jnp.asarray(rng.normal(size=(h, nb, bs, d)), dtype)
        v = jnp.asarray(rng.normal(size=(h, nb, bs, d)), dtype)
        live = 1 + rng.permutation(nb - 1).reshape(b, mb)
        tables = np.zeros((b, max(mb, -(-args.table_tokens // bs))), np.int32)
        tables[:, :mb] = live
        tables = jnp.asarray(tables)
        lengths = jnp.full((b,), ctx, jnp.int32)
        q = jnp.asarray(rng.normal(size=(b, hq, d)), dtype)
        ref = paged_decode_attention_reference(
            q, k, v, jnp.asarray(live, jnp.int32), lengths, num_q_heads=hq
        )
        ref = np.asarray(ref, np.float32)
        bytes_ = b * ctx * h * d * 2 * dtype.itemsize
        variants = impls(
            interpret,
            hq,
            [int(w) for w in args.num_warps.split(",")],
            [int(s) for s in args.num_stages.split(",")],
            [int(n) for n in args.num_splits.split(",")],
            [int(n) for n in args.matrix_min_group.split(",")],
            [int(n) for n in args.heads_per_program.split(",")],
            [int(n) for n in args.pages_per_tile.split(",")],
            [int(n) for n in args.xla_chunk_pages.split(",")],
        )
        if args.no_jax_op:
            variants = {n: f for n, f in variants.items() if not n.startswith("jax_op")}
        if args.no_xla:
            variants = {n: f for n, f in variants.items() if not n.startswith("xla")}
        for name, fn in variants.items():
            try:
                got = np.asarray(fn(q, k, v, tables, lengths), np.float32)
            except Exception as e:  # jax's op refuses some page counts under Triton lowering
                print(f"B={b:4d} ctx={ctx:4d} {name:18s} failed: {str(e).splitlines()[0][:100]}")
                continue
            err = float(np.abs(got - ref).max())
            us = time_in_loop(fn, q, k, v, tables, lengths, iters=args.iters, repeats=args.repeats)
            rows.append(
                dict(
                    B=b,
                    context=ctx,
                    q_heads=hq,
                    kv_heads=h,
                    head_dim=d,
                    table_tokens=tables.shape[1] * bs,
                    block_size=bs,
                    impl=name,
                    us=us,
                    gbs=bytes_ / us / 1e3,
                    max_err=err,
                )
            )
            print(
                f"B={b:4d} ctx={ctx:4d} {name:18s} {us:9.2f} us {bytes_ / us / 1e3:8.1f} GB/s  err {err:.1e}",
                flush=True,
            )
    report_kernel_bench(args.json, rows)


if __name__ == "__main__":
    main()
