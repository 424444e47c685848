"""Layer norm over the last axis in one kernel.

XLA lowers a layer norm to two kernels, a row reduction (the sums of x and x^2) and an elementwise
normalize: at decode sizes ([B, 768] with B <= 256) both are launch- and latency-bound, and GPT-2
has 25 layer norms a step. Here one program reads `block_rows` rows once, takes their statistics and
writes them normalized. Statistics in float32, like flax's `nn.LayerNorm` (E[x^2] - E[x]^2).

Layout: x [N, E] (any E; the row is loaded as a power-of-two tile, masked past E); scale, bias [E].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import filter_triton_deprecation, is_power_of_2, next_power_of_2


def _normalize(x, scale, bias, e: int, eps: float):
    """x [R, C] float32 (zeros past column E) -> (x - mean) / sqrt(var + eps) * scale + bias."""
    mean = jnp.sum(x, axis=-1, keepdims=True) / e  # [R, 1]
    var = jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True) / e - mean * mean, 0.0)  # [R, 1]
    y = (x - mean) * (jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32))
    return y + bias.astype(jnp.float32)


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
    first = pl.program_id(0) * block_rows
    rows = first + jnp.arange(block_rows, dtype=jnp.int32)  # [R]
    cols = jnp.arange(block_cols, dtype=jnp.int32)  # [C]
    col_ok = cols < e
    mask = (rows < n)[:, None] & col_ok[None, :]  # [R, C]
    x = plgpu.load(x_ref.at[pl.ds(first, block_rows), pl.ds(0, block_cols)], mask=mask,
                   other=0.0).astype(jnp.float32)  # [R, C]
    scale = plgpu.load(scale_ref.at[pl.ds(0, block_cols)], mask=col_ok, other=0.0)
    bias = plgpu.load(bias_ref.at[pl.ds(0, block_cols)], mask=col_ok, other=0.0)
    y = _normalize(x, scale, bias, e, eps)  # columns past E are zeros: the sums hold
    plgpu.store(o_ref.at[pl.ds(first, block_rows), pl.ds(0, block_cols)],
                y.astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=["eps", "block_rows", "num_warps", "interpret"])
def layer_norm(
    x: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    bias: jax.Array,  # [E]
    *,
    eps: float = 1e-5,
    block_rows: int = 4,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:  # [N, E], x's dtype
    """(x - mean) / sqrt(var + eps) * scale + bias over each row of x."""
    if x.ndim != 2 or scale.shape != (x.shape[1],) or bias.shape != (x.shape[1],):
        raise ValueError(f"need x [N, E], scale and bias [E], got {x.shape}, {scale.shape}, "
                         f"{bias.shape}")
    if not is_power_of_2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    n, e = x.shape
    block_cols = next_power_of_2(e)  # the row as one tile, masked past E
    if not interpret:
        filter_triton_deprecation()
    return pl.pallas_call(
        functools.partial(layer_norm_kernel, eps=eps, block_rows=block_rows,
                          block_cols=block_cols),
        grid=(pl.cdiv(n, block_rows),),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"layer_norm_r{block_rows}_w{num_warps}",
    )(x, scale, bias)


def layer_norm_reference(
    x: jax.Array,  # [N, E]
    scale: jax.Array,  # [E]
    bias: jax.Array,  # [E]
    *,
    eps: float = 1e-5,
) -> jax.Array:  # [N, E]
    """Plain XLA, the statistics in float32 as flax's `nn.LayerNorm` takes them."""
    return _normalize(x.astype(jnp.float32), scale, bias, x.shape[-1], eps).astype(x.dtype)
