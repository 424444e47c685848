"""x @ w + b for a few rows, with the epilogue GPT-2 puts after it, in one kernel.

At small decode batches (16 rows) a matmul only streams its weights. XLA's Triton GEMMs split K
over several programs there to get enough of them, and then need a second kernel to sum the
float32 partials; the bias, the GELU or the residual add run in that second kernel. GPT-2 has 48
such pairs a decode step, each costing a launch. Here one program owns `block_n` output columns
for all rows (up to `block_m` of them; more rows take more programs), streams its [K, block_n]
slice of w (N / block_n programs), and applies bias, activation and residual before it stores.

A program's K loop is serial, and each step waits on memory: a long K over few column tiles
(GPT-2's MLP down-projection, K=3072 over 768 columns) left 24 programs streaming 12 tiles each,
9 µs on an H200 against 4 µs for the other three matmuls. So K is split when a program would
stream more than `max_k_steps` tiles, unless the output tiles alone give about a program per SM
(`fill_programs`; a Llama-3.1-8B projection has 128-448 of them): each program then writes its
float32 partial sums (`linear_partial_sums`), and the epilogue runs after their sum
(`finish_partial_sums`, one XLA kernel, or the next layer norm:
`pallas_kernels.layer_norm.add_layer_norm`). The default of 4 tiles was measured on GPT-2 small
only (`DEFAULT_MAX_K_STEPS`).

With the "swiglu" activation the kernel is a SwiGLU MLP's gate/up projection (w [K, 2F], gate
columns then up columns) and stores silu(gate) * up [M, F] (`swiglu`'s rounding): the elementwise
kernel XLA runs between the two matmuls of a Llama-style MLP goes. A program owns block_n output
columns, streams their gate and their up columns (F / block_n programs: the plain projection's
work in half as many), and computes silu on its [BM, block_n] accumulators, each value once.
(Computing it instead as the down projection loaded its input cost every one of that kernel's N
programs the whole input's silu, in the MMA operand layout that all 4 warps hold: 128 times the
work, +0.77 ms a Qwen3-0.6B step on an H100.)

Layout: x [M, K]; w [K, N] (flax's Dense kernel); b [N]; residual [M, N] or None; out [M, N]
(swiglu: [M, N / 2]); partial sums [S, M, N] float32.
"""

from __future__ import annotations

import functools
import math

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

# Tuned defaults: the card each was tuned on and why, in a line (figures: docs/performance-log.md,
# section "GEMMs: cuBLAS against XLA's Triton GEMMs, and the small-batch Pallas linear").
DEFAULT_BLOCK_M = 64  # H200, 256 rows: 64 beat 128 (still 8.6% behind cuBLAS); <= 64 rows: 1 tile
DEFAULT_BLOCK_N = 32  # H100, 16 rows: beat 16 and 64, again in one process at B=1 and 16
DEFAULT_BLOCK_K = 256  # H100, 16 rows: the best of 64, 128, 256 and 512, again in one process
DEFAULT_NUM_WARPS = 4  # H100, 16 rows: beat 2 and 8, again in one process
DEFAULT_NUM_STAGES = 4  # H100, one process, B=1 and 16: beat 3 by 0.4-0.7%; 2 was 15% slower
DEFAULT_MAX_K_STEPS = 4  # H200, GPT-2 small, B=1: best of 1, 2, 4 and 12 (-8.5% a step on 12)
# Output tiles that already give about a program per SM (an H100's 132) keep K in one split: more
# programs would not stream faster, and the split's partial sums need a kernel to add them.
# H100, Llama-3.1-8B B=1: -9.3% a step at TP=1, -5.9% at TP=2 against no threshold (64, 32: same).
DEFAULT_FILL_PROGRAMS = 128
# Shared memory a program may take on an H100 or H200. The pipeline holds num_stages tiles of x
# and of each weight it streams: 4 stages of a SwiGLU program's float32 gate and up tiles at
# block_k 256 asked 240 KiB (Qwen3-0.6B fp32 at 16 rows), so block_k halves until they fit.
SHARED_MEMORY_BYTES = 227 * 1024

ACTIVATIONS = (None, "gelu_tanh", "swiglu")


def linear_supported(
    k: int,
    n: int,
    block_k: int = DEFAULT_BLOCK_K,
    block_n: int = DEFAULT_BLOCK_N,
    activation: str | None = None,
) -> bool:
    """Whether K and N tile: each needs a power-of-two divisor >= 16 (the matrix units' least)
    within the block size (swiglu: F = N / 2 for N). A dispatcher sends other shapes to
    `linear_reference`."""
    if activation == "swiglu":
        if n % 2:
            return False
        n //= 2
    return min(math.gcd(block_k, k), math.gcd(block_n, n)) >= 16


def split_count(k_steps: int, max_k_steps: int) -> int:
    """Programs over K so that none streams more than `max_k_steps` of the `k_steps` tiles, the
    tiles shared out as evenly as they go (`_tiles` gives each split the same count but the last,
    which may have fewer)."""
    if max_k_steps < 1:
        raise ValueError(f"max_k_steps must be >= 1, got {max_k_steps}")
    per_split = -(-k_steps // -(-k_steps // max_k_steps))
    return -(-k_steps // per_split)


def _tiles(
    m: int,
    k: int,
    n: int,
    block_m: int,
    block_n: int,
    block_k: int,
    max_k_steps: int,
    fill_programs: int,
    *,
    itemsize: int,
    num_stages: int,
    weight_tiles: int = 1,
) -> dict:
    """The kernel's static tiling of an [M, K] @ [K, N] call (N: the columns a program's tile
    covers, F for swiglu, whose programs stream `weight_tiles` = 2 tiles of w a step), checked;
    block_k halved until `num_stages` tiles of x and w of `itemsize` fit SHARED_MEMORY_BYTES."""
    if not (is_power_of_2(block_n) and is_power_of_2(block_k)):
        raise ValueError(f"block_n and block_k must be powers of two, got {block_n}, {block_k}")
    if not (is_power_of_2(block_m) and block_m >= 16):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if fill_programs < 0:
        raise ValueError(f"fill_programs must be >= 0 (0: any number), got {fill_programs}")
    if not linear_supported(k, n, block_k, block_n):
        raise ValueError(
            f"N={n} and K={k} need a power-of-two divisor >= 16 for the tiles "
            f"(the matrix units' least) within {block_n}, {block_k}"
        )
    # Tiles must divide the matrix; shrink them to the largest power of two that does.
    block_n, block_k = math.gcd(block_n, n), math.gcd(block_k, k)
    # Never more rows than M rounds up to; the matrix units' least M is 16.
    block_m = min(block_m, max(16, next_power_of_2(m)))
    step_bytes = (block_m + weight_tiles * block_n) * itemsize  # x's and w's per row of K
    while block_k > 16 and num_stages * block_k * step_bytes > SHARED_MEMORY_BYTES:
        block_k //= 2
    k_steps = k // block_k
    m_tiles = -(-m // block_m)
    fills = 0 < fill_programs <= m_tiles * (n // block_n)
    splits = 1 if fills else split_count(k_steps, max_k_steps)
    return dict(
        block_m=block_m,
        m_tiles=m_tiles,
        block_n=block_n,
        block_k=block_k,
        k_steps=k_steps,
        splits=splits,
        steps_per_split=-(-k_steps // splits),
    )


def _epilogue(y, bias, residual, activation: str | None):
    """y [M, N] float32 -> + bias (if any), activation, + residual (if any), all float32."""
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    if activation == "gelu_tanh":  # GPT-2's gelu_new
        y = jax.nn.gelu(y, approximate=True)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:  # same shape and dtype -> that
    """silu(gate) * up as HF's MLP rounds it: silu in float32 rounded to the dtype, the product
    rounded again (a product of two values of the dtype is exact in float32)."""
    silu = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype)
    return (silu.astype(jnp.float32) * up.astype(jnp.float32)).astype(gate.dtype)


def swiglu(x: jax.Array) -> jax.Array:  # [..., 2K]: gate then up -> [..., K], x's dtype
    """A SwiGLU MLP's hidden activation from its fused gate/up projection: `silu_mul`."""
    gate, up = jnp.split(x, 2, axis=-1)
    return silu_mul(gate, up)


def finish_partial_sums(
    partials: jax.Array,  # [S, M, N] float32
    b: jax.Array | None,  # [N]; None: no bias
    residual: jax.Array | None = None,  # [M, N]
    *,
    activation: str | None = None,
    dtype=None,  # default: the residual's (or b's)
) -> jax.Array:  # [M, N]
    """`linear`'s epilogue over `linear_partial_sums`: the splits summed in order, then as the
    kernel finishes its own sum (swiglu: [M, N / 2])."""
    like = residual if residual is not None else b
    if dtype is None and like is None:
        raise ValueError("finish_partial_sums needs a dtype without a bias or residual")
    dtype = dtype or like.dtype
    if activation == "swiglu":  # the unfused projection's output, then `swiglu`
        return swiglu(_epilogue(partials.sum(axis=0), b, None, None).astype(dtype))
    return _epilogue(partials.sum(axis=0), b, residual, activation).astype(dtype)


def linear_kernel(
    x_ref,  # [M, K]
    w_ref,  # [K, N]
    b_ref,  # [N], or None: no bias (and None for partial sums)
    residual_ref,  # [M, N], or None
    o_ref,  # [M, N] (swiglu: [M, N / 2]); partial sums: [S, M, N] float32
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    k_steps: int,  # K // block_k
    steps_per_split: int,  # tiles of K each program streams (the last split's may be fewer)
    activation: str | None,
    partial_sums: bool,
):
    m = x_ref.shape[0]
    first_row = pl.program_id(1) * block_m
    rows, cols = pl.ds(first_row, block_m), pl.ds(pl.program_id(0) * block_n, block_n)
    row_ok = (first_row + jnp.arange(block_m) < m)[:, None]  # [BM, 1]: rows past M are padding
    # swiglu: the program's gate columns, and its up columns F = N / 2 on.
    w_cols = (cols,)
    if activation == "swiglu":
        w_cols = (cols, pl.ds(w_ref.shape[1] // 2 + pl.program_id(0) * block_n, block_n))
    # float32 weights: full precision, not TF32 (a float32 model is there to match HF).
    precision = jax.lax.Precision.HIGHEST if w_ref.dtype == jnp.float32 else None

    def body(i, accs):  # accs: ([BM, BN] float32,) per column tile
        ks = pl.ds(i * block_k, block_k)
        x = plgpu.load(x_ref.at[rows, ks], mask=row_ok, other=0.0)  # [BM, BK]
        return tuple(
            acc + jnp.dot(x, w_ref[ks, c], precision=precision, preferred_element_type=jnp.float32)
            for acc, c in zip(accs, w_cols, strict=True)
        )

    first = pl.program_id(2) * steps_per_split
    # A static trip count where the splits are even (what the compiler pipelines best).
    last = (
        first + steps_per_split
        if k_steps % steps_per_split == 0
        else jnp.minimum(first + steps_per_split, k_steps)
    )
    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = jax.lax.fori_loop(first, last, body, (zeros,) * len(w_cols))
    if partial_sums:
        plgpu.store(o_ref.at[pl.program_id(2), rows, cols], accs[0], mask=row_ok)
        return
    if activation == "swiglu":  # each half as the unfused projection rounds it, then `silu_mul`
        biases = [None if b_ref is None else b_ref[c] for c in w_cols]
        gate, up = (
            _epilogue(acc, bias, None, None).astype(o_ref.dtype)
            for acc, bias in zip(accs, biases, strict=True)
        )
        plgpu.store(o_ref.at[rows, cols], silu_mul(gate, up), mask=row_ok)
        return
    residual = None
    if residual_ref is not None:
        residual = plgpu.load(residual_ref.at[rows, cols], mask=row_ok, other=0.0)
    y = _epilogue(accs[0], None if b_ref is None else b_ref[cols], residual, activation)
    plgpu.store(o_ref.at[rows, cols], y.astype(o_ref.dtype), mask=row_ok)


_STATIC_ARGS = [
    "block_m",
    "block_n",
    "block_k",
    "num_warps",
    "num_stages",
    "max_k_steps",
    "fill_programs",
    "interpret",
]


@functools.partial(jax.jit, static_argnames=["activation", *_STATIC_ARGS])
def linear(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [K, N]
    b: jax.Array | None,  # [N]; None: no bias
    residual: jax.Array | None = None,  # [M, N]
    *,
    activation: str | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    block_k: int = DEFAULT_BLOCK_K,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    max_k_steps: int = DEFAULT_MAX_K_STEPS,
    fill_programs: int = DEFAULT_FILL_PROGRAMS,
    interpret: bool = False,
) -> jax.Array:  # [M, N] (swiglu: [M, N / 2]), x's dtype
    """activation(x @ w + b) + residual, float32 inside, for few rows (a program's tile is
    [min(block_m, next_power_of_2(max(M, 16))), block_n]). block_n / block_k shrink to the largest
    power of two dividing N / K. K is split over programs when one would stream more than
    `max_k_steps` tiles of block_k and the output tiles are fewer than `fill_programs` (0: any
    number); the epilogue then runs after their sum, in XLA. "swiglu" takes w's columns as a gate
    half and an up half: `swiglu(x @ w + b)`, no residual."""
    _check_input(x, w)
    if b is not None and b.shape != (w.shape[1],):
        raise ValueError(f"need b [N] for w {w.shape}, got {b.shape}")
    (m, k), n = (x.shape[0], w.shape[0]), w.shape[1]
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    swiglu_out = activation == "swiglu"
    if swiglu_out and (residual is not None or n % 2):
        raise ValueError(f"swiglu needs an even N and no residual, got w {w.shape}")
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"residual must be [{m}, {n}], got {residual.shape}")
    sizes = (block_m, block_n, block_k, max_k_steps, fill_programs)
    memory = dict(itemsize=w.dtype.itemsize, num_stages=num_stages)
    # swiglu: a program's block_n output columns, as many gate and up columns.
    tiles = _tiles(m, k, n // 2 if swiglu_out else n, *sizes, **memory, weight_tiles=1 + swiglu_out)
    launch = dict(num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    if tiles["splits"] > 1:
        partials = _pallas_linear(x, w, None, _tiles(m, k, n, *sizes, **memory), None, **launch)
        return finish_partial_sums(partials, b, residual, activation=activation, dtype=x.dtype)
    return _pallas_linear(x, w, (b, residual), tiles, activation, **launch)


def _check_input(x: jax.Array, w: jax.Array) -> None:
    """x [M, K] against w [K, N]."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"need x [M, K] and w [K, N], got {x.shape}, {w.shape}")


@functools.partial(jax.jit, static_argnames=_STATIC_ARGS)
def linear_partial_sums(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [K, N]
    *,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    block_k: int = DEFAULT_BLOCK_K,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    max_k_steps: int = DEFAULT_MAX_K_STEPS,
    fill_programs: int = DEFAULT_FILL_PROGRAMS,
    interpret: bool = False,
) -> jax.Array:  # [S, M, N] float32, S >= 1 splits of K
    """x @ w as float32 partial sums over S splits of K (S = 1 when no program would stream more
    than `max_k_steps` tiles, or the output tiles number `fill_programs`), for a consumer that
    applies the epilogue itself (`finish_partial_sums`,
    `pallas_kernels.layer_norm.add_layer_norm`)."""
    _check_input(x, w)
    sizes = (block_m, block_n, block_k, max_k_steps, fill_programs)
    tiles = _tiles(x.shape[0], *w.shape, *sizes, itemsize=w.dtype.itemsize, num_stages=num_stages)
    return _pallas_linear(
        x, w, None, tiles, None, num_warps=num_warps, num_stages=num_stages, interpret=interpret
    )


_GRID_ONLY = ("m_tiles", "splits")


def _pallas_linear(
    x, w, operands, tiles: dict, activation, *, num_warps: int, num_stages: int, interpret: bool
) -> jax.Array:
    """The kernel over x, w and `operands`: (bias, residual), either None, or None for the
    partial sums."""
    m, n = x.shape[0], w.shape[1] // 2 if activation == "swiglu" else w.shape[1]
    partial_sums = operands is None
    if partial_sums:
        out = jax.ShapeDtypeStruct((tiles["splits"], m, n), jnp.float32)
        name = f"linear_partial_s{tiles['splits']}"
    else:
        out = jax.ShapeDtypeStruct((m, n), x.dtype)
        name = f"linear_{activation or 'none'}{'_res' if operands[1] is not None else ''}"
    if not interpret:
        filter_triton_deprecation()
    kernel, operands = without_absent(
        functools.partial(
            linear_kernel,
            activation=activation,
            partial_sums=partial_sums,
            **{k: v for k, v in tiles.items() if k not in _GRID_ONLY},
        ),
        (x, w, *(operands or (None, None))),
    )
    return pl.pallas_call(
        kernel,
        grid=(n // tiles["block_n"], tiles["m_tiles"], tiles["splits"]),
        out_shape=out,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"{name}_n{tiles['block_n']}",
    )(*operands)


def linear_partial_sums_reference(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [K, N]
    splits: int = 1,
) -> jax.Array:  # [S, M, N] float32
    """Plain XLA: x @ w accumulated in float32, as `splits` partial sums over equal runs of K
    (one batched matmul: S times the output tiles of one)."""
    (m, k), n = x.shape, w.shape[1]
    if k % splits:
        raise ValueError(f"K={k} does not split into {splits} equal runs")
    xs = x.reshape(m, splits, k // splits)  # [M, S, K/S]
    ws = w.reshape(splits, k // splits, n)  # [S, K/S, N]
    return jnp.einsum("msk,skn->smn", xs, ws, preferred_element_type=jnp.float32)


def linear_reference(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [K, N]
    b: jax.Array | None,  # [N]; None: no bias
    residual: jax.Array | None = None,  # [M, N]
    *,
    activation: str | None = None,
) -> jax.Array:  # [M, N]
    """Plain XLA, as flax's Dense computes it (x @ w + b in x's dtype), then the epilogue
    (swiglu: [M, N / 2])."""
    return linear_reference_epilogue(jnp.dot(x, w), b, residual, activation=activation)


def linear_reference_epilogue(
    y: jax.Array,  # [M, N]: x @ w in x's dtype
    b: jax.Array | None,  # [N]; None: no bias
    residual: jax.Array | None = None,  # [M, N]
    *,
    activation: str | None = None,
) -> jax.Array:  # [M, N]
    """`linear_reference` after its product: + b, activation, + residual in y's dtype."""
    if b is not None:
        y = y + b
    if activation == "gelu_tanh":
        y = jax.nn.gelu(y, approximate=True)
    if activation == "swiglu":
        y = swiglu(y)
    return y if residual is None else residual + y
