"""RMSNorm of the residual stream (with the residual add before it) folded into the next
projection: the Pallas kernel, its XLA reference and the model's `Linear` with a norm, against
numpy."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.norm_linear import norm_linear, norm_linear_reference
from rosejax.layers.linear import Linear, PendingSum
from rosejax.layers.rms_norm import RMSNorm
from rosejax.settings import KernelConfig
from tests.conftest import INTERPRET, pairwise

FOLDED = KernelConfig(
    linear="pallas", rms_norm="pallas", fused_norm_linear=True, interpret=INTERPRET
)
EPS = 1e-5


class NormThenLinear(nn.Module):
    """A Llama block's norm and the projection that reads it, as the model calls them."""

    features: int
    activation: str | None
    kernels: KernelConfig
    use_bias: bool
    eps: float

    @nn.compact
    def __call__(self, stream):
        norm = RMSNorm(self.eps, self.kernels, name="norm")
        layer = Linear(self.features, self.activation, self.kernels, use_bias=self.use_bias)
        return layer(stream, norm=norm)


def module(partials, linear_bias, residual, scale, w, b, *, activation=None, eps, kernels):
    params = {"norm": {"scale": scale}, "Linear_0": {"kernel": w}}
    if b is not None:
        params["Linear_0"]["bias"] = b
    stream = residual if partials is None else PendingSum(partials, linear_bias, residual)
    layer = NormThenLinear(w.shape[1], activation, kernels, b is not None, eps)
    return layer.apply({"params": params}, stream)


IMPLS = {
    "pallas": functools.partial(norm_linear, interpret=INTERPRET),
    "pallas_n16_k32_w2": functools.partial(
        norm_linear, block_n=16, block_k=32, num_warps=2, interpret=INTERPRET
    ),
    # Rows in 16-row tiles over a second grid axis (the 33-row shape: 3 tiles, the last of 1 row).
    "pallas_m16": functools.partial(norm_linear, block_m=16, interpret=INTERPRET),
    "reference": norm_linear_reference,
    "module": functools.partial(module, kernels=FOLDED),
    # The same module where the fold is off: the norm's kernel, then the projection's.
    "module_unfused": functools.partial(
        module, kernels=dataclasses.replace(FOLDED, fused_norm_linear=False)
    ),
}
# (M, K, N): one decode row (the kernel loads one row of the stream), rows not a power of two, a
# full 16-row tile, more rows than a tile, a K of several tiles.
SHAPES = [(1, 128, 64), (5, 64, 96), (16, 256, 32), (33, 128, 64), (1, 512, 32)]
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}


def oracle(partials, linear_bias, residual, scale, w, b, activation):
    """(activation(rms_norm(h) @ w + b), h) in float64 from the operands as given."""
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    h = f64(residual)
    if partials is not None:
        h = h + f64(partials).sum(axis=0) + (0 if linear_bias is None else f64(linear_bias))
    x = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * f64(scale)
    y = x @ f64(w) + (0 if b is None else f64(b))
    if activation == "swiglu":
        gate, up = np.split(y, 2, axis=-1)
        y = gate / (1 + np.exp(-gate)) * up
    return y, h


@pytest.mark.parametrize(
    "impl,shape,stream,activation,dtype",
    pairwise(
        impl=list(IMPLS),
        shape=SHAPES,
        # (float32 partial sums over S splits of K, 0: the stream an array; a linear bias)
        stream={"array": (0, False), "one_split": (1, False), "three_bias": (3, True)},
        activation={"none": None, "swiglu": "swiglu"},
        dtype=list(TOL),
    ),
)
def test_norm_linear_matches_numpy(impl, shape, stream, activation, dtype):
    rng = np.random.default_rng()
    (m, k, n), (splits, with_bias) = shape, stream
    cast = lambda a: None if a is None else jnp.asarray(a, dtype)  # noqa: E731
    partials = jnp.asarray(rng.normal(size=(splits, m, k)), jnp.float32) if splits else None
    linear_bias = cast(rng.normal(size=k)) if with_bias else None
    residual = cast(rng.normal(size=(m, k)) * 4)
    scale = cast(1 + rng.normal(size=k) / 4)
    w = cast(rng.normal(size=(k, n)) / np.sqrt(k))
    b = cast(rng.normal(size=n)) if with_bias else None
    y, h = IMPLS[impl](partials, linear_bias, residual, scale, w, b, activation=activation, eps=EPS)
    out = n // 2 if activation == "swiglu" else n
    assert y.shape == (m, out) and y.dtype == jnp.dtype(dtype)
    assert h.shape == (m, k) and h.dtype == jnp.dtype(dtype)
    want_y, want_h = oracle(partials, linear_bias, residual, scale, w, b, activation)
    tol = TOL[dtype]
    # h is rounded to the dtype once (as the unfused layers store it).
    np.testing.assert_allclose(np.asarray(h, np.float64), want_h, rtol=tol / 8, atol=tol / 8)
    np.testing.assert_allclose(np.asarray(y, np.float64), want_y, rtol=tol, atol=tol * 4)


def test_the_stream_is_what_the_unfolded_norm_stores():
    """h of the kernel equals the add + RMSNorm kernel's h bit for bit (the same sums in the
    same order), so the residual stream does not drift from the unfused model's."""
    rng = np.random.default_rng()
    partials = jnp.asarray(rng.normal(size=(3, 4, 256)), jnp.float32)
    residual = jnp.asarray(rng.normal(size=(4, 256)), jnp.bfloat16)
    bias = jnp.asarray(rng.normal(size=256), jnp.bfloat16)
    scale = jnp.ones(256, jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(256, 64)) / 16, jnp.bfloat16)
    _, h = norm_linear(partials, bias, residual, scale, w, None, interpret=INTERPRET)
    _, want = norm_linear_reference(partials, bias, residual, scale, w, None)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(want))


def test_module_folds_only_where_the_kernels_are_pallas(monkeypatch):
    """`Linear` with a norm runs `norm_linear` only with Pallas linear and RMSNorm kernels, the
    switch on and few rows; otherwise the norm's own kernel (or XLA), then the projection."""
    from rosejax.layers import linear as linear_layer

    calls = []
    folded = linear_layer.norm_linear
    monkeypatch.setattr(
        linear_layer, "norm_linear", lambda *a, **k: calls.append(1) or folded(*a, **k)
    )
    rng = np.random.default_rng()
    args = (
        None,
        None,
        jnp.asarray(rng.normal(size=(2, 64)), jnp.float32),
        jnp.ones(64, jnp.float32),
        jnp.asarray(rng.normal(size=(64, 32)) / 8, jnp.float32),
        None,
    )
    want, _ = oracle(*args, None)
    cases = {
        "folded": (FOLDED, 1),
        "switch off": (dataclasses.replace(FOLDED, fused_norm_linear=False), 0),
        "xla norm": (dataclasses.replace(FOLDED, rms_norm="xla"), 0),
        "xla linear": (dataclasses.replace(FOLDED, linear="xla"), 0),
        "many rows": (dataclasses.replace(FOLDED, linear_max_rows=1), 0),
    }
    for name, (kernels, folds) in cases.items():
        calls.clear()
        y, h = module(*args, eps=EPS, kernels=kernels)
        assert len(calls) == folds, name
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4, err_msg=name)
        np.testing.assert_array_equal(np.asarray(h), np.asarray(args[2]), err_msg=name)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(residual=jnp.zeros((2, 63))), "need float32 partials"),
        (dict(partials=jnp.zeros((1, 2, 64), jnp.bfloat16)), "need float32 partials"),
        (dict(partials=None, linear_bias=jnp.zeros(64)), "no linear bias without partials"),
        (dict(w=jnp.zeros((63, 32))), "need w"),
        (dict(b=jnp.zeros(31)), "need w"),
        (dict(activation="swiglu", w=jnp.zeros((64, 33))), "swiglu needs an even N"),
        (dict(activation="relu"), "activation must be one of"),
    ],
)
def test_bad_shapes_are_value_errors(kwargs, match):
    args = dict(
        partials=jnp.zeros((1, 2, 64), jnp.float32),
        linear_bias=None,
        residual=jnp.zeros((2, 64)),
        scale=jnp.zeros(64),
        w=jnp.zeros((64, 32)),
        b=None,
    )
    args |= kwargs
    with pytest.raises(ValueError, match=match):
        norm_linear(**args, interpret=INTERPRET)
