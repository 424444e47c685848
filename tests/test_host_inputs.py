"""Packing a program's host inputs into one buffer: every array comes back bit for bit."""

import jax
import numpy as np
import pytest

from rosejax.host_inputs import pack, unpack


def test_pack_round_trips_every_bit_under_jit():
    rng = np.random.default_rng()
    floats = rng.standard_normal((3, 5)).astype(np.float32)
    floats[0, :3] = [np.nan, -np.inf, -0.0]
    arrays = {
        "tokens": rng.integers(-(2**31), 2**31 - 1, (4, 7), dtype=np.int32),
        "seed": rng.integers(0, 2**32, (4, 2), dtype=np.uint32),
        "temperature": floats,
        "alive": rng.random(9) < 0.5,
        "n_steps": np.int32(rng.integers(0, 100)),
        "empty": np.zeros((0, 3), np.int32),
    }
    buffer, layout = pack(arrays)
    assert buffer.dtype == np.int32 and buffer.ndim == 1
    out = jax.jit(unpack, static_argnums=1)(buffer, layout)
    assert sorted(out) == sorted(arrays)
    for name, want in arrays.items():
        got = np.asarray(out[name])
        assert got.dtype == want.dtype and got.shape == np.shape(want), name
        assert got.tobytes() == np.asarray(want).tobytes(), name  # NaN, -0.0 and all


def test_pack_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float64"):
        pack({"x": np.zeros(2)})
