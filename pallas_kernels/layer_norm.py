"""Layer norm over the last axis in one kernel.

XLA lowers a layer norm to two kernels, a row reduction (the sums of x and x^2) and an elementwise
normalize: at decode sizes ([B, 768] with B <= 256) both are launch- and latency-bound, and GPT-2
has 25 layer norms a step. Here one program reads `block_rows` rows once, takes their statistics and
writes them normalized. Statistics in float32, like flax's `nn.LayerNorm` (E[x^2] - E[x]^2).

Layout: x [N, E] (any E; the row is loaded as a power-of-two tile, masked past E); scale, bias [E].

`add_layer_norm` is GPT-2's residual step and the next layer norm in one kernel: h = the float32
partial sums [S, N, E] of a linear layer (`pallas_kernels.linear.linear_partial_sums`) + that
layer's bias + the residual, stored in the residual's dtype, and layer_norm(h). The linear then
needs no epilogue kernel of its own, and the layer norm no launch of its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._row_norm import check_residual_sum, load_residual_sum, row_call, row_tile
from pallas_kernels.linear import finish_partial_sums

# Tuned defaults of both kernels, timed inside the decode step (a loop of single calls hides them
# behind dispatch): the card each was tuned on and why, in a line (figures:
# docs/performance-log.md, section "Layer norm").
DEFAULT_BLOCK_ROWS = 1  # H200 and H100, B=1: beat 4 rows (H200, 4 warps: 0.384 vs 0.400 ms/step)
DEFAULT_NUM_WARPS = 8  # H200, one process: beat 4 by 0.6-0.9% at B=1 and 16, 0.2-0.6% at 256


def _normalize(x, scale, bias, e: int, eps: float):
    """x [R, C] float32 (zeros past column E) -> (x - mean) / sqrt(var + eps) * scale + bias."""
    mean = jnp.sum(x, axis=-1, keepdims=True) / e  # [R, 1]
    var = jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True) / e - mean * mean, 0.0)  # [R, 1]
    y = (x - mean) * (jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32))
    return y + bias.astype(jnp.float32)


def _load_normalized(x, scale_ref, bias_ref, col_ok, e: int, eps: float):
    """x [R, C] float32, zeros past column E (so the sums hold) -> its layer norm."""
    scale = plgpu.load(scale_ref.at[pl.ds(0, x.shape[1])], mask=col_ok, other=0.0)
    bias = plgpu.load(bias_ref.at[pl.ds(0, x.shape[1])], mask=col_ok, other=0.0)
    return _normalize(x, scale, bias, e, eps)


def layer_norm_kernel(
    x_ref,  # [N, E]
    scale_ref,  # [E]
    bias_ref,  # [E]
    o_ref,  # [N, E]
    *,
    eps: float,
    block_rows: int,
    block_cols: int,
):
    n, e = x_ref.shape
    tile, mask, col_ok = row_tile(n, e, block_rows, block_cols)
    x = plgpu.load(x_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)  # [R, C]
    y = _load_normalized(x, scale_ref, bias_ref, col_ok, e, eps)
    plgpu.store(o_ref.at[tile], y.astype(o_ref.dtype), mask=mask)


def add_layer_norm_kernel(
    partials_ref,  # [S, N, E] float32
    linear_bias_ref,  # [E], or None: no bias
    residual_ref,  # [N, E]
    scale_ref,  # [E]
    bias_ref,  # [E]
    h_ref,  # [N, E]: residual + sum of partials + linear bias
    o_ref,  # [N, E]: layer_norm(h)
    *,
    eps: float,
    block_rows: int,
    block_cols: int,
):
    _, n, e = partials_ref.shape
    tile, mask, col_ok = row_tile(n, e, block_rows, block_cols)
    h = load_residual_sum(partials_ref, linear_bias_ref, residual_ref, h_ref, tile, mask, col_ok)
    y = _load_normalized(h, scale_ref, bias_ref, col_ok, e, eps)
    plgpu.store(o_ref.at[tile], y.astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=["eps", "block_rows", "num_warps", "interpret"])
def layer_norm(
    x: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    bias: jax.Array,  # [E]
    *,
    eps: float = 1e-5,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool = False,
) -> jax.Array:  # [N, E], x's dtype
    """(x - mean) / sqrt(var + eps) * scale + bias over each row of x."""
    if x.ndim != 2 or scale.shape != (x.shape[1],) or bias.shape != (x.shape[1],):
        raise ValueError(
            f"need x [N, E], scale and bias [E], got {x.shape}, {scale.shape}, {bias.shape}"
        )
    (y,) = row_call(
        layer_norm_kernel,
        (x, scale, bias),
        1,
        x,
        "layer_norm",
        eps=eps,
        block_rows=block_rows,
        num_warps=num_warps,
        interpret=interpret,
    )
    return y


def layer_norm_reference(
    x: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    bias: jax.Array,  # [E]
    *,
    eps: float = 1e-5,
) -> jax.Array:  # [N, E]
    """Plain XLA, the statistics in float32 as flax's `nn.LayerNorm` takes them."""
    return _normalize(x.astype(jnp.float32), scale, bias, x.shape[-1], eps).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=["eps", "block_rows", "num_warps", "interpret"])
def add_layer_norm(
    partials: jax.Array,  # [S, N, E] float32
    linear_bias: jax.Array | None,  # [E]; None: no bias
    residual: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    bias: jax.Array,  # [E]
    *,
    eps: float = 1e-5,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # h [N, E], layer_norm(h) [N, E], both in residual's dtype
    """h = residual + sum(partials) + linear_bias (rounded to residual's dtype) and its layer
    norm, in one kernel."""
    check_residual_sum(partials, linear_bias, residual, scale=scale, bias=bias)
    return row_call(
        add_layer_norm_kernel,
        (partials, linear_bias, residual, scale, bias),
        2,
        residual,
        "add_layer_norm",
        eps=eps,
        block_rows=block_rows,
        num_warps=num_warps,
        interpret=interpret,
    )


def add_layer_norm_reference(
    partials: jax.Array,  # [S, N, E] float32
    linear_bias: jax.Array | None,  # [E]; None: no bias
    residual: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    bias: jax.Array,  # [E]
    *,
    eps: float = 1e-5,
) -> tuple[jax.Array, jax.Array]:
    """Plain XLA: `finish_partial_sums`, then `layer_norm_reference`."""
    check_residual_sum(partials, linear_bias, residual, scale=scale, bias=bias)
    h = finish_partial_sums(partials, linear_bias, residual)
    return h, layer_norm_reference(h, scale, bias, eps=eps)
