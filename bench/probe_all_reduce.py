"""How fast can two GPUs sum a decode step's activations? XLA's all-reduce against a one-shot one.

At tensor parallelism 2 a Llama-3.1-8B decode step at one row all-reduces 64 times ([rows, 4096]
partial sums after each attention and MLP block), ~11 µs each in the step's trace and 22-28 µs
each in a loop of nothing else (docs/performance-log.md, "Tensor parallelism"): ~0.7 ms of a
4.2 ms step, the gap to issue 21's TP=2 <= 0.6x TP=1. A payload of 8-256 KB over NVLink is all
latency. This probe times all-reduces chained in one jitted loop (`bench.common.time_in_loop`:
each output scaled by 0.5 and fed to the next; one process, shard_map over two GPUs) as:

- `psum`: `jax.lax.psum` (XLA's all-reduce: NCCL, or its own kernels);
- `one_shot`: a Mosaic GPU kernel in which each program stores its column slice of the local
  partial into the peer's inbox (a bulk copy through `plgpu.remote_ref`: peer memory XLA maps
  for the kernel), signals the peer's semaphore for that slice, waits for the peer's slice,
  adds, stores, and then waits for the peer to have read what it sent (so the next call may
  write again). Unicast stores and semaphores only: NVLink multicast stays off, as the lending
  machines ask. It runs on GPUs only (`--quick` runs `psum` on two CPU host devices).

µs an all-reduce, each variant's result checked against the sum on the host.

    PYTHONPATH=. JAX_PLATFORMS=cuda python bench/probe_all_reduce.py
    XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,\
CONDITIONAL,COLLECTIVES python bench/probe_all_reduce.py  # psum inside the graph too
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
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bench.common import (  # noqa: E402
    add_kernel_bench_args,
    ints,
    parse_kernel_bench_args,
    report_kernel_bench,
    time_in_loop,
)

VARIANTS = ("psum", "one_shot")
COLUMNS = 256  # a program's column slice: the TMA box's widest side


def one_shot_all_reduce(x, *, axis_name: str):
    """x [R, C] (this device's partial) summed with the other device's, in float32, rounded to
    x's dtype. Two devices; C a multiple of COLUMNS (a program a slice)."""
    rows, cols = x.shape
    programs = cols // COLUMNS

    def body(x_ref, out_ref, inbox_ref, mine, theirs, barriers):
        arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((programs,)))
        consumed = pl.get_global(plgpu.SemaphoreType.REGULAR((programs,)))
        c = lax.axis_index("program")
        peer = 1 - lax.axis_index(axis_name)
        cs = pl.ds(c * COLUMNS, COLUMNS)
        plgpu.copy_gmem_to_smem(x_ref.at[:, cs], mine, barriers.at[0])
        plgpu.barrier_wait(barriers.at[0])
        plgpu.copy_smem_to_gmem(mine, plgpu.remote_ref(inbox_ref, peer).at[:, cs])
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # in the peer's memory before the signal
        pl.semaphore_signal(arrived.at[c], device_id=peer)
        pl.semaphore_wait(arrived.at[c], 1)  # the peer's slice is in this device's inbox
        plgpu.copy_gmem_to_smem(inbox_ref.at[:, cs], theirs, barriers.at[1])
        plgpu.barrier_wait(barriers.at[1])
        pl.semaphore_signal(consumed.at[c], device_id=peer)
        total = mine[...].astype(jnp.float32) + theirs[...].astype(jnp.float32)
        mine[...] = total.astype(mine.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(mine, out_ref.at[:, cs])
        plgpu.wait_smem_to_gmem(0)
        pl.semaphore_wait(consumed.at[c], 1)  # the peer read its inbox: the next call may write

    out, _ = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)],
        scratch_types=[
            plgpu.SMEM((rows, COLUMNS), x.dtype),
            plgpu.SMEM((rows, COLUMNS), x.dtype),
            plgpu.Barrier(num_barriers=2),
        ],
        grid=(programs,),
        grid_names=("program",),
    )(x)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=ints, default=[1, 16], help="comma list of rows summed")
    p.add_argument("--columns", type=int, default=4096, help="columns (Llama-3.1-8B's hidden)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma list of dtypes")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    add_kernel_bench_args(p)
    args = parse_kernel_bench_args(p)
    variants = args.variants.split(",")
    if bad := set(variants) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(bad)}; choose from {VARIANTS}")
    if args.quick:  # XLA reads its flags as jax starts its backend: two CPU devices, psum only
        os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
        variants, args.rows, args.columns, args.iters, args.repeats = ["psum"], [1, 3], 256, 2, 1
    if jax.device_count() < 2:
        p.error(f"needs two devices, found {jax.device_count()}")
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    rng = np.random.default_rng(0)
    results = []
    for dtype in args.dtypes.split(","):
        for rows in args.rows:
            shards = rng.normal(size=(2, rows, args.columns)).astype(np.float32)
            x = jax.device_put(
                jnp.asarray(shards.reshape(2 * rows, args.columns), dtype),
                NamedSharding(mesh, P("tp", None)),
            )
            want = np.asarray(jnp.asarray(shards, dtype), np.float32).sum(0)  # [R, C]
            base = None
            for variant in variants:
                reduce = (
                    (lambda y: lax.psum(y, "tp"))
                    if variant == "psum"
                    else (lambda y: one_shot_all_reduce(y, axis_name="tp"))
                )

                def on_mesh(f):
                    return jax.shard_map(
                        f, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False
                    )

                got = np.asarray(jax.jit(on_mesh(reduce))(x), np.float32)
                got = got.reshape(2, rows, args.columns)
                err = float(np.abs(got - want[None]).max() / np.abs(want).max())
                # scaled so that the chained sums stay O(1)
                scaled = on_mesh(lambda y, reduce=reduce: reduce(y) * jnp.asarray(0.5, y.dtype))
                us = time_in_loop(scaled, x, iters=args.iters, repeats=args.repeats)
                base = base or us
                row = dict(dtype=dtype, rows=rows, variant=variant, us=us, vs_first=us / base)
                results.append(row | dict(max_rel_err=err))
                print(
                    f"{dtype:9s} [{rows:3d}, {args.columns}] {variant:9s} {us:7.2f} us "
                    f"(with the scale)  {us / base:.3f}x {variants[0]}  rel err {err:.1e}",
                    flush=True,
                )
    report_kernel_bench(args.json, results, xla_flags=os.environ["XLA_FLAGS"])


if __name__ == "__main__":
    main()
