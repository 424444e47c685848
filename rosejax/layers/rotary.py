"""Rotary position embeddings (RoPE) as HF's Llama applies them: the rotate-half layout (each
head's dims split in halves, not interleaved pairs), angles position x inv_freq in float32.

`rope_inv_freq` runs once on the host: base^(-2i/D), with Llama 3's frequency rule when asked
(transformers' `_compute_llama3_parameters`): wavelengths longer than original/low_freq_factor
are divided by `factor`, shorter than original/high_freq_factor kept, and the band between
blended. The model turns each token's position into (cos, sin) once per forward and rotates q
and k of every layer with them before K is written to the cache and Q read: in XLA
(`pallas_kernels.qk_norm_rope.apply_rotary`), or in a decode step inside the decode attention
kernel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_inv_freq(
    head_dim: int,
    theta: float,
    rope_type: str = "default",
    *,
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> np.ndarray:  # float32 [head_dim // 2]
    # In float32, as transformers computes it (torch: base ** (arange(0, D, 2).float() / D)).
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"RoPE type {rope_type!r} is not supported")
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_cos_sin(
    positions: jax.Array,  # [...] int32
    inv_freq: np.ndarray,  # float32 [D/2]
) -> tuple[jax.Array, jax.Array]:  # float32 [..., D/2] each
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)
