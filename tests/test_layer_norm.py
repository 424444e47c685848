"""Layer norm: the Pallas kernel, its XLA reference and flax's nn.LayerNorm against numpy."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layer_norm import (
    add_layer_norm,
    add_layer_norm_reference,
    layer_norm,
    layer_norm_reference,
)
from rosejax.layers.layer_norm import LayerNorm
from rosejax.layers.linear import PendingSum
from tests.conftest import INTERPRET, pairwise

EPS = 1e-5


def flax_layer_norm(x, scale, bias, *, eps):
    return nn.LayerNorm(epsilon=eps, dtype=x.dtype).apply(
        {"params": {"scale": scale, "bias": bias}}, x
    )


def rosejax_module(x, scale, bias, *, eps):
    """The model's module, whichever implementation it dispatches to on this backend."""
    return LayerNorm(eps).apply({"params": {"scale": scale, "bias": bias}}, x)[1]


IMPLS = {
    "pallas": functools.partial(layer_norm, interpret=INTERPRET),  # the defaults the model runs
    "pallas_r4": functools.partial(layer_norm, block_rows=4, interpret=INTERPRET),
    "pallas_r1_w1": functools.partial(layer_norm, block_rows=1, num_warps=1, interpret=INTERPRET),
    "reference": layer_norm_reference,
    "flax": flax_layer_norm,
    "module": rosejax_module,
}
# (rows, features): GPT-2's width, rows not a multiple of the block, a width not a power of two.
SHAPES = [(6, 768), (13, 96), (1, 40), (32, 64)]
TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


def oracle(x, scale, bias):
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * np.asarray(scale, np.float64) + np.asarray(
        bias, np.float64
    )


# Every implementation on every shape, each with every dtype, every shape in every dtype (the
# pairs, not the full product of 72).
@pytest.mark.parametrize(
    "impl,shape,dtype", pairwise(impl=list(IMPLS), shape=SHAPES, dtype=list(TOL))
)
def test_layer_norm_matches_numpy(impl, shape, dtype):
    rng = np.random.default_rng()
    n, e = shape
    # An offset and a spread per row: E[x^2] - E[x]^2 must hold up when the mean is large.
    x = rng.normal(size=(n, e)) * rng.uniform(0.5, 4, (n, 1)) + rng.uniform(-8, 8, (n, 1))
    scale, bias = rng.normal(size=e), rng.normal(size=e)
    x, scale, bias = (jnp.asarray(a, dtype) for a in (x, scale, bias))
    got = IMPLS[impl](x, scale, bias, eps=EPS)
    assert got.shape == x.shape and got.dtype == x.dtype
    want = oracle(x, scale, bias)
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, atol=TOL[dtype] * 8, rtol=TOL[dtype]
    )


def test_module_keeps_leading_axes():
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(3, 5, 48)), jnp.float32)
    scale, bias = jnp.asarray(rng.normal(size=48)), jnp.asarray(rng.normal(size=48))
    got = rosejax_module(x, scale, bias, eps=EPS)
    np.testing.assert_allclose(
        got.reshape(15, 48), oracle(x.reshape(15, 48), scale, bias), atol=1e-4, rtol=1e-5
    )


def test_bad_shapes():
    x = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="need x"):
        layer_norm(x[0], jnp.zeros(8), jnp.zeros(8), interpret=True)
    with pytest.raises(ValueError, match="need x"):
        layer_norm(x, jnp.zeros(7), jnp.zeros(8), interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        layer_norm(x, jnp.zeros(8), jnp.zeros(8), block_rows=3, interpret=True)


def pending_module(partials, linear_bias, residual, scale, bias, *, eps):
    """The model's module fed a `PendingSum`, whichever implementation it dispatches to."""
    return LayerNorm(eps).apply(
        {"params": {"scale": scale, "bias": bias}}, PendingSum(partials, linear_bias, residual)
    )


ADD_IMPLS = {
    "pallas": functools.partial(add_layer_norm, interpret=INTERPRET),  # the model's defaults
    "pallas_r4": functools.partial(add_layer_norm, block_rows=4, interpret=INTERPRET),
    "pallas_r2_w1": functools.partial(
        add_layer_norm, block_rows=2, num_warps=1, interpret=INTERPRET
    ),
    "reference": add_layer_norm_reference,
    "module": pending_module,
}


# As above, with one and three partial sums, with and without the linear layer's bias (the
# pairs: 20 cases, not the product's 240).
@pytest.mark.parametrize(
    "impl,splits,shape,dtype,with_bias",
    pairwise(
        impl=list(ADD_IMPLS), splits=[1, 3], shape=SHAPES, dtype=list(TOL), with_bias=[True, False]
    ),
)
def test_add_layer_norm_matches_numpy(impl, splits, shape, dtype, with_bias):
    rng = np.random.default_rng()
    n, e = shape
    partials = jnp.asarray(rng.normal(size=(splits, n, e)) * 2, jnp.float32)
    residual = rng.normal(size=(n, e)) * rng.uniform(0.5, 4, (n, 1)) + rng.uniform(-8, 8, (n, 1))
    linear_bias, scale, bias = (rng.normal(size=e) for _ in range(3))
    residual, linear_bias, scale, bias = (
        jnp.asarray(a, dtype) for a in (residual, linear_bias, scale, bias)
    )
    linear_bias = linear_bias if with_bias else None
    h, y = ADD_IMPLS[impl](partials, linear_bias, residual, scale, bias, eps=EPS)
    assert h.shape == y.shape == (n, e) and h.dtype == y.dtype == jnp.dtype(dtype)
    want_h = np.asarray(partials, np.float64).sum(0) + np.asarray(residual, np.float64)
    want_h += 0 if linear_bias is None else np.asarray(linear_bias, np.float64)
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(h, np.float64), want_h, atol=tol * 8, rtol=tol)
    # The norm is of h as stored (rounded to the stream's dtype), as the unfused layers take it.
    np.testing.assert_allclose(
        np.asarray(y, np.float64), oracle(h, scale, bias), atol=tol * 8, rtol=tol
    )


def test_add_layer_norm_bad_shapes():
    p, r, v = jnp.zeros((2, 4, 8)), jnp.zeros((4, 8)), jnp.zeros(8)
    for args in [
        (p.astype(jnp.float16), v, r, v, v),
        (p[0], v, r, v, v),
        (p, v, r[:3], v, v),
        (p, v[:7], r, v, v),
        (p, v, r, v, v[:7]),
    ]:
        with pytest.raises(ValueError, match="need float32 partials"):
            add_layer_norm(*args, interpret=True)


@pytest.mark.parametrize("splits", [1, 2])
def test_add_layer_norm_kernel_sums_as_the_xla_path_does(splits):
    """Fused and unfused decode steps store the same residual stream: same order of float32 adds,
    same rounding (checked bit for bit where XLA's reduction order is not in doubt)."""
    rng = np.random.default_rng()
    partials = jnp.asarray(rng.normal(size=(splits, 13, 96)) * 3, jnp.float32)
    residual = jnp.asarray(rng.normal(size=(13, 96)) * 5, jnp.float16)
    lb, scale, bias = (jnp.asarray(rng.normal(size=96), jnp.float16) for _ in range(3))
    h_kernel, _ = add_layer_norm(partials, lb, residual, scale, bias, interpret=INTERPRET)
    h_xla, _ = add_layer_norm_reference(partials, lb, residual, scale, bias)
    np.testing.assert_array_equal(np.asarray(h_kernel), np.asarray(h_xla))


def test_module_takes_a_pending_sum_with_leading_axes():
    rng = np.random.default_rng()
    partials = jnp.asarray(rng.normal(size=(3, 15, 48)), jnp.float32)
    residual = jnp.asarray(rng.normal(size=(3, 5, 48)), jnp.float32)
    lb, scale, bias = (jnp.asarray(rng.normal(size=48), jnp.float32) for _ in range(3))
    h, y = pending_module(partials, lb, residual, scale, bias, eps=EPS)
    assert h.shape == y.shape == (3, 5, 48)
    want_h = (
        np.asarray(partials, np.float64).sum(0)
        + np.asarray(lb)
        + np.asarray(residual).reshape(15, 48)
    )
    np.testing.assert_allclose(np.asarray(h).reshape(15, 48), want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(y).reshape(15, 48), oracle(want_h, scale, bias), rtol=1e-4, atol=1e-4
    )
