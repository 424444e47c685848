"""RMSNorm over the last axis in one kernel, and the residual add before it in the same kernel.

Llama-style models normalize twice a layer (and Qwen3 twice more, q and k of every head): XLA
lowers each RMSNorm to a row reduction and an elementwise kernel. Here one program reads
`block_rows` rows once, takes their mean square in float32 and writes them normalized:
x * rsqrt(mean(x^2) + eps) * scale. A call that names no `block_rows` gets one row a program,
or several where that would launch thousands of programs (`default_block_rows`).

`add_rms_norm` is the residual step and the next RMSNorm in one kernel: h = the float32 partial
sums [S, N, E] of a linear layer (`pallas_kernels.linear.linear_partial_sums`) + its bias + the
residual, stored in the residual's dtype, and rms_norm(h); the linear needs no epilogue kernel.

Layout: x [N, E] (any E; a row is loaded as one power-of-two tile, masked past E); scale [E].
The reference rounds x / rms to the input's dtype before the scale, as HF's `LlamaRMSNorm` does;
the kernels keep float32 until the store (the same in float32, closer in half precision).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import next_power_of_2
from pallas_kernels._row_norm import check_residual_sum, load_residual_sum, row_call, row_tile
from pallas_kernels.linear import finish_partial_sums

# H200, Qwen3-0.6B decode in one process: 8 warps beat 4 by 0.6-1.3% a step at 1, 16 and 256
# rows (16 warps tied 8; 2 lost 1.4% at 256 rows). One row a program (2 and 4 rows lost 1.5-2.4%
# at 256 rows) unless that makes more than MULTI_ROW_PROGRAMS programs (about two per SM of an
# H100): then up to MULTI_ROW_ELEMENTS elements a program, e.g. 16 rows of 128 for the q/k norms
# of a B=256 decode step (6,144 rows) where one row a program made 6,144 programs.
DEFAULT_NUM_WARPS = 8
MULTI_ROW_PROGRAMS = 256
MULTI_ROW_ELEMENTS = 4096


def default_block_rows(n: int, e: int) -> int:
    """Rows a program normalizes, of an [N, E] call that names none: a power of two."""
    rows = min(MULTI_ROW_ELEMENTS // next_power_of_2(e), n // MULTI_ROW_PROGRAMS)
    return 1 << (rows.bit_length() - 1) if rows > 1 else 1  # the largest power of two <= rows


def _load_normalized(x, scale_ref, col_ok, e: int, eps: float):
    """x [R, C] float32, zeros past column E -> x * rsqrt(mean(x^2) + eps) * scale."""
    scale = plgpu.load(scale_ref.at[pl.ds(0, x.shape[1])], mask=col_ok, other=0.0)
    ms = jnp.sum(x * x, axis=-1, keepdims=True) / e  # [R, 1]
    return x * jax.lax.rsqrt(ms + eps) * scale.astype(jnp.float32)[None, :]


def rms_norm_kernel(
    x_ref,  # [N, E]
    scale_ref,  # [E]
    o_ref,  # [N, E]
    *,
    eps: float,
    block_rows: int,
    block_cols: int,
):
    n, e = x_ref.shape
    tile, mask, col_ok = row_tile(n, e, block_rows, block_cols)
    x = plgpu.load(x_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)  # [R, C]
    y = _load_normalized(x, scale_ref, col_ok, e, eps)
    plgpu.store(o_ref.at[tile], y.astype(o_ref.dtype), mask=mask)


def add_rms_norm_kernel(
    partials_ref,  # [S, N, E] float32
    linear_bias_ref,  # [E], or None: no bias
    residual_ref,  # [N, E]
    scale_ref,  # [E]
    h_ref,  # [N, E]: residual + sum of partials + linear bias
    o_ref,  # [N, E]: rms_norm(h)
    *,
    eps: float,
    block_rows: int,
    block_cols: int,
):
    _, n, e = partials_ref.shape
    tile, mask, col_ok = row_tile(n, e, block_rows, block_cols)
    h = load_residual_sum(partials_ref, linear_bias_ref, residual_ref, h_ref, tile, mask, col_ok)
    y = _load_normalized(h, scale_ref, col_ok, e, eps)
    plgpu.store(o_ref.at[tile], y.astype(o_ref.dtype), mask=mask)


_STATIC = ["eps", "block_rows", "num_warps", "interpret"]


@functools.partial(jax.jit, static_argnames=_STATIC)
def rms_norm(
    x: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    *,
    eps: float = 1e-6,
    block_rows: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool = False,
) -> jax.Array:  # [N, E], x's dtype
    """x * rsqrt(mean(x^2) + eps) * scale over each row of x, `block_rows` rows a program (None:
    `default_block_rows`)."""
    if x.ndim != 2 or scale.shape != (x.shape[1],):
        raise ValueError(f"need x [N, E] and scale [E], got {x.shape}, {scale.shape}")
    (y,) = row_call(
        rms_norm_kernel,
        (x, scale),
        1,
        x,
        "rms_norm",
        eps=eps,
        block_rows=default_block_rows(*x.shape) if block_rows is None else block_rows,
        num_warps=num_warps,
        interpret=interpret,
    )
    return y


def rms_norm_reference(
    x: jax.Array,  # [N, E] (or [..., E])
    scale: jax.Array,  # [E]
    *,
    eps: float = 1e-6,
) -> jax.Array:
    """Plain XLA, as HF's `LlamaRMSNorm`: the mean square in float32, x / rms rounded to x's
    dtype, then times the scale."""
    xf = x.astype(jnp.float32)
    ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return scale * (xf * jax.lax.rsqrt(ms + eps)).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC)
def add_rms_norm(
    partials: jax.Array,  # [S, N, E] float32
    linear_bias: jax.Array | None,  # [E]; None: no bias
    residual: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    *,
    eps: float = 1e-6,
    block_rows: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # h [N, E], rms_norm(h) [N, E], both in residual's dtype
    """h = residual + sum(partials) + linear_bias (rounded to residual's dtype) and its RMSNorm,
    in one kernel; `block_rows` as `rms_norm`'s."""
    check_residual_sum(partials, linear_bias, residual, scale=scale)
    return row_call(
        add_rms_norm_kernel,
        (partials, linear_bias, residual, scale),
        2,
        residual,
        "add_rms_norm",
        eps=eps,
        block_rows=(default_block_rows(*residual.shape) if block_rows is None else block_rows),
        num_warps=num_warps,
        interpret=interpret,
    )


def add_rms_norm_reference(
    partials: jax.Array,  # [S, N, E] float32
    linear_bias: jax.Array | None,  # [E]; None: no bias
    residual: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    *,
    eps: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """Plain XLA: `finish_partial_sums`, then `rms_norm_reference`."""
    check_residual_sum(partials, linear_bias, residual, scale=scale)
    h = finish_partial_sums(partials, linear_bias, residual)
    return h, rms_norm_reference(h, scale, eps=eps)
