"""Is one persistent kernel with a grid barrier between ops faster than a kernel per op at one row?

A one-row decode step is a chain of small dependent ops; each as its own kernel pays a fixed cost
(launch, ramp, drain: ~3.5 µs for a Pallas Triton kernel in a CUDA graph, docs/performance-log.md)
on top of its bytes. A persistent kernel ("megakernel") keeps one program a SM for the whole
chain: a ring of TMA copies streams every op's weights into shared memory without waiting for the
activations (they do not depend on them), so the next op's weights arrive while the programs wait
at the grid barrier (a global semaphore) for the previous op's outputs.

This probe times a chain of `--ops` ops a loop iteration (bench.common.time_in_loop: a CUDA graph),
each reading about `--mb` MB of its own bf16 weights. Variants, in one process:
  kernels        one Mosaic GPU kernel an op (`--ctas` programs, tiles of `--rows` x 256, a ring
                 `--stages` deep inside each); a program's op: the row the previous op's program
                 0 wrote plus the first row of each of its tiles (float32), stored as its row
  persistent     the same ops in one kernel, the ring running across ops, a grid barrier an op
  nosync         the persistent kernel without the barrier (its streaming alone; unchecked)
  gemv           real one-row matmuls x @ w, w [d, d] (d the power of two nearest `--mb`), in
                 one persistent kernel: a program per (64 output columns, K range), the tile's
                 products on the CUDA cores, float32 partials the next op's programs sum
  gemv_swizzled  gemv with swizzled weight tiles (conflict-free loads into registers)
  gemv_nosync    gemv without the barrier (unchecked)
  triton         rosejax's small-batch Pallas Triton linear chained, x [1, d] @ w [d, d] an op
µs an op and the weights' GB/s; each checked variant's output against numpy (max error; relative
for the matmuls). On a CPU (`--quick`) jax's Mosaic GPU interpreter runs `kernels` and `triton`
(it has no global semaphores, layout casts or layout loads).

    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/probe_persistent.py --mb 2,8,32 --stages 2,4
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.experimental.pallas as pl  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from bench.common import (  # noqa: E402
    add_kernel_bench_args,
    ints,
    parse_kernel_bench_args,
    report_kernel_bench,
    time_in_loop,
)

VARIANTS = ("kernels", "persistent", "nosync", "gemv", "gemv_nosync", "gemv_swizzled", "triton")
BF16 = jnp.bfloat16
COLUMNS = 256  # a weight tile's row: the TMA box's widest side


def _bf16(x) -> np.ndarray:
    """x rounded to bf16, as float32 (numpy's side of a bf16 store)."""
    return np.asarray(jnp.asarray(x, BF16), np.float32)


def _wait_for_op(sem, j, ctas: int) -> None:
    """The grid barrier before op j: all `ctas` programs signalled `sem` after storing op j - 1's
    rows. Then a proxy fence: this thread's acquire (generic proxy) before its TMA (async proxy)
    reads of what other programs' TMA stores wrote."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    plgpu.semaphore_wait(sem, j * ctas, decrement=False, memory_scope="gpu")

    @plgpu.inline_mgpu()
    def fence(_ctx):
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "", has_side_effects=True
        )

    fence()


def _store_and_signal(src_smem, dst_gmem, sem) -> None:
    """src -> dst by TMA, waited for; then this program's signal that its rows are stored (sem
    None: no barrier)."""
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(src_smem, dst_gmem)
    plgpu.wait_smem_to_gmem(0)
    if sem is not None:
        plgpu.semaphore_signal(sem, 1, memory_scope="gpu")


def _chain_body(
    w_ref,
    load_prev,
    out_row,
    x_smem,
    acc_smem,
    o_smem,
    x_barrier,
    *,
    op,
    op_count,
    tiles,
    rows,
    ctas,
    stages,
    sync,
):
    """One program's work for ops [op, op + op_count): per op, wait for the previous op (grid
    barrier), load its activation row (`load_prev(j, x_smem, barrier)` starts its copy), add its
    weight tiles' first rows, store its own row (`out_row(j, c)`)."""
    c = lax.axis_index("cta")
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if sync else None

    def step(idx, w_tile):
        j, t = idx

        @pl.when(t == 0)
        def _load_x():
            if sync:

                @pl.when(j > 0)
                def _():
                    _wait_for_op(sem, j, ctas)

            load_prev(j, x_smem, x_barrier.at[0])
            plgpu.barrier_wait(x_barrier.at[0])
            acc_smem[...] = x_smem[...].astype(jnp.float32)

        acc_smem[...] = acc_smem[...] + w_tile[pl.ds(0, 1), :].astype(jnp.float32)

        @pl.when(t == tiles - 1)
        def _store():
            o_smem[...] = acc_smem[...].astype(o_smem.dtype)
            _store_and_signal(o_smem, out_row(j, c), sem)

    def w_index(j, t):  # w is [ops * ctas * tiles * rows, COLUMNS]: op, program, tile
        return (((op + j) * ctas + c) * tiles + t, 0)

    plgpu.emit_pipeline(
        step,
        grid=(op_count, tiles),
        in_specs=[pl.BlockSpec((rows, COLUMNS), w_index)],
        max_concurrent_steps=stages,
    )(w_ref)


def mosaic_chain(x, w, *, ops, ctas, tiles, rows, stages, variant, interpret=None):
    """x [ctas, COLUMNS] -> the last op's rows [ctas, COLUMNS], op j's row c being op j - 1's
    row 0 (x's for j = 0) plus the first rows of program c's weight tiles of op j; by `kernels`
    (a kernel an op) or one persistent kernel (`persistent`, `nosync`: rows of every op)."""
    scratch = [
        plgpu.SMEM((1, COLUMNS), x.dtype),
        plgpu.SMEM((1, COLUMNS), jnp.float32),
        plgpu.SMEM((1, COLUMNS), x.dtype),
        plgpu.Barrier(num_barriers=1),
    ]
    common = dict(tiles=tiles, rows=rows, ctas=ctas, stages=stages)
    if variant == "kernels":
        for op in range(ops):

            def one_op(x_ref, w_ref, out_ref, *scratch_refs, op=op):
                _chain_body(
                    w_ref,
                    lambda j, dst, bar: plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, 1)], dst, bar),
                    lambda j, c: out_ref.at[pl.ds(c, 1)],
                    *scratch_refs,
                    op=op,
                    op_count=1,
                    sync=False,
                    **common,
                )

            x = plgpu.kernel(
                one_op,
                out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                scratch_types=scratch,
                grid=(ctas,),
                grid_names=("cta",),
                interpret=interpret,
            )(x, w)
        return x

    def all_ops(x_ref, w_ref, out_ref, *scratch_refs):
        def load_prev(j, dst, bar):
            @pl.when(j == 0)
            def _():
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, 1)], dst, bar)

            @pl.when(j > 0)
            def _():
                plgpu.copy_gmem_to_smem(out_ref.at[j - 1, pl.ds(0, 1)], dst, bar)

        _chain_body(
            w_ref,
            load_prev,
            lambda j, c: out_ref.at[j, pl.ds(c, 1)],
            *scratch_refs,
            op=0,
            op_count=ops,
            sync=variant == "persistent",
            **common,
        )

    out = plgpu.kernel(
        all_ops,
        out_type=jax.ShapeDtypeStruct((ops, *x.shape), x.dtype),
        scratch_types=scratch,
        grid=(ctas,),
        grid_names=("cta",),
    )(x, w)
    return out[-1]


def gemv_chain(x0, wt, *, ops, dim, splits, tile_k, stages, sync, swizzle=False):
    """A chain of `ops` real one-row matmuls in one persistent kernel: x_{j+1} = bf16(x_j) @ w_j,
    w_j [dim, dim] given transposed (wt [ops * dim, dim], w_j's column n a row), float32 sums.
    Program (n-block b, K split s) multiplies 64 output columns over its dim / splits of K on the
    CUDA cores (a [64, tile_k] tile times x broadcast down its rows, summed along the rows) and
    stores float32 partials [ops, splits, dim]; the next op's programs sum the splits of their K
    range after the grid barrier. x0 [splits, dim] (its sum is x_0). Returns x_ops [dim]."""
    blocks = dim // 64
    ctas, k_range = blocks * splits, dim // splits
    tiles = k_range // tile_k
    col = plgpu.Layout.WGMMA.reduce(0)  # a [tile_k] vector along a tile's columns
    row = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector along its rows
    # swizzled tiles: the tile's loads into registers without shared memory bank conflicts
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)) if swizzle else ()

    def body(x0_ref, wt_ref, parts_ref, x_smem, o_smem, x_barrier):
        c = lax.axis_index("cta")
        b, s = c // splits, c % splits
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if sync else None

        def step(idx, w_tile, acc):
            j, t = idx

            @pl.when(t == 0)
            def _load_x():
                def load(src):  # src [splits, dim] in GMEM; a copy a tile (TMA boxes <= 256)
                    for i in range(tiles):
                        plgpu.copy_gmem_to_smem(
                            src.at[:, pl.ds(s * k_range + i * tile_k, tile_k)],
                            x_smem.at[i],
                            x_barrier.at[i],
                        )

                @pl.when(j == 0)
                def _():
                    load(x0_ref)

                @pl.when(j > 0)
                def _():
                    if sync:
                        _wait_for_op(sem, j, ctas)
                    load(parts_ref.at[j - 1])

                for i in range(tiles):
                    plgpu.barrier_wait(x_barrier.at[i])

            x = plgpu.load(x_smem.at[t, 0], (), layout=col, optimized=False)
            for split in range(1, splits):
                x = x + plgpu.load(x_smem.at[t, split], (), layout=col, optimized=False)
            x = x.astype(jnp.bfloat16).astype(jnp.float32)  # the activation a bf16 model passes
            w = plgpu.load(w_tile, (), layout=plgpu.Layout.WGMMA, optimized=swizzle)
            w = w.astype(jnp.float32)
            acc = acc + (w * lax.broadcast_in_dim(x, (64, tile_k), [1])).sum(axis=1)

            @pl.when(t == tiles - 1)
            def _store():
                o_smem[...] = acc
                _store_and_signal(o_smem, parts_ref.at[j, s, pl.ds(b * 64, 64)], sem)

            return acc * (t != tiles - 1).astype(jnp.float32)  # zero after the store

        def w_index(j, t):  # block units of (64, tile_k) over wt [ops * dim, dim]
            return (j * blocks + b, s * tiles + t)

        zeros = plgpu.layout_cast(jnp.zeros((64,), jnp.float32), row)
        plgpu.emit_pipeline(
            step,
            grid=(ops, tiles),
            in_specs=[plgpu.BlockSpec((64, tile_k), w_index, transforms=transforms)],
            max_concurrent_steps=stages,
            init_carry=zeros,
        )(wt_ref)

    parts = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((ops, splits, dim), jnp.float32),
        scratch_types=[
            plgpu.SMEM((tiles, splits, tile_k), jnp.float32),
            plgpu.SMEM((64,), jnp.float32),
            plgpu.Barrier(num_barriers=tiles),
        ],
        grid=(ctas,),
        grid_names=("cta",),
    )(x0, wt)
    return parts[-1].sum(axis=0)


def expected_gemv_chain(x0, wt, *, ops, dim) -> np.ndarray:
    """numpy's `gemv_chain` result."""
    x = np.asarray(x0, np.float32).sum(axis=0)
    wts = np.asarray(wt, np.float32).reshape(ops, dim, dim)
    for j in range(ops):
        x = wts[j] @ _bf16(x)
    return x


def expected_chain(x, w, *, ops, ctas, tiles, rows) -> np.ndarray:
    """numpy's `mosaic_chain` result (float32 sums rounded to bf16 at each store)."""
    firsts = np.asarray(w, np.float32).reshape(ops, ctas, tiles, rows, COLUMNS)[:, :, :, 0]
    out = np.zeros((ops, ctas, COLUMNS), np.float32)
    prev = np.asarray(x, np.float32)[0]
    for j in range(ops):
        acc = prev[None] + firsts[j].sum(axis=1)  # sequential f32 sums; within rounding below
        out[j] = _bf16(acc)
        prev = out[j, 0]
    return out[-1]


def square_dim(mb: float) -> int:
    """The power of two d whose bf16 [d, d] is nearest `mb` MB."""
    return 2 ** round(np.log2(np.sqrt(mb * 2**20 / 2)))


def measure(
    variant: str, stages: int, mb: float, args, rng, interpret=None
) -> tuple[float, int, float]:
    """(µs a chain, weight bytes an op, max error against numpy; relative for real matmuls).
    `interpret`: jax's Mosaic GPU interpreter parameters (CPU), else None."""
    ops, timing = args.ops, dict(iters=args.iters, repeats=args.repeats)
    if variant in ("kernels", "persistent", "nosync"):
        tile_bytes = args.rows * COLUMNS * 2
        tiles = max(1, round(mb * 2**20 / (args.ctas * tile_bytes)))
        shape = dict(ops=ops, ctas=args.ctas, tiles=tiles, rows=args.rows)
        # One array for all ops (cold: 16 x 8 MB is past the L2); op j's rows are contiguous.
        w = jnp.asarray(rng.normal(size=(ops * args.ctas * tiles * args.rows, COLUMNS)), BF16)
        x = jnp.asarray(rng.normal(size=(args.ctas, COLUMNS)), BF16)

        def chain(x, w):
            return mosaic_chain(x, w, stages=stages, variant=variant, interpret=interpret, **shape)

        got = np.asarray(jax.jit(chain)(x, w), np.float32)
        # nosync reads rows before they are written: no check.
        err = float(np.abs(got - expected_chain(x, w, **shape)).max())
        if variant == "nosync":
            err = float("nan")
        return time_in_loop(chain, x, w, **timing), args.ctas * tiles * tile_bytes, err
    dim = square_dim(mb)
    w = rng.normal(size=(ops * dim, dim)) / np.sqrt(dim)
    if variant == "triton":
        from pallas_kernels.linear import linear

        ws = [jnp.asarray(w[j * dim : (j + 1) * dim].T, BF16) for j in range(ops)]
        x = jnp.asarray(rng.normal(size=(1, dim)), BF16)

        def chain(x, *ws):
            for wj in ws:
                x = linear(x, wj, None, interpret=interpret is not None)
            return x

        got, want = np.asarray(jax.jit(chain)(x, *ws), np.float32)[0], np.asarray(x, np.float32)[0]
        for wj in ws:
            want = _bf16(want @ np.asarray(wj, np.float32))
        err = float(np.abs(got - want).max() / np.abs(want).max())
        return time_in_loop(chain, x, *ws, **timing), dim * dim * 2, err
    splits = max(1, min(128 // (dim // 64), dim // 64))  # <= 128 programs, K ranges of >= 64
    tile_k = min(256, dim // splits)
    wt = jnp.asarray(w, BF16)
    x0 = jnp.asarray(rng.normal(size=(splits, dim)) / np.sqrt(splits), jnp.float32)
    shape = dict(ops=ops, dim=dim, splits=splits, tile_k=tile_k, stages=stages)

    def chain(x0, wt):
        out = gemv_chain(
            x0,
            wt,
            sync=variant != "gemv_nosync",
            swizzle="swizzled" in variant,
            **shape,
        )
        # the next loop trip's x0: this one's output in split 0 (time_in_loop feeds it back)
        return jnp.zeros_like(x0).at[0].set(out)

    got = np.asarray(jax.jit(chain)(x0, wt), np.float32)[0]
    want = expected_gemv_chain(x0, wt, ops=ops, dim=dim)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    if variant == "gemv_nosync":  # reads partials before they are written
        err = float("nan")
    return time_in_loop(chain, x0, wt, **timing), dim * dim * 2, err


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mb", type=ints, default=[2, 8], help="comma list of MB an op reads")
    p.add_argument("--ctas", type=int, default=132, help="programs (one a SM for the barrier)")
    p.add_argument("--rows", type=int, default=32, help="rows of a weight tile (x 256 columns)")
    p.add_argument("--stages", type=ints, default=[4, 8], help="comma list of ring depths")
    p.add_argument("--ops", type=int, default=16, help="ops chained a loop iteration")
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS)
    )
    add_kernel_bench_args(p)
    args = parse_kernel_bench_args(p)
    interpret, variants = None, args.variants.split(",")
    if args.quick or jax.default_backend() == "cpu":
        # jax's Mosaic GPU interpreter has no global semaphores, layout casts or layout loads:
        # the kernel-an-op chain and the Triton linear only.
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        interpret, variants = InterpretGPUParams(), ["kernels", "triton"]
        args.mb, args.ctas, args.rows, args.stages = [0.125], 4, 8, [2]
        args.ops, args.iters, args.repeats = 1, 2, 1
    rng = np.random.default_rng(0)
    results = []
    for mb in args.mb:
        base = None
        for variant in variants:
            for stages in args.stages if variant != "triton" else [0]:
                us, nbytes, err = measure(variant, stages, mb, args, rng, interpret)
                us /= args.ops
                base = base or us
                row = dict(
                    mb=nbytes / 2**20,
                    variant=variant,
                    stages=stages,
                    us=us,
                    gbs=nbytes / us / 1e3,
                    vs_first=us / base,
                    max_err=err,
                )
                results.append(row)
                print(
                    f"{row['mb']:6.2f} MB {variant:11s} stages {stages:2d} {us:7.2f} us an op "
                    f"{row['gbs']:7.1f} GB/s  {us / base:.3f}x first  err {err:.2e}",
                    flush=True,
                )
    report_kernel_bench(args.json, results, args=vars(args))


if __name__ == "__main__":
    main()
