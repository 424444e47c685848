"""Linear with its epilogue (and a SwiGLU MLP's gate/up projection with silu(gate) * up as its
epilogue): the Pallas kernel, its XLA reference and the model's module against numpy."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear import (
    SHARED_MEMORY_BYTES,
    _tiles,
    linear,
    linear_partial_sums,
    linear_partial_sums_reference,
    linear_reference,
    split_count,
    swiglu,
)
from rosejax.layers.linear import Linear
from rosejax.settings import KernelConfig
from tests.conftest import INTERPRET, pairwise

PALLAS = KernelConfig(linear="pallas", interpret=INTERPRET)


def module(x, w, b, residual=None, *, activation=None, kernels=PALLAS):
    """The model's layer with the Pallas kernel chosen (XLA where the layer's rules say so);
    b None: a layer without a bias."""
    layer = Linear(w.shape[1], activation, kernels, use_bias=b is not None)
    params = {"kernel": w} if b is None else {"kernel": w, "bias": b}
    return layer.apply({"params": params}, x, residual)


IMPLS = {
    "pallas": functools.partial(linear, interpret=INTERPRET),
    "pallas_n16_k32_w2": functools.partial(
        linear, block_n=16, block_k=32, num_warps=2, interpret=INTERPRET
    ),
    # K split over 2-8 programs (one 32-deep tile each), the epilogue after their sum.
    "pallas_split_k": functools.partial(linear, block_k=32, max_k_steps=1, interpret=INTERPRET),
    # Uneven splits: 16 tiles of K=256 in 6 programs, 3 tiles each but the last's one.
    "pallas_split_uneven": functools.partial(
        linear, block_k=16, max_k_steps=3, interpret=INTERPRET
    ),
    # Rows in 16-row tiles over a second grid axis (the 33-row shape: 3 tiles, the last of 1 row).
    "pallas_m16": functools.partial(linear, block_m=16, interpret=INTERPRET),
    "pallas_m16_split_k": functools.partial(
        linear, block_m=16, block_k=32, max_k_steps=1, interpret=INTERPRET
    ),
    # K in one split wherever the output has 2 tiles or more, split into 32-deep tiles elsewhere.
    "pallas_fills": functools.partial(
        linear, block_k=32, max_k_steps=1, fill_programs=2, interpret=INTERPRET
    ),
    "reference": linear_reference,
    "module": module,
}
# (M, K, N): one decode row, rows not a power of two, a full 16-row tile, more than one tile's K,
# and more rows than the default 64-row tile.
SHAPES = [(1, 128, 64), (5, 64, 96), (16, 256, 32), (33, 128, 64), (100, 64, 32)]
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}


def oracle(x, w, b, residual, activation):
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if b is not None:
        y = y + np.asarray(b, np.float64)
    if activation == "gelu_tanh":
        y = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3)))
    return y if residual is None else y + np.asarray(residual, np.float64)


# Every implementation on every shape, each of them with every epilogue and every dtype, and
# every epilogue in every dtype: 50 cases, not the 600 of the full product. An epilogue is
# (activation, with a residual, with a bias).
@pytest.mark.parametrize(
    "impl,shape,epilogue,dtype",
    pairwise(
        impl=list(IMPLS),
        shape=SHAPES,
        epilogue={
            "bias": (None, False, True),
            "gelu": ("gelu_tanh", False, True),
            "residual": (None, True, True),
            "none": (None, False, False),
            "residual_no_bias": (None, True, False),
        },
        dtype=list(TOL),
    ),
)
def test_linear_matches_numpy(impl, shape, epilogue, dtype):
    rng = np.random.default_rng()
    (m, k, n), (activation, with_residual, with_bias) = shape, epilogue
    x = rng.normal(size=(m, k))
    w = rng.normal(size=(k, n)) / np.sqrt(k)
    b = rng.normal(size=n) if with_bias else None
    residual = rng.normal(size=(m, n)) * 4 if with_residual else None
    cast = lambda a: None if a is None else jnp.asarray(a, dtype)  # noqa: E731
    got = IMPLS[impl](cast(x), cast(w), cast(b), cast(residual), activation=activation)
    assert got.shape == (m, n) and got.dtype == jnp.dtype(dtype)
    want = oracle(cast(x), cast(w), cast(b), cast(residual), activation)
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * 4
    )


def test_module_keeps_leading_axes():
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(2, 3, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 32)) / 8, jnp.float32)
    b, r = jnp.asarray(rng.normal(size=32)), jnp.asarray(rng.normal(size=(2, 3, 32)))
    got = module(x, w, b, r)
    assert got.shape == (2, 3, 32)
    want = oracle(x.reshape(6, 64), w, b, r.reshape(6, 32), None)
    np.testing.assert_allclose(np.asarray(got).reshape(6, 32), want, rtol=1e-5, atol=1e-5)


def test_params_of_the_wrong_shape_or_missing_name_the_param():
    """The layers take their params as given (no flax init check), but one of another shape
    than the input asks for, or none, is an error naming it and the module."""
    x = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(
        ValueError, match=r"param 'kernel' of .* is \(63, 32\), expected \(64, 32\)"
    ):
        module(x, jnp.zeros((63, 32)), jnp.zeros(32), None)
    with pytest.raises(ValueError, match=r"param 'bias' of .* is None, expected \(32,\)"):
        Linear(32).apply({"params": {"kernel": jnp.zeros((64, 32))}}, x)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=jnp.zeros((2, 63))), "need x"),
        (dict(b=jnp.zeros(31)), "need b"),
        (dict(activation="swiglu", residual=jnp.zeros((2, 32))), "swiglu needs"),
        (dict(activation="swiglu", w=jnp.zeros((64, 33)), b=jnp.zeros(33)), "swiglu needs"),
        (dict(activation="swiglu", w=jnp.zeros((64, 48)), b=jnp.zeros(48)), "divisor"),  # F=24
        (dict(residual=jnp.zeros((3, 32))), "residual"),
        (dict(activation="relu"), "activation"),
        (dict(block_n=24), "powers of two"),
        (dict(block_m=8), "block_m"),
        (dict(max_k_steps=0), "max_k_steps"),
        (dict(x=jnp.zeros((2, 40)), w=jnp.zeros((40, 32))), "divisor"),
    ],
)
def test_bad_inputs(kwargs, match):
    args = dict(x=jnp.zeros((2, 64)), w=jnp.zeros((64, 32)), b=jnp.zeros(32))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        linear(**args, interpret=True)


PARTIAL_IMPLS = {
    "pallas": functools.partial(linear_partial_sums, interpret=INTERPRET),
    "pallas_split_k": functools.partial(
        linear_partial_sums, block_k=32, max_k_steps=1, interpret=INTERPRET
    ),
    "pallas_split_uneven": functools.partial(
        linear_partial_sums, block_k=16, max_k_steps=3, interpret=INTERPRET
    ),
    "pallas_m16_split_k": functools.partial(
        linear_partial_sums, block_m=16, block_k=32, max_k_steps=1, interpret=INTERPRET
    ),
    "reference": linear_partial_sums_reference,
    "reference_split_2": functools.partial(linear_partial_sums_reference, splits=2),
}


@pytest.mark.parametrize("impl", list(PARTIAL_IMPLS))
@pytest.mark.parametrize("shape", SHAPES)
def test_partial_sums_add_up_to_the_product(impl, shape):
    """Partial sums over the K splits (1 to 8 of them here) add up to x @ w, in float32."""
    rng = np.random.default_rng()
    m, k, n = shape
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float16)
    w = jnp.asarray(rng.normal(size=(k, n)), jnp.float16)
    got = PARTIAL_IMPLS[impl](x, w)
    assert got.dtype == jnp.float32 and got.ndim == 3 and got.shape[1:] == (m, n)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64).sum(0), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fill_programs,splits", [(0, 4), (2, 1), (3, 4)])
def test_output_tiles_that_fill_keep_k_in_one_split(fill_programs, splits):
    """K=128 in 32-deep tiles is 4 splits of one tile, unless the output's tiles (2 of 32
    columns here) number `fill_programs`; either way the sums add up to the product."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(1, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(128, 64)), jnp.float32)
    got = linear_partial_sums(
        x, w, block_k=32, max_k_steps=1, fill_programs=fill_programs, interpret=INTERPRET
    )
    assert got.shape == (splits, 1, 64)
    want = oracle(x, w, np.zeros(64), None, None)
    np.testing.assert_allclose(np.asarray(got).sum(0), want, rtol=1e-5, atol=1e-4)


def test_partial_sums_bad_shapes():
    with pytest.raises(ValueError, match="need x"):
        linear_partial_sums(jnp.zeros((2, 64)), jnp.zeros((32, 64)), interpret=True)
    with pytest.raises(ValueError, match="max_k_steps"):
        linear_partial_sums(jnp.zeros((2, 64)), jnp.zeros((64, 32)), max_k_steps=0, interpret=True)
    with pytest.raises(ValueError, match="fill_programs"):
        linear_partial_sums(
            jnp.zeros((2, 64)), jnp.zeros((64, 32)), fill_programs=-1, interpret=True
        )


@pytest.mark.parametrize(
    "dtype,activation,rows,want",
    [
        ("float32", "swiglu", 16, 128),  # gate + up tiles at 256: 4 stages past 227 KiB
        ("bfloat16", "swiglu", 16, 256),
        ("float32", None, 16, 256),  # one weight tile: fits
        ("float32", None, 64, 128),  # 64 rows of x besides
    ],
)
def test_block_k_fits_shared_memory(dtype, activation, rows, want):
    """The pipeline's stages of x and w tiles fit a program's shared memory: block_k halves
    where the defaults would not (Qwen3-0.6B's gate/up projection, K = 1024, F = 3072)."""
    itemsize = jnp.dtype(dtype).itemsize
    tiles = _tiles(
        rows,
        1024,
        3072,
        64,
        32,
        256,
        4,
        128,
        itemsize=itemsize,
        num_stages=4,
        weight_tiles=2 if activation else 1,
    )
    assert tiles["block_k"] == want
    step_bytes = (tiles["block_m"] + (2 if activation else 1) * 32) * itemsize
    assert 4 * tiles["block_k"] * step_bytes <= SHARED_MEMORY_BYTES


@pytest.mark.parametrize(
    "k_steps,max_k_steps,want",
    [
        (12, 4, 3),  # GPT-2's MLP down-projection at block_k 256: 3 programs of 4 tiles
        (12, 5, 3),  # 4 tiles each beats 5 + 5 + 2
        (3, 4, 1),  # short enough: no split
        (7, 2, 4),  # 2 + 2 + 2 + 1
        (25, 4, 7),  # gpt2-xl's K=1600 in 64-deep tiles: not 25 splits of one
        (8, 1, 8),
    ],
)
def test_split_count(k_steps, max_k_steps, want):
    assert split_count(k_steps, max_k_steps) == want
    with pytest.raises(ValueError, match="max_k_steps"):
        split_count(k_steps, 0)


@pytest.mark.parametrize(
    "rows,residual,activation,pending",
    [
        (4, True, None, True),
        (4, False, None, False),
        (4, True, "gelu_tanh", False),
        (33, True, None, False),  # more rows than the kernel takes: XLA, an array
    ],
)
def test_deferred_linear_returns_pending_sum_only_for_the_kernel(
    rows, residual, activation, pending
):
    from rosejax.layers import linear as layers

    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(rows, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(128, 64)) / 11, jnp.float32)
    b = jnp.asarray(rng.normal(size=64))
    r = jnp.asarray(rng.normal(size=(rows, 64))) if residual else None
    layer = Linear(64, activation, PALLAS)
    got = layer.apply({"params": {"kernel": w, "bias": b}}, x, r, defer=True)
    assert isinstance(got, layers.PendingSum) == pending
    value = got.value() if pending else got
    np.testing.assert_allclose(
        np.asarray(value), oracle(x, w, b, r, activation), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_xla_partial_sums_are_equal_runs_of_k(splits):
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(6, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(128, 48)), jnp.float32)
    got = np.asarray(linear_partial_sums_reference(x, w, splits), np.float64)
    assert got.shape == (splits, 6, 48)
    run = 128 // splits
    for s in range(splits):
        want = oracle(
            x[:, s * run : (s + 1) * run], w[s * run : (s + 1) * run], np.zeros(48), None, None
        )
        np.testing.assert_allclose(got[s], want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="does not split"):
        linear_partial_sums_reference(x, w, 3)


@pytest.mark.parametrize(
    "shape,k,n,pending",
    [
        ((40, 1), 128, 64, True),  # a decode step of enough rows: XLA's split-K GEMM
        ((40, 1), 128, 1024, True),  # as wide as it splits
        ((39, 1), 128, 64, False),  # one row fewer: one GEMM, its epilogue
        ((2, 20), 128, 64, False),  # a prefill
        ((40, 1), 99, 64, False),  # K odd
        ((40, 1), 128, 1040, False),  # wider output
    ],
)
def test_xla_split_k_defers_decode_steps_of_many_rows(shape, k, n, pending):
    from rosejax.layers import linear as layers

    rng = np.random.default_rng()
    kernels = KernelConfig(xla_split_k_min_rows=40)
    x = jnp.asarray(rng.normal(size=(*shape, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, n)) / 11, jnp.float32)
    b, r = jnp.asarray(rng.normal(size=n)), jnp.asarray(rng.normal(size=(*shape, n)))
    got = Linear(n, None, kernels).apply({"params": {"kernel": w, "bias": b}}, x, r, defer=True)
    assert isinstance(got, layers.PendingSum) == pending
    if pending:
        assert got.partials.shape == (layers.XLA_SPLIT_K, shape[0], n)
    value = np.asarray(got.value() if pending else got).reshape(-1, n)
    want = oracle(x.reshape(-1, k), w, b, r.reshape(-1, n), None)
    np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-4)


def test_xla_split_k_is_a_gpu_default():
    assert KernelConfig.for_backend("gpu").xla_split_k_min_rows == 256
    assert KernelConfig.for_backend("cpu").xla_split_k_min_rows is None
    with pytest.raises(ValueError, match="xla_split_k_min_rows"):
        KernelConfig(xla_split_k_min_rows=0)


def test_untileable_shapes_fall_back_to_xla():
    """K = 40 has no power-of-two divisor >= 16: on a GPU the layer must take XLA, not raise."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(4, 40)), jnp.float32)
    w, b = jnp.asarray(rng.normal(size=(40, 32)) / 6), jnp.asarray(rng.normal(size=32))
    np.testing.assert_allclose(
        np.asarray(module(x, w, b)), oracle(x, w, b, None, None), rtol=1e-5, atol=1e-5
    )


# ------------------------------------------------------------------ SwiGLU in the epilogue

FUSED_SWIGLU = KernelConfig(linear="pallas", fused_swiglu=True, interpret=INTERPRET)
SWIGLU_IMPLS = {  # (x [M, K], w [K, 2F], b [2F]) -> silu(gate) * up [M, F]
    "pallas": functools.partial(linear, activation="swiglu", interpret=INTERPRET),
    # 16 gate and 16 up columns a program over several K steps.
    "pallas_n16_k32": functools.partial(
        linear, activation="swiglu", block_n=16, block_k=32, interpret=INTERPRET
    ),
    # K split over programs: the partial sums of all 2F columns, swiglu after their sum.
    "pallas_split_k": functools.partial(
        linear, activation="swiglu", block_k=32, max_k_steps=1, interpret=INTERPRET
    ),
    # F's tiles (2 at the 64 x 128 weights of `test_swiglu_rounds_as_xla`) fill the GPU: fused,
    # K in one split; they do not, but the 2F columns' tiles do: partial sums in one split.
    "pallas_fills": functools.partial(
        linear, activation="swiglu", block_k=32, max_k_steps=1, fill_programs=2, interpret=INTERPRET
    ),
    "pallas_fills_2f": functools.partial(
        linear, activation="swiglu", block_k=32, max_k_steps=1, fill_programs=3, interpret=INTERPRET
    ),
    "reference": functools.partial(linear_reference, activation="swiglu"),
    "module": functools.partial(module, activation="swiglu", kernels=FUSED_SWIGLU),
    "module_unfused": functools.partial(module, activation="swiglu"),
    "module_xla": functools.partial(module, activation="swiglu", kernels=KernelConfig()),
}


def gate_up_weights(rng, k, dtype):
    """w [K, 2K]: the identity for the gate half and a permutation for the up half, so that
    the products are exact (one nonzero term) and every rounding is the epilogue's."""
    eye = np.eye(k)
    return jnp.asarray(np.concatenate([eye, eye[:, rng.permutation(k)]], 1), dtype)


@pytest.mark.slow  # `swiglu` itself meets HF in the Llama-family tests
@pytest.mark.parametrize(
    "impl,shape,dtype", pairwise(impl=list(SWIGLU_IMPLS), shape=SHAPES[1:3], dtype=list(TOL))
)
def test_swiglu_matches_numpy(impl, shape, dtype):
    """silu(gate) * up of the gate/up projection x @ w + b [M, 2F] (F = N / 2)."""
    rng = np.random.default_rng()
    m, k, n = shape
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(k, n)) * 3 / np.sqrt(k), dtype)  # gates over silu's bend
    b = jnp.asarray(rng.normal(size=n), dtype)
    got = SWIGLU_IMPLS[impl](x, w, b)
    assert got.shape == (m, n // 2) and got.dtype == jnp.dtype(dtype)
    gate, up = np.split(oracle(x, w, b, None, None), 2, axis=1)
    want = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * 4
    )


@pytest.mark.parametrize("impl", list(SWIGLU_IMPLS))
@pytest.mark.parametrize("with_bias", [True, False])
def test_swiglu_rounds_as_xla(impl, with_bias, dtype="bfloat16"):
    """With exact products, every path is the XLA path's projection (+ b in the dtype, if a
    bias) then `swiglu`: bit for bit where both are computed on a CPU, within a rounding of the
    dtype on a GPU (its exp)."""
    rng = np.random.default_rng()
    m, k = 5, 64
    x = jnp.asarray(rng.normal(size=(m, k)) * 3, dtype)  # gates over silu's bend and tails
    w = gate_up_weights(rng, k, dtype)
    b = jnp.asarray(rng.normal(size=2 * k), dtype) if with_bias else None
    got = np.asarray(SWIGLU_IMPLS[impl](x, w, b), np.float64)
    want = np.asarray(swiglu(jnp.dot(x, w) + (0 if b is None else b)), np.float64)
    assert got.shape == (m, k)
    step = 0.0 if INTERPRET else float(jnp.finfo(dtype).eps) * float(np.max(np.abs(want)))
    np.testing.assert_allclose(got, want, rtol=0, atol=step)


def test_swiglu_module_takes_no_residual():
    x, w, b = jnp.zeros((2, 64)), jnp.zeros((64, 32)), jnp.zeros(32)
    with pytest.raises(ValueError, match="no residual"):
        module(x, w, b, jnp.zeros((2, 16)), activation="swiglu", kernels=FUSED_SWIGLU)
