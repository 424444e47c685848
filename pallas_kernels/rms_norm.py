"""RMSNorm over the last axis in one kernel, and the residual add before it in the same kernel.

Llama-style models normalize twice a layer (and Qwen3 twice more, q and k of every head): XLA
lowers each RMSNorm to a row reduction and an elementwise kernel. Here one program reads
`block_rows` rows once, takes their mean square in float32 and writes them normalized:
x * rsqrt(mean(x^2) + eps) * scale.

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

from pallas_kernels._common import filter_triton_deprecation, is_power_of_2, next_power_of_2
from pallas_kernels.linear import finish_partial_sums

# Not measured yet: the layer norm's (one row, four warps per program).
DEFAULT_BLOCK_ROWS = 1
DEFAULT_NUM_WARPS = 4


def _row_tile(n: int, e: int, block_rows: int, block_cols: int):
    first = pl.program_id(0) * block_rows
    rows = first + jnp.arange(block_rows, dtype=jnp.int32)  # [R]
    col_ok = jnp.arange(block_cols, dtype=jnp.int32) < e  # [C]
    mask = (rows < n)[:, None] & col_ok[None, :]  # [R, C]
    return (pl.ds(first, block_rows), pl.ds(0, block_cols)), mask, col_ok


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
    tile, mask, col_ok = _row_tile(n, e, block_rows, block_cols)
    x = plgpu.load(x_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)  # [R, C]
    y = _load_normalized(x, scale_ref, col_ok, e, eps)
    plgpu.store(o_ref.at[tile], y.astype(o_ref.dtype), mask=mask)


def add_rms_norm_kernel(
    partials_ref,  # [S, N, E] float32
    linear_bias_ref,  # [E]
    residual_ref,  # [N, E]
    scale_ref,  # [E]
    h_ref,  # [N, E]: residual + sum of partials + linear bias
    o_ref,  # [N, E]: rms_norm(h)
    *,
    eps: float,
    block_rows: int,
    block_cols: int,
):
    splits, n, e = partials_ref.shape
    tile, mask, col_ok = _row_tile(n, e, block_rows, block_cols)
    # The order of `finish_partial_sums` (the splits, then bias, then residual): the same sums.
    acc = plgpu.load(partials_ref.at[(jnp.int32(0), *tile)], mask=mask, other=0.0)
    for s in range(1, splits):
        acc += plgpu.load(partials_ref.at[(jnp.int32(s), *tile)], mask=mask, other=0.0)
    bias = plgpu.load(linear_bias_ref.at[tile[1]], mask=col_ok, other=0.0)
    acc += bias.astype(jnp.float32)[None, :]
    acc += plgpu.load(residual_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)
    h = acc.astype(h_ref.dtype)  # [R, C]: rounded as the unfused layers store and reload it
    plgpu.store(h_ref.at[tile], h, mask=mask)
    y = _load_normalized(h.astype(jnp.float32), scale_ref, col_ok, e, eps)
    plgpu.store(o_ref.at[tile], y.astype(o_ref.dtype), mask=mask)


def _row_call(kernel, operands, num_outputs, like, name, *, eps, block_rows, num_warps, interpret):
    """A kernel over row tiles of [N, E] arrays: `num_outputs` outputs shaped like `like`."""
    if not is_power_of_2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    n, e = like.shape
    if not interpret:
        filter_triton_deprecation()
    return pl.pallas_call(
        functools.partial(kernel, eps=eps, block_rows=block_rows, block_cols=next_power_of_2(e)),
        grid=(pl.cdiv(n, block_rows),),
        out_shape=(jax.ShapeDtypeStruct(like.shape, like.dtype),) * num_outputs,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"{name}_r{block_rows}_w{num_warps}",
    )(*operands)


_STATIC = ["eps", "block_rows", "num_warps", "interpret"]


@functools.partial(jax.jit, static_argnames=_STATIC)
def rms_norm(
    x: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    *,
    eps: float = 1e-6,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool = False,
) -> jax.Array:  # [N, E], x's dtype
    """x * rsqrt(mean(x^2) + eps) * scale over each row of x."""
    if x.ndim != 2 or scale.shape != (x.shape[1],):
        raise ValueError(f"need x [N, E] and scale [E], got {x.shape}, {scale.shape}")
    (y,) = _row_call(
        rms_norm_kernel,
        (x, scale),
        1,
        x,
        "rms_norm",
        eps=eps,
        block_rows=block_rows,
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


def _check_add_rms_norm(partials, linear_bias, residual, scale) -> None:
    if (
        partials.ndim != 3
        or partials.dtype != jnp.float32
        or residual.shape != partials.shape[1:]
        or any(a.shape != (residual.shape[1],) for a in (linear_bias, scale))
    ):
        raise ValueError(
            f"need float32 partials [S, N, E], residual [N, E], linear_bias and scale [E], got "
            f"{partials.dtype}{list(partials.shape)}, {residual.shape}, {linear_bias.shape}, "
            f"{scale.shape}"
        )


@functools.partial(jax.jit, static_argnames=_STATIC)
def add_rms_norm(
    partials: jax.Array,  # [S, N, E] float32
    linear_bias: jax.Array,  # [E]
    residual: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    *,
    eps: float = 1e-6,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # h [N, E], rms_norm(h) [N, E], both in residual's dtype
    """h = residual + sum(partials) + linear_bias (rounded to residual's dtype) and its RMSNorm,
    in one kernel."""
    _check_add_rms_norm(partials, linear_bias, residual, scale)
    return _row_call(
        add_rms_norm_kernel,
        (partials, linear_bias, residual, scale),
        2,
        residual,
        "add_rms_norm",
        eps=eps,
        block_rows=block_rows,
        num_warps=num_warps,
        interpret=interpret,
    )


def add_rms_norm_reference(
    partials: jax.Array,  # [S, N, E] float32
    linear_bias: jax.Array,  # [E]
    residual: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    *,
    eps: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """Plain XLA: `finish_partial_sums`, then `rms_norm_reference`."""
    _check_add_rms_norm(partials, linear_bias, residual, scale)
    h = finish_partial_sums(partials, linear_bias, residual)
    return h, rms_norm_reference(h, scale, eps=eps)
