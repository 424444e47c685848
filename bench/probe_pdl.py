"""Does programmatic dependent launch (PDL) hide a small kernel's fixed latency in a CUDA graph?

A one-row decode step is a chain of ~8 small kernels a layer, each waiting on the one before, and
each costs its fixed latency (launch, ramp, the first round trip to memory) more than its bytes
(docs/performance-log.md, "Tried and dropped"). With PDL a kernel may start before the previous
one ends and stream its weights meanwhile, waiting (`griddepcontrol_wait`) only before it reads
the previous kernel's output. OpenXLA gives such kernels (custom calls marked `uses_pdl`, as jax's
Mosaic GPU kernels that call griddepcontrol are) programmatic edges in its command buffers.

This probe times a chain of `--kernels` Mosaic GPU kernels a loop iteration, in one jitted loop
(bench.common.time_in_loop: a CUDA graph), each kernel a grid of `--ctas` programs that copy their
slice of the kernel's own weight (`--mb` MB, one TMA copy each) into shared memory and add its
last row to the previous kernel's output. Variants, in one process: `plain` (no PDL), `pdl` (the
weight copy issued before the wait: what a kernel would do), `pdl_wait_first` (the wait before
the copy: only launch overlaps). µs a kernel and the weight's GB/s; every variant's output is
checked against the same adds in XLA.

    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/probe_pdl.py --mb 4,8,12
    XLA_FLAGS=--xla_gpu_enable_pdl=true python bench/probe_pdl.py  # where XLA's default is off
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python bench/probe_pdl.py  # outside a graph
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

VARIANTS = ("plain", "pdl", "pdl_wait_first")
COLUMNS = 256  # a weight row: the TMA box's widest side (256 elements)


def chain_kernel(x, w, *, variant: str, interpret):
    """x [C, COLUMNS] + w[:, -1, :] by C programs (w [C, R, COLUMNS]: program c copies w[c] into
    shared memory). PDL variants let the next kernel launch at once and wait on the previous
    one's output, after (`pdl`) or before (`pdl_wait_first`) their weight copy."""
    ctas, rows, cols = w.shape

    def body(x_ref, w_ref, out_ref, w_smem, x_smem, barriers):
        c = lax.axis_index("cta")
        pdl = variant != "plain"
        if pdl:
            plgpu.griddepcontrol_launch_dependents()
        if variant == "pdl_wait_first":
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(w_ref.at[c], w_smem, barriers.at[0])
        if variant == "pdl":
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(c, 1)], x_smem, barriers.at[1])
        plgpu.barrier_wait(barriers.at[0])
        plgpu.barrier_wait(barriers.at[1])
        x_smem[...] = x_smem[...] + w_smem[pl.ds(rows - 1, 1), :]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_smem, out_ref.at[pl.ds(c, 1)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_types=[
            plgpu.SMEM((rows, cols), w.dtype),
            plgpu.SMEM((1, cols), x.dtype),
            plgpu.Barrier(num_barriers=2),
        ],
        grid=(ctas,),
        grid_names=("cta",),
        interpret=interpret,
    )(x, w)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mb", type=ints, default=[4, 8, 12], help="comma list of MB a kernel reads")
    p.add_argument("--ctas", type=int, default=128, help="programs a kernel")
    p.add_argument("--kernels", type=int, default=16, help="kernels chained a loop iteration")
    add_kernel_bench_args(p)
    args = parse_kernel_bench_args(p)
    interpret = None
    variants = VARIANTS
    if args.quick or jax.default_backend() == "cpu":
        # jax's Mosaic GPU interpreter; it has no rule for griddepcontrol: the plain chain only.
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        interpret, variants = InterpretGPUParams(), ("plain",)
        args.mb, args.ctas, args.kernels, args.iters, args.repeats = [0.03], 4, 2, 2, 1
    rng = np.random.default_rng(0)
    results = []
    for mb in args.mb:
        rows = max(8, min(256, round(mb * 2**20 / (args.ctas * COLUMNS * 2) / 8) * 8))
        # A weight per kernel (cold reads: 16 x 8 MB is past the L2), each an array of its own:
        # a slice of one stacked array would be a copy before each kernel.
        shape = (args.ctas, rows, COLUMNS)
        ws = [jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for _ in range(args.kernels)]
        x = jnp.zeros((args.ctas, COLUMNS), jnp.bfloat16)
        want = x
        for w in ws:
            want = want + w[:, -1, :]
        base = None
        for variant in variants:

            def chain(x, *ws, variant=variant):
                for w in ws:
                    x = chain_kernel(x, w, variant=variant, interpret=interpret)
                return x

            got = jax.jit(chain)(x, *ws)
            err = float(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max())
            us = time_in_loop(chain, x, *ws, iters=args.iters, repeats=args.repeats)
            us /= args.kernels
            base = base or us
            nbytes = args.ctas * rows * COLUMNS * 2
            row = dict(mb=nbytes / 2**20, variant=variant, us=us, gbs=nbytes / us / 1e3)
            results.append(row | dict(vs_plain=us / base, max_err=err))
            print(
                f"{nbytes / 2**20:6.2f} MB {variant:15s} {us:7.2f} us a kernel "
                f"{row['gbs']:7.1f} GB/s  {us / base:.3f}x plain  err {err:.1e}",
                flush=True,
            )
    report_kernel_bench(args.json, results)


if __name__ == "__main__":
    main()
