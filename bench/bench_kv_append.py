"""Microbenchmark of the paged KV append: the XLA scatter against each Pallas kernel.

Each implementation is timed inside ONE jitted function that takes the per-layer caches
(donated, so nothing copies them) and runs `lax.fori_loop` over --iters iterations, each
appending one token to every one of --layers per-layer caches; Python dispatch is paid once per
call and vanishes in the division. Reported: the median over --repeats calls of microseconds per
layer-append, and the achieved GB/s (new K/V rows read + cache slots written + index arrays),
next to the copy bandwidth of the same card measured in the same run (a large device-to-device
negation, bytes read + written).

Targets are random duplicate-free (block, pos) slots in blocks 1.. (block 0 is the scratch
block); the full-batch form uses one random position shared by every row. Each implementation
is checked after timing: the slots of layer 0 must hold exactly the new rows.

    python bench/bench_kv_append.py --json bench/out/kv.json           # GPU: the full table
    python bench/bench_kv_append.py --quick                            # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
kva = importlib.import_module("pallas_kernels.kv_append")
common = importlib.import_module("bench.common")

XLA_IMPLS = ("xla_generic", "xla_identity", "xla_full")
KERNEL_IMPLS = ("generic", "identity_pos", "full_batch")
# Each kernel next to the XLA scatter of the same input form.
ALL_IMPLS = ("xla_generic", "generic", "xla_identity", "identity_pos", "xla_full", "full_batch")
FORM = {
    "xla_generic": "generic",
    "generic": "generic",
    "xla_identity": "identity",
    "identity_pos": "identity",
    "xla_full": "full",
    "full_batch": "full",
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _strs(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--batch",
        type=_ints,
        default=_ints("1,16,128,256,512,1024,2048"),
        help="comma list of batch sizes B (rows appended per layer)",
    )
    p.add_argument(
        "--block-size",
        type=_ints,
        default=_ints("64,16"),
        help="comma list of KV block sizes (tokens per block)",
    )
    p.add_argument(
        "--dtype", type=_strs, default=_strs("float16,bfloat16"), help="comma list of cache dtypes"
    )
    p.add_argument("--heads", type=int, default=12, help="number of heads H (GPT-2: 12)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D (GPT-2: 64)")
    p.add_argument(
        "--layers",
        type=int,
        default=12,
        help="per-layer caches appended to in each loop iteration (GPT-2: 12)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=100,
        help="fori_loop iterations per timed call (each appends to every layer)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=15,
        help="timed calls per configuration; the median is reported",
    )
    p.add_argument(
        "--impl",
        type=_strs,
        default=list(ALL_IMPLS),
        help=f"comma list of implementations, from {','.join(ALL_IMPLS)}",
    )
    p.add_argument(
        "--block-b",
        type=_ints,
        default=None,
        help="comma list of rows per program to sweep (kernels; default: the op's)",
    )
    p.add_argument(
        "--block-h",
        type=_ints,
        default=None,
        help="comma list of heads per program to sweep (kernels; default: the op's)",
    )
    p.add_argument(
        "--num-warps",
        type=_ints,
        default=None,
        help="comma list of Triton num_warps to sweep (kernels; default: the op's)",
    )
    p.add_argument(
        "--copy-mb",
        type=int,
        default=1024,
        help="size in MB of the device-to-device copy that measures bandwidth",
    )
    p.add_argument(
        "--interpret",
        choices=("auto", "yes", "no"),
        default="auto",
        help="run kernels in Pallas interpret mode (auto: only on a CPU backend)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: the test suite's small shapes (tests/test_kv_append.py "
        "CASES), 2 layers, 2 iterations, 1 repeat, an 8 MB copy",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="write every result, the card, jax version and command line here "
        "(rewritten after each configuration, so a killed run keeps its rows)",
    )
    args = common.parse_kernel_bench_args(p, argv)
    unknown = set(args.impl) - set(ALL_IMPLS)
    if unknown:
        p.error(f"unknown --impl {sorted(unknown)}")
    return args


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int
    head_dim: int
    block_size: int
    batch: int
    dtype: str


def shapes_from_args(args: argparse.Namespace) -> list[Shape]:
    if args.quick:
        tests = importlib.import_module("tests.test_kv_append")
        return [Shape(c.num_heads, c.head_dim, c.block_size, c.batch, c.dtype) for c in tests.CASES]
    return [
        Shape(args.heads, args.head_dim, bs, b, dt)
        for dt in args.dtype
        for bs in args.block_size
        for b in args.batch
    ]


# ---------------------------------------------------------------------------------------------


def append_fn(impl: str, params: dict, interpret: bool) -> Callable:
    """fn(kc, vc, kn, vn, idx) -> (kc, vc) for one layer; idx holds the index arrays."""
    if impl.startswith("xla"):
        return lambda kc, vc, kn, vn, idx: kva.kv_append_reference(
            kc, vc, kn, vn, idx["block_idx"], idx["pos"], idx.get("batch_idx")
        )
    if impl == "generic":
        return lambda kc, vc, kn, vn, idx: kva.kv_append_generic(
            kc,
            vc,
            kn,
            vn,
            idx["batch_idx"],
            idx["block_idx"],
            idx["pos"],
            interpret=interpret,
            **params,
        )
    if impl == "identity_pos":
        return lambda kc, vc, kn, vn, idx: kva.kv_append_identity_pos(
            kc, vc, kn, vn, idx["block_idx"], idx["pos"], interpret=interpret, **params
        )
    return lambda kc, vc, kn, vn, idx: kva.kv_append_full_batch(
        kc, vc, kn, vn, idx["block_idx"], idx["pos"], interpret=interpret, **params
    )


def make_loop(fn: Callable, iters: int) -> Callable:
    def run(caches, news, idx):
        def body(_, caches):
            # Unrolled over layers, one cache pair per layer (never scanned: that copies).
            pairs = zip(caches, news, strict=True)
            return [fn(kc, vc, kn, vn, idx) for (kc, vc), (kn, vn) in pairs]

        return lax.fori_loop(0, iters, body, caches)

    return jax.jit(run, donate_argnums=(0,))


def make_indices(shape: Shape, num_blocks: int, form: str, rng: np.random.Generator) -> dict:
    # Distinct blocks from 1.. so every form (the shared position too) is duplicate-free.
    blocks = rng.choice(np.arange(1, num_blocks), size=shape.batch, replace=False)
    idx = {"block_idx": jnp.asarray(blocks, jnp.int32)}
    if form == "full":
        idx["pos"] = jnp.asarray(rng.integers(shape.block_size), jnp.int32)
    else:
        idx["pos"] = jnp.asarray(rng.integers(shape.block_size, size=shape.batch), jnp.int32)
    if form == "generic":
        idx["batch_idx"] = jnp.asarray(rng.permutation(shape.batch), jnp.int32)
    return idx


def bytes_moved(shape: Shape, form: str) -> int:
    item = jnp.dtype(shape.dtype).itemsize
    rows = shape.batch * shape.heads * shape.head_dim * item * 2  # K and V rows
    index = shape.batch * 4 * {"generic": 3, "identity": 2, "full": 1}[form]
    return 2 * rows + index  # read new rows, write cache slots


def verify(caches, news, idx) -> bool:
    """Layer 0's target slots hold the new rows (the timed code really wrote them)."""
    (kc, vc), (kn, vn) = caches[0], news[0]
    if "batch_idx" in idx:
        kn, vn = kn[idx["batch_idx"]], vn[idx["batch_idx"]]
    k_slots = kc[:, idx["block_idx"], idx["pos"]]  # [H, B, D]
    v_slots = vc[:, idx["block_idx"], idx["pos"]]
    return bool(
        jnp.array_equal(k_slots, jnp.swapaxes(kn, 0, 1))
        & jnp.array_equal(v_slots, jnp.swapaxes(vn, 0, 1))
    )


def param_grid(args: argparse.Namespace) -> list[dict]:
    grid = [{}]
    for key, values in (
        ("block_b", args.block_b),
        ("block_h", args.block_h),
        ("num_warps", args.num_warps),
    ):
        if values:
            grid = [dict(g, **{key: v}) for g in grid for v in values]
    return grid


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.layers, args.iters, args.repeats, args.copy_mb = 2, 2, 1, 8
    interpret = {"auto": jax.default_backend() == "cpu", "yes": True, "no": False}[args.interpret]
    device = jax.devices()[0]
    meta = {
        "device": getattr(device, "device_kind", str(device)),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "interpret": interpret,
        "layers": args.layers,
        "iters": args.iters,
        "repeats": args.repeats,
        "defaults": {
            "block_b": kva.DEFAULT_BLOCK_B,
            "num_warps": kva.DEFAULT_NUM_WARPS,
            "min_batch": kva.DEFAULT_MIN_BATCH,
        },
    }
    meta["copy_gbps"] = common.copy_bandwidth_gbs(args.copy_mb)
    print(
        f"# {meta['device']}  jax {meta['jax']}  interpret={interpret}  "
        f"copy bandwidth {meta['copy_gbps']:.0f} GB/s (read+write, {args.copy_mb} MB)",
        flush=True,
    )
    results: list[dict] = []
    rng = np.random.default_rng(0)
    shapes = shapes_from_args(args)
    grid = param_grid(args)

    # One set of caches per (dtype, block size, H, D), sized for the largest batch and reused by
    # every batch and implementation: in place, the time does not depend on the cache size.
    groups: dict[tuple, list[Shape]] = {}
    for s in shapes:
        groups.setdefault((s.dtype, s.block_size, s.heads, s.head_dim), []).append(s)
    print(
        f"{'dtype':>8} {'BS':>3} {'B':>5} {'impl':>13} {'params':>22} {'us':>8} "
        f"{'GB/s':>7} {'%copy':>6} {'compile_s':>9} ok",
        flush=True,
    )
    for (dtype, block_size, heads, head_dim), group in groups.items():
        num_blocks = max(s.batch for s in group) + 1
        cache_shape = (heads, num_blocks, block_size, head_dim)
        caches = [
            (jnp.full(cache_shape, 7.0, dtype), jnp.full(cache_shape, -7.0, dtype))
            for _ in range(args.layers)
        ]
        for shape in group:
            keys = jax.random.split(jax.random.key(shape.batch), 2 * args.layers)
            news = [
                (
                    jax.random.normal(keys[2 * i], (shape.batch, heads, head_dim), dtype),
                    jax.random.normal(keys[2 * i + 1], (shape.batch, heads, head_dim), dtype),
                )
                for i in range(args.layers)
            ]
            for impl in args.impl:
                form = FORM[impl]
                idx = make_indices(shape, num_blocks, form, rng)
                for params in [{}] if impl in XLA_IMPLS else grid:
                    loop = make_loop(append_fn(impl, params, interpret), args.iters)
                    t0 = time.perf_counter()
                    caches = jax.block_until_ready(loop(caches, news, idx))
                    compile_s = time.perf_counter() - t0
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        caches = jax.block_until_ready(loop(caches, news, idx))
                        times.append(time.perf_counter() - t0)
                    us = statistics.median(times) / (args.iters * args.layers) * 1e6
                    gbps = bytes_moved(shape, form) / (us * 1e-6) / 1e9
                    ok = verify(caches, news, idx)
                    row = dict(
                        dataclasses.asdict(shape),
                        impl=impl,
                        form=form,
                        params=params,
                        us=us,
                        gbps=gbps,
                        pct_copy=100 * gbps / meta["copy_gbps"],
                        compile_s=compile_s,
                        ok=ok,
                        times_us=[t / (args.iters * args.layers) * 1e6 for t in times],
                    )
                    results.append(row)
                    ptxt = ",".join(f"{k}={v}" for k, v in params.items()) or "default"
                    print(
                        f"{dtype:>8} {block_size:>3} {shape.batch:>5} {impl:>13} {ptxt:>22} "
                        f"{us:8.2f} {gbps:7.1f} {row['pct_copy']:6.1f} {compile_s:9.2f} "
                        f"{'ok' if ok else 'WRONG'}",
                        flush=True,
                    )
                    if args.json:
                        _write_json(args.json, meta, results)
        del caches
    print_table(results, args.impl)
    if args.json:
        _write_json(args.json, meta, results)
    return 0 if all(r["ok"] for r in results) else 1


def _write_json(path: str, meta: dict, results: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


def print_table(results: list[dict], impls: list[str]) -> None:
    """Markdown table: one row per (dtype, block size, B), the best parameters per kernel."""
    best: dict[tuple, dict] = {}
    for r in results:
        key = (r["dtype"], r["block_size"], r["batch"], r["impl"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    rows = sorted({k[:3] for k in best}, key=lambda k: (k[0], -k[1], k[2]))
    cols = [i for i in ALL_IMPLS if i in impls]
    print("\nus per layer-append (median); best kernel GB/s and % of copy bandwidth")
    print("| dtype | BS | B | " + " | ".join(cols) + " | best kernel GB/s (% copy) |")
    print("|" + "---|" * (len(cols) + 4))
    for key in rows:
        cells = []
        for c in cols:
            r = best.get(key + (c,))
            cells.append("" if r is None else f"{r['us']:.2f}" + ("" if r["ok"] else " WRONG"))
        kernels = [best[key + (c,)] for c in cols if c in KERNEL_IMPLS and key + (c,) in best]
        top = max(kernels, key=lambda r: r["gbps"]) if kernels else None
        tail = "" if top is None else f"{top['gbps']:.0f} ({top['pct_copy']:.0f}%)"
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + f" | {tail} |")


if __name__ == "__main__":
    sys.exit(main())
