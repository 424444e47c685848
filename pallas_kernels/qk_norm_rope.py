"""RoPE, and Qwen3's per-head q/k RMSNorm before it, of a decode step's fused q/k/v projection,
in the decode attention kernel's programs (`paged_decode_attention_append`'s `rope` and `qk_norm`)
and in XLA (`qk_norm_rope_reference`, `apply_rotary`: the model's path).

In XLA a decode layer's q_norm and k_norm (a reduction and an elementwise kernel each, or a Pallas
RMSNorm kernel each), the rotation of q and k, and the concatenation that packs q, k and v back
into the projection's layout took four to six of the ~12 kernels of a layer, each a launch on the
latency-bound path of a small-batch step. The attention kernel's (row, KV head) programs read
their group's query heads and their new key anyway: `load_heads` normalizes and rotates them in
registers as they are loaded.

Rounding is HF's (`LlamaRMSNorm`, `apply_rotary_pos_emb`) and the XLA path's: x * rsqrt(mean(x^2)
+ eps) in float32 rounded to x's dtype, times the scale rounded again, then the rotation in float32
from those values, rounded to x's dtype.

Rotate-half layout: dim i < D/2 pairs with i + D/2, giving x_i cos_i - x_{i+D/2} sin_i and
x_{i+D/2} cos_i + x_i sin_i. A program loads each head twice, in order and with its halves
swapped (a gather of D elements a head), so both halves come out in the head's own layout with no
concatenation in registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.rms_norm import rms_norm_reference


def apply_rotary(
    x: jax.Array,  # [N, H, D]
    cos: jax.Array,  # float32 [N, D/2]
    sin: jax.Array,  # float32 [N, D/2]
) -> jax.Array:  # [N, H, D], x's dtype
    """x * cos + rotate_half(x) * sin, in float32, for every head of each token."""
    half, dtype = x.shape[-1] // 2, x.dtype
    x = x.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(dtype)


def check_qk_norm_rope(qkv: jax.Array, rope, qk_norm) -> None:
    """rope: float32 (cos, sin) [N, D/2] each; qk_norm: (q scale, k scale) [D] each, and only
    with rope (every model that normalizes q and k rotates them)."""
    n, _, d = qkv.shape
    if rope is None:
        if qk_norm is not None:
            raise ValueError("qk_norm needs rope: the q/k norm runs in RoPE's prologue")
        return
    if d % 2 or any(a.shape != (n, d // 2) or a.dtype != jnp.float32 for a in rope):
        raise ValueError(
            f"rope must be float32 (cos, sin) [{n}, {d // 2}] for qkv {qkv.shape}, got "
            + ", ".join(f"{a.dtype}{list(a.shape)}" for a in rope)
        )
    if qk_norm is not None and any(a.shape != (d,) for a in qk_norm):
        raise ValueError(f"qk_norm scales must be [{d}], got {[a.shape for a in qk_norm]}")


def qk_norm_rope_reference(
    qkv: jax.Array,  # [N, Hq + 2H, D]
    rope: tuple[jax.Array, jax.Array] | None,  # float32 (cos, sin) [N, D/2] each
    qk_norm: tuple[jax.Array, jax.Array] | None,  # (q scale, k scale) [D] each
    *,
    num_q_heads: int,
    eps: float = 1e-6,
) -> jax.Array:  # [N, Hq + 2H, D]: q and k normalized and rotated, v as it was
    """The XLA path: `rms_norm_reference` of each q and k head, `apply_rotary`, q, k and v
    packed again."""
    check_qk_norm_rope(qkv, rope, qk_norm)
    if rope is None:
        return qkv
    hq, h = num_q_heads, (qkv.shape[1] - num_q_heads) // 2
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + h], qkv[:, hq + h :]
    if qk_norm is not None:
        q, k = (rms_norm_reference(x, s, eps=eps) for x, s in zip((q, k), qk_norm, strict=True))
    return jnp.concatenate([apply_rotary(q, *rope), apply_rotary(k, *rope), v], axis=1)


def _times_scale(x, scale, dtype):
    """x / rms float32 rounded to dtype, times the scale, rounded to dtype (as HF's
    `weight * x.to(dtype)`), back in float32: a product of two dtype values is exact in float32."""
    y = x.astype(dtype).astype(jnp.float32) * scale.astype(jnp.float32)
    return y.astype(dtype).astype(jnp.float32)


def load_heads(qkv_ref, b, heads, rope_refs, scale_ref, eps: float):
    """Heads `heads` [M] (int32, in range) of row b of qkv_ref [N, H', D] -> [M, D] in qkv's
    dtype, each normalized by scale_ref [D] (if given) and rotated by rope_refs (cos_ref, sin_ref
    float32 [N, D/2]; None: as loaded)."""
    dtype, d = qkv_ref.dtype, qkv_ref.shape[2]
    dims = jnp.arange(d, dtype=jnp.int32)
    x = plgpu.load(qkv_ref.at[b, heads[:, None], dims[None, :]])  # [M, D]
    if rope_refs is None:
        return x
    half = d // 2
    partner = jnp.where(dims < half, dims + half, dims - half)  # [D]: the other half's dim
    x = x.astype(jnp.float32)
    x_swapped = plgpu.load(qkv_ref.at[b, heads[:, None], partner[None, :]]).astype(jnp.float32)
    if scale_ref is not None:
        inv_rms = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / d + eps)  # [M, 1]
        x = _times_scale(x * inv_rms, scale_ref[:][None, :], dtype)
        swapped_scale = plgpu.load(scale_ref.at[partner])[None, :]
        x_swapped = _times_scale(x_swapped * inv_rms, swapped_scale, dtype)
    cos_ref, sin_ref = rope_refs
    freq = jnp.where(dims < half, dims, dims - half)  # [D]: each dim's angle
    cos = plgpu.load(cos_ref.at[b, freq])[None, :]  # [1, D] float32
    sin = plgpu.load(sin_ref.at[b, freq])[None, :]
    first_half = (dims < half)[None, :]
    rotated = jnp.where(first_half, x * cos - x_swapped * sin, x * cos + x_swapped * sin)
    return rotated.astype(dtype)
