"""x @ w + b for a few rows, with the epilogue GPT-2 puts after it, in one kernel.

At small decode batches (16 rows) a matmul only streams its weights. XLA's Triton GEMMs split K
over several programs there to get enough of them, and then need a second kernel to sum the
float32 partials; the bias, the GELU or the residual add run in that second kernel. GPT-2 has 48
such pairs a decode step, each costing a launch. Here one program owns `block_n` output columns
for all rows, streams its [K, block_n] slice of w once (enough programs: N / block_n of them), and
applies bias, activation and residual before it stores.

A program's K loop is serial, and each step waits on memory: a long K over few column tiles
(GPT-2's MLP down-projection, K=3072 over 768 columns) left 24 programs streaming 12 tiles each,
9 µs on an H200 against 4 µs for the other three matmuls. So K is split when a program would
stream more than `max_k_steps` tiles: programs write float32 partial sums, and the epilogue runs
after their sum in XLA (one fused kernel).

Layout: x [M, K]; w [K, N] (flax's Dense kernel); b [N]; residual [M, N] or None; out [M, N].
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import filter_triton_deprecation, is_power_of_2, next_power_of_2

ACTIVATIONS = (None, "gelu_tanh")
# From an H100 sweep at 16 rows (bench/RESULTS.md, session 10): a 256-deep K tile was the best of
# 64/128/256/512; 32 columns beat 16 and 64; 4 warps beat 2 and 8.
DEFAULT_BLOCK_N = 32
DEFAULT_BLOCK_K = 256
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
DEFAULT_MAX_K_STEPS = 4


def linear_supported(k: int, n: int, block_k: int = DEFAULT_BLOCK_K,
                     block_n: int = DEFAULT_BLOCK_N) -> bool:
    """Whether K and N tile: each needs a power-of-two divisor >= 16 (the matrix units' least)
    within the block size. A dispatcher sends other shapes to `linear_reference`."""
    return min(math.gcd(block_k, k), math.gcd(block_n, n)) >= 16


def split_count(k_steps: int, max_k_steps: int) -> int:
    """The fewest programs over K that give each at most `max_k_steps` of the `k_steps` tiles
    (a divisor of k_steps, so every split streams the same number)."""
    return next(s for s in range(1, k_steps + 1)
                if k_steps % s == 0 and k_steps // s <= max_k_steps)


def _epilogue(y, bias, residual, activation: str | None):
    """y [M, N] float32 -> + bias, activation, + residual (all float32)."""
    y = y + bias.astype(jnp.float32)[None, :]
    if activation == "gelu_tanh":  # GPT-2's gelu_new
        y = jax.nn.gelu(y, approximate=True)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y


def linear_kernel(
    x_ref,  # [M, K]
    w_ref,  # [K, N]
    *refs,  # o_ref [S, M, N] float32 (partial sums over K), or b_ref [N], (residual_ref [M, N],) o_ref [M, N]
    block_m: int,
    block_n: int,
    block_k: int,
    k_steps: int,  # K tiles this program streams: K // block_k, or its share of a split
    activation: str | None,
):
    o_ref = refs[-1]
    m = x_ref.shape[0]
    cols = pl.ds(pl.program_id(0) * block_n, block_n)
    row_ok = (jnp.arange(block_m) < m)[:, None]  # [BM, 1]: rows past M are padding

    def body(i, acc):  # acc [BM, BN] float32
        x = plgpu.load(x_ref.at[pl.ds(0, block_m), pl.ds(i * block_k, block_k)], mask=row_ok,
                       other=0.0)  # [BM, BK]
        w = w_ref[pl.ds(i * block_k, block_k), cols]  # [BK, BN]
        # float32 weights: full precision, not TF32 (a float32 model is there to match HF).
        precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
        return acc + jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

    first = pl.program_id(1) * k_steps
    acc = jax.lax.fori_loop(first, first + k_steps, body,
                            jnp.zeros((block_m, block_n), jnp.float32))
    if o_ref.ndim == 3:  # partial sums: whoever reads them applies the epilogue
        plgpu.store(o_ref.at[pl.program_id(1), pl.ds(0, block_m), cols], acc, mask=row_ok)
        return
    b_ref, residual_ref = refs[0], (refs[1] if len(refs) == 3 else None)
    residual = None
    if residual_ref is not None:
        residual = plgpu.load(residual_ref.at[pl.ds(0, block_m), cols], mask=row_ok, other=0.0)
    y = _epilogue(acc, b_ref[cols], residual, activation)
    plgpu.store(o_ref.at[pl.ds(0, block_m), cols], y.astype(o_ref.dtype), mask=row_ok)


TILE_ARGS = ["block_n", "block_k", "num_warps", "num_stages", "max_k_steps", "interpret"]


@functools.partial(jax.jit, static_argnames=["activation", *TILE_ARGS])
def linear(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [K, N]
    b: jax.Array,  # [N]
    residual: jax.Array | None = None,  # [M, N]
    *,
    activation: str | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    block_k: int = DEFAULT_BLOCK_K,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    max_k_steps: int = DEFAULT_MAX_K_STEPS,
    interpret: bool = False,
) -> jax.Array:  # [M, N], x's dtype
    """activation(x @ w + b) + residual, float32 inside, for few rows (all rows are one tile:
    [next_power_of_2(max(M, 16)), block_n] per program). block_n / block_k shrink to the largest
    power of two dividing N / K. K is split over programs when one would stream more than
    `max_k_steps` tiles of block_k; the epilogue then runs after their sum, in XLA."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or b.shape != (w.shape[1],):
        raise ValueError(f"need x [M, K], w [K, N], b [N], got {x.shape}, {w.shape}, {b.shape}")
    m, n = x.shape[0], w.shape[1]
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"residual must be [{m}, {n}], got {residual.shape}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    tiles = dict(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                 max_k_steps=max_k_steps, interpret=interpret)
    if _split_count(x, w, block_k, max_k_steps) > 1:
        partials = linear_partial_sums(x, w, **tiles)
        return _epilogue(partials.sum(axis=0), b, residual, activation).astype(x.dtype)
    operands = (b,) if residual is None else (b, residual)
    name = f"linear_{activation or 'none'}{'_res' if residual is not None else ''}"
    return _pallas_linear(x, w, operands, jax.ShapeDtypeStruct((m, n), x.dtype), name,
                          activation=activation, **tiles)


@functools.partial(jax.jit, static_argnames=TILE_ARGS)
def linear_partial_sums(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [K, N]
    *,
    block_n: int = DEFAULT_BLOCK_N,
    block_k: int = DEFAULT_BLOCK_K,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    max_k_steps: int = DEFAULT_MAX_K_STEPS,
    interpret: bool = False,
) -> jax.Array:  # [S, M, N] float32, S >= 1 splits of K
    """x @ w as float32 partial sums over S splits of K (S = 1 when no program would stream more
    than `max_k_steps` tiles), for a consumer that applies the epilogue itself
    (`pallas_kernels.layer_norm.add_layer_norm`)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"need x [M, K], w [K, N], got {x.shape}, {w.shape}")
    splits = _split_count(x, w, block_k, max_k_steps)
    out = jax.ShapeDtypeStruct((splits, x.shape[0], w.shape[1]), jnp.float32)
    return _pallas_linear(x, w, (), out, f"linear_partial_s{splits}", activation=None,
                          block_n=block_n, block_k=block_k, num_warps=num_warps,
                          num_stages=num_stages, max_k_steps=max_k_steps, interpret=interpret)


def _split_count(x, w, block_k: int, max_k_steps: int) -> int:
    if max_k_steps < 1:
        raise ValueError(f"max_k_steps must be >= 1, got {max_k_steps}")
    k = x.shape[1]
    return split_count(k // math.gcd(block_k, k), max_k_steps)


def _pallas_linear(x, w, operands, out: jax.ShapeDtypeStruct, name: str, *, activation,
                   block_n: int, block_k: int, num_warps: int, num_stages: int,
                   max_k_steps: int, interpret: bool) -> jax.Array:
    """The kernel over x, w and `operands` (bias and residual, or none for partial sums)."""
    (m, k), n = x.shape, w.shape[1]
    if not (is_power_of_2(block_n) and is_power_of_2(block_k)):
        raise ValueError(f"block_n and block_k must be powers of two, got {block_n}, {block_k}")
    if not linear_supported(k, n, block_k, block_n):
        raise ValueError(f"N={n} and K={k} need a power-of-two divisor >= 16 for the tiles "
                         f"(the matrix units' least) within {block_n}, {block_k}")
    # Tiles must divide the matrix; shrink them to the largest power of two that does.
    block_n, block_k = math.gcd(block_n, n), math.gcd(block_k, k)
    splits = split_count(k // block_k, max_k_steps)
    if not interpret:
        filter_triton_deprecation()
    return pl.pallas_call(
        functools.partial(linear_kernel, block_m=max(16, next_power_of_2(m)),  # the MMA's least M
                          block_n=block_n, block_k=block_k, k_steps=k // block_k // splits,
                          activation=activation),
        grid=(n // block_n, splits),
        out_shape=out,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"{name}_n{block_n}",
    )(x, w, *operands)


def linear_reference(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [K, N]
    b: jax.Array,  # [N]
    residual: jax.Array | None = None,  # [M, N]
    *,
    activation: str | None = None,
) -> jax.Array:  # [M, N]
    """Plain XLA, as flax's Dense computes it (x @ w + b in x's dtype), then the epilogue."""
    y = jnp.dot(x, w) + b
    if activation == "gelu_tanh":
        y = jax.nn.gelu(y, approximate=True)
    return y if residual is None else residual + y
