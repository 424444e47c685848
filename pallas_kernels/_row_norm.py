"""What the row-wise norm kernels (layer norm, RMSNorm) share: the row tile a program owns, the
launch over row tiles, and the residual stream a deferred `Linear` leaves (its partial sums, bias
and residual) summed inside the norm's kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    filter_triton_deprecation,
    is_power_of_2,
    next_power_of_2,
    without_absent,
)


def row_tile(n: int, e: int, block_rows: int, block_cols: int):
    """This program's [R, C] tile of an [N, E] array: (its index, the mask of real elements,
    the mask of real columns [C])."""
    first = pl.program_id(0) * block_rows
    rows = first + jnp.arange(block_rows, dtype=jnp.int32)  # [R]
    col_ok = jnp.arange(block_cols, dtype=jnp.int32) < e  # [C]
    mask = (rows < n)[:, None] & col_ok[None, :]  # [R, C]
    return (pl.ds(first, block_rows), pl.ds(0, block_cols)), mask, col_ok


def load_residual_sum(partials_ref, linear_bias_ref, residual_ref, h_ref, tile, mask, col_ok):
    """residual + the partial sums + linear bias (None: none) of this tile, rounded to the
    residual stream's dtype as the unfused layers store and reload it, stored to h_ref -> that
    sum in float32."""
    splits = partials_ref.shape[0]
    # The order of `finish_partial_sums` (the splits, then bias, then residual): the same sums.
    acc = plgpu.load(partials_ref.at[(jnp.int32(0), *tile)], mask=mask, other=0.0)
    for s in range(1, splits):
        acc += plgpu.load(partials_ref.at[(jnp.int32(s), *tile)], mask=mask, other=0.0)
    if linear_bias_ref is not None:
        bias = plgpu.load(linear_bias_ref.at[tile[1]], mask=col_ok, other=0.0)
        acc += bias.astype(jnp.float32)[None, :]
    acc += plgpu.load(residual_ref.at[tile], mask=mask, other=0.0).astype(jnp.float32)
    h = acc.astype(h_ref.dtype)  # [R, C]
    plgpu.store(h_ref.at[tile], h, mask=mask)
    return h.astype(jnp.float32)


def row_call(
    kernel,
    operands,
    num_outputs: int,
    like: jax.Array,
    name: str,
    *,
    eps: float,
    block_rows: int,
    num_warps: int,
    interpret: bool,
) -> tuple[jax.Array, ...]:
    """A kernel over row tiles of [N, E] arrays: `num_outputs` outputs shaped like `like`;
    `operands` may hold None (absent: the kernel gets None for its ref)."""
    if not is_power_of_2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    n, e = like.shape
    if not interpret:
        filter_triton_deprecation()
    # The row as one tile, masked past E.
    tiled = functools.partial(kernel, eps=eps, block_rows=block_rows, block_cols=next_power_of_2(e))
    tiled, operands = without_absent(tiled, operands)
    return pl.pallas_call(
        tiled,
        grid=(pl.cdiv(n, block_rows),),
        out_shape=(jax.ShapeDtypeStruct(like.shape, like.dtype),) * num_outputs,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"{name}_r{block_rows}_w{num_warps}",
    )(*operands)


def check_residual_sum(partials, linear_bias, residual, **params: jax.Array) -> None:
    """The shapes of an add-and-norm call: float32 partials [S, N, E], residual [N, E], the
    linear bias (or None) and every norm parameter in `params` [E]."""
    vectors = {"linear_bias": linear_bias, **params} if linear_bias is not None else params
    if (
        partials.ndim != 3
        or partials.dtype != jnp.float32
        or residual.shape != partials.shape[1:]
        or any(a.shape != (residual.shape[1],) for a in vectors.values())
    ):
        raise ValueError(
            f"need float32 partials [S, N, E], residual [N, E], {', '.join(vectors)} [E], got "
            f"{partials.dtype}{list(partials.shape)}, {residual.shape}, "
            + ", ".join(str(a.shape) for a in vectors.values())
        )
