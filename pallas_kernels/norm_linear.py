"""RMSNorm of the residual stream, then x @ w + b with the linear's epilogue, in one kernel.

At one decode row a Llama-style layer runs two add + RMSNorm kernels, each a launch that moves a
few KB, feeding the q/k/v and the gate/up projections. RMSNorm is a row scale:
rms_norm(h) @ w = rsqrt(mean(h^2) + eps) * ((h * scale) @ w), so the matmul's K loop can stream
h * scale into the dot and take the row's mean square on the way, scaling its float32
accumulators at the end: no pass over the row before the weights stream (a statistics pass
first put a serial round of loads ahead of every matmul: +5 µs each). Each program also forms h
itself from the stream a deferred residual `Linear` left (its float32 partial sums, bias and
residual: `pallas_kernels.linear.linear_partial_sums`), and the programs of the first column
tile store h for the residual stream.

A program owns `block_n` output columns for its `block_m` rows (`pallas_kernels.linear`'s
tiling, swiglu's gate and up columns too) and streams all of K in one split: the row statistics
need the whole row. At one row it loads one row of the stream a step and broadcasts it to the
matrix units' least 16, so its pipeline holds [1, block_k] stream tiles, not 16-row ones.

Layout: partials [S, M, K] float32 or None (the stream an array: the residual alone);
linear_bias [K] or None; residual [M, K]; scale [K]; w [K, N]; b [N] or None; out [M, N]
(swiglu: [M, N / 2]); h [M, K] in the residual's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import filter_triton_deprecation, without_absent
from pallas_kernels._row_norm import check_residual_sum, residual_sum
from pallas_kernels.linear import (
    ACTIVATIONS,
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_M,
    DEFAULT_BLOCK_N,
    DEFAULT_NUM_STAGES,
    DEFAULT_NUM_WARPS,
    SHARED_MEMORY_BYTES,
    _epilogue,
    _tiles,
    linear_reference,
    silu_mul,
)
from pallas_kernels.rms_norm import add_rms_norm_reference, rms_norm_reference

STREAM_SCRATCH_BYTES = 80 * 1024


def norm_linear_kernel(
    partials_ref,  # [S, M, K] float32, or None: the stream is the residual
    linear_bias_ref,  # [K], or None
    residual_ref,  # [M, K]
    scale_ref,  # [K]
    w_ref,  # [K, N]
    b_ref,  # [N], or None
    o_ref,  # [M, N] (swiglu: [M, N / 2])
    h_ref=None,  # [M, K]: the stream, stored by the first column tile's programs (with partials)
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    k_steps: int,
    load_rows: int,  # rows of the stream a program loads: 1 at one row, else block_m
    eps: float,
    activation: str | None,
):
    m, k = residual_ref.shape
    first_row = pl.program_id(1) * block_m
    rows = pl.ds(first_row, load_rows)
    load_ok = (first_row + jnp.arange(load_rows) < m)[:, None]  # [LR, 1]
    row_ok = (first_row + jnp.arange(block_m) < m)[:, None]  # [BM, 1]
    cols = pl.ds(pl.program_id(0) * block_n, block_n)
    w_cols = (cols,)
    if activation == "swiglu":
        w_cols = (cols, pl.ds(w_ref.shape[1] // 2 + pl.program_id(0) * block_n, block_n))
    precision = jax.lax.Precision.HIGHEST if w_ref.dtype == jnp.float32 else None
    stores_h = pl.program_id(0) == 0

    def body(i, carry):  # accs: ([BM, BN] float32,) per column tile; squares: [LR, 1]
        accs, squares = carry
        ks = pl.ds(i * block_k, block_k)
        tile = (rows, ks)
        h = residual_sum(partials_ref, linear_bias_ref, residual_ref, tile, load_ok, None)
        if h_ref is not None:

            @pl.when(stores_h)
            def _():
                plgpu.store(h_ref.at[tile], h, mask=load_ok)

        h = h.astype(jnp.float32)  # [LR, BK]
        x = (h * scale_ref[ks].astype(jnp.float32)[None, :]).astype(w_ref.dtype)
        x = jnp.broadcast_to(x, (block_m, block_k))  # one row: the matrix units' 16
        accs = tuple(
            acc + jnp.dot(x, w_ref[ks, c], precision=precision, preferred_element_type=jnp.float32)
            for acc, c in zip(accs, w_cols, strict=True)
        )
        return accs, squares + jnp.sum(h * h, axis=1, keepdims=True)

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    carry = ((zeros,) * len(w_cols), jnp.zeros((load_rows, 1), jnp.float32))
    accs, squares = jax.lax.fori_loop(0, k_steps, body, carry)
    inv_rms = jnp.broadcast_to(jax.lax.rsqrt(squares / k + eps), (block_m, 1))
    scaled = [acc * inv_rms for acc in accs]
    biases = [None if b_ref is None else b_ref[c] for c in w_cols]
    if activation == "swiglu":  # each half as the unfused projection rounds it, then `silu_mul`
        gate, up = (
            _epilogue(acc, bias, None, None).astype(o_ref.dtype)
            for acc, bias in zip(scaled, biases, strict=True)
        )
        y = silu_mul(gate, up)
    else:
        y = _epilogue(scaled[0], biases[0], None, activation).astype(o_ref.dtype)
    plgpu.store(o_ref.at[pl.ds(first_row, block_m), cols], y, mask=row_ok)


@functools.partial(
    jax.jit,
    static_argnames=[
        "activation",
        "eps",
        "block_m",
        "block_n",
        "block_k",
        "num_warps",
        "num_stages",
        "interpret",
    ],
)
def norm_linear(
    partials: jax.Array | None,  # [S, M, K] float32; None: the stream is `residual`
    linear_bias: jax.Array | None,  # [K]; None: no bias (and None without partials)
    residual: jax.Array,  # [M, K]
    scale: jax.Array,  # [K]
    w: jax.Array,  # [K, N]
    b: jax.Array | None,  # [N]; None: no bias
    *,
    activation: str | None = None,
    eps: float = 1e-6,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    block_k: int = DEFAULT_BLOCK_K,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # [M, N] (swiglu: [M, N / 2]), h [M, K]: residual's dtype
    """h = residual + sum(partials) + linear_bias (`add_rms_norm`'s h; the residual itself
    without partials) and activation(rms_norm(h, scale) @ w + b), in one kernel. K is never
    split; block_k halves until the pipeline's tiles fit shared memory."""
    if partials is not None:
        check_residual_sum(partials, linear_bias, residual, scale=scale)
    elif linear_bias is not None or residual.ndim != 2 or scale.shape != residual.shape[1:]:
        raise ValueError(
            f"need residual [M, K] and scale [K] (and no linear bias without partials), got "
            f"{residual.shape}, {scale.shape}, linear bias {linear_bias is not None}"
        )
    (m, k), n = residual.shape, w.shape[1]
    if w.shape[0] != k or (b is not None and b.shape != (n,)):
        got = None if b is None else b.shape
        raise ValueError(f"need w [{k}, N] and b [N] or None, got {w.shape}, {got}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    swiglu_out = activation == "swiglu"
    if swiglu_out and n % 2:
        raise ValueError(f"swiglu needs an even N, got w {w.shape}")
    splits = 0 if partials is None else partials.shape[0]
    # A pipeline stage holds a [rows, block_k] tile of the residual and of each split's float32
    # partials (1.5x their bytes, padded), one row of them at one row, and Triton's layout
    # scratch takes STREAM_SCRATCH_BYTES beside the pipeline (both read off sm90 compiles' shared
    # memory requests).
    one_row = m == 1
    tiles = _tiles(
        m,
        k,
        n // 2 if swiglu_out else n,
        block_m,
        block_n,
        block_k,
        max_k_steps=k,  # one split: the row statistics need all of K
        fill_programs=0,
        itemsize=w.dtype.itemsize,
        num_stages=num_stages,
        weight_tiles=1 + swiglu_out,
        x_bytes=residual.dtype.itemsize + 6 * splits,
        x_rows=1 if one_row else None,
        shared_memory=SHARED_MEMORY_BYTES - STREAM_SCRATCH_BYTES,
    )
    out = jax.ShapeDtypeStruct((m, n // 2 if swiglu_out else n), residual.dtype)
    outs = (out,) if partials is None else (out, jax.ShapeDtypeStruct((m, k), residual.dtype))
    if not interpret:
        filter_triton_deprecation()
    kernel, operands = without_absent(
        functools.partial(
            norm_linear_kernel,
            block_m=tiles["block_m"],
            block_n=tiles["block_n"],
            block_k=tiles["block_k"],
            k_steps=tiles["k_steps"],
            load_rows=1 if one_row else tiles["block_m"],
            eps=eps,
            activation=activation,
        ),
        (partials, linear_bias, residual, scale, w, b),
    )
    results = pl.pallas_call(
        kernel,
        grid=(n // (2 if swiglu_out else 1) // tiles["block_n"], tiles["m_tiles"]),
        out_shape=outs,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"norm_linear_{activation or 'none'}_s{splits}_n{tiles['block_n']}",
    )(*operands)
    return results[0], residual if partials is None else results[1]


def norm_linear_reference(
    partials: jax.Array | None,  # [S, M, K] float32; None: the stream is `residual`
    linear_bias: jax.Array | None,  # [K]
    residual: jax.Array,  # [M, K]
    scale: jax.Array,  # [K]
    w: jax.Array,  # [K, N]
    b: jax.Array | None,  # [N]
    *,
    activation: str | None = None,
    eps: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """Plain XLA: `add_rms_norm_reference` (`rms_norm_reference` without partials), then
    `linear_reference`."""
    if partials is None:
        h, x = residual, rms_norm_reference(residual, scale, eps=eps)
    else:
        h, x = add_rms_norm_reference(partials, linear_bias, residual, scale, eps=eps)
    return linear_reference(x, w, b, activation=activation), h
