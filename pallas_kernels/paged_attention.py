"""Paged decode attention for multi-head attention with one query per row (GPT-2's decode step).

jax's `pallas.ops.gpu.paged_attention` is built for grouped queries: it pads each KV head's queries
to a block of 16 rows for the matrix units, so with GPT-2's one query per KV head 15/16 of its work
and a padding copy of q are waste. Here every program owns one (row, head) pair and streams that
head's pages through an online softmax with vector arithmetic: [block_size, D] tiles, no padding.

Layout: k_cache, v_cache [H, num_blocks, block_size, D] (rosejax's KV cache); block_tables
[B, MB] int32; lengths [B] int32 (tokens in the cache for the row, 0 for a padded row). q may carry
more heads than the cache, [B, H' >= H, D], of which the first H are the queries: a model passes
its fused q/k/v projection [B, 3H, D] whole, and XLA copies no q out of it first.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import filter_triton_deprecation, is_power_of_2

_NEG_INF = -1e30


def paged_decode_attention_kernel(
    q_ref,  # [B, H', D], heads [0, H) read
    k_cache_ref,  # [H, NB, BS, D]
    v_cache_ref,  # [H, NB, BS, D]
    block_tables_ref,  # [B, MB]
    lengths_ref,  # [B]
    o_ref,  # [B, H, D]
    *,
    sm_scale: float,
):
    b, h = pl.program_id(0), pl.program_id(1)
    block_size, head_dim = k_cache_ref.shape[2], k_cache_ref.shape[3]
    q = q_ref[b, h, :].astype(jnp.float32) * sm_scale  # [D]
    length = lengths_ref[b]

    def body(i, carry):
        m, denom, acc = carry  # [], [], [D]: running max, softmax denominator, numerator
        page = block_tables_ref[b, i]
        valid = i * block_size + jnp.arange(block_size, dtype=jnp.int32) < length  # [BS]
        # Masked loads: the last page's unused tail is never read (at block size 64 and GPT-2's
        # decode contexts that tail is a fifth to a half of the bytes).
        k = plgpu.load(k_cache_ref.at[h, page, :, :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_cache_ref.at[h, page, :, :], mask=valid[:, None], other=0.0)
        s = jnp.sum(q[None, :] * k.astype(jnp.float32), axis=1)  # [BS]
        s = jnp.where(valid, s, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s))
        p = jnp.exp(s - m_new)  # [BS]
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha + jnp.sum(p[:, None] * v.astype(jnp.float32), axis=0)
        return m_new, denom * alpha + jnp.sum(p), acc

    num_pages = (length + block_size - 1) // block_size
    init = (jnp.float32(_NEG_INF), jnp.float32(0.0), jnp.zeros((head_dim,), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(0, num_pages, body, init)
    # A padded row (length 0) has denom = 0: write zeros, not NaN.
    o_ref[b, h, :] = (acc / jnp.maximum(denom, 1e-30)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=["num_warps", "num_stages", "interpret"])
def paged_decode_attention(
    q: jax.Array,  # [B, H' >= H, D]: the first H heads are the queries
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    lengths: jax.Array,  # [B] int32
    *,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [B, H, D]
    """softmax(q k^T / sqrt(D)) v over each row's first `lengths[b]` cached tokens.

    `num_warps` None: one warp per 1,024 elements of a [block_size, D] page, the best of 1/2/4
    warps at each block size of an H200 sweep (B=256, context 136; bench/RESULTS.md)."""
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"need q [B, H, D] and caches [H, NB, BS, D], got {q.shape}, "
                         f"{k_cache.shape}, {v_cache.shape}")
    b, _, d = q.shape
    h = k_cache.shape[0]
    if q.shape[1] < h or k_cache.shape[3] != d:
        raise ValueError(f"q heads/dim {q.shape[1:]} do not cover the cache's "
                         f"{(h, k_cache.shape[3])}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32 [{b}, MB], got {block_tables.dtype} "
                         f"{block_tables.shape}")
    if lengths.shape != (b,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32 [{b}], got {lengths.dtype} {lengths.shape}")
    bs = k_cache.shape[2]
    if not (is_power_of_2(bs) and is_power_of_2(d)):
        raise ValueError(f"block size and head dim must be powers of two, got {bs}, {d}")
    if num_warps is None:
        num_warps = max(1, min(bs * d // 1024, 8))
    if not interpret:
        filter_triton_deprecation()
    return pl.pallas_call(
        functools.partial(paged_decode_attention_kernel, sm_scale=1.0 / math.sqrt(d)),
        grid=(b, h),
        out_shape=jax.ShapeDtypeStruct((b, h, d), q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_decode_attention_bs{bs}_w{num_warps}",
    )(q, k_cache, v_cache, block_tables, lengths)


def paged_attention_xla(
    q: jax.Array,  # [B, T, H, D]
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    positions: jax.Array,  # [B, T] int32, absolute position of each query
) -> jax.Array:  # [B, T, H, D]
    """Plain XLA, any number of queries per row: query (b, t) sees the row's cached keys at
    logical positions 0..positions[b, t]. Gathers each row's pages (all MB of them); softmax in
    float32. rosejax's prefill runs this when a row continues a cached prefix; with one query it
    is the decode kernel's reference."""
    b, t, h, d = q.shape
    context = block_tables.shape[1] * k_cache.shape[2]
    k = k_cache[:, block_tables].reshape(h, b, context, d)  # [H, B, L, D]
    v = v_cache[:, block_tables].reshape(h, b, context, d)  # [H, B, L, D]
    visible = jnp.arange(context)[None, None, :] <= positions[:, :, None]  # [B, T, L]
    return _masked_attention(q, k, v, visible)


def causal_attention_xla(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, T, H, D]
    v: jax.Array,  # [B, T, H, D]
    positions: jax.Array,  # [B, T] int32, increasing along T
) -> jax.Array:  # [B, T, H, D]
    """Causal attention among a chunk's own tokens: what `paged_attention_xla` computes when no
    row has anything cached before its chunk, without gathering the rows' whole block tables."""
    visible = positions[:, None, :] <= positions[:, :, None]  # [B, T, T]
    return _masked_attention(q, k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3), visible)


def _masked_attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [H, B, L, D]
    v: jax.Array,  # [H, B, L, D]
    visible: jax.Array,  # [B, T, L] bool
) -> jax.Array:  # [B, T, H, D]
    s = jnp.einsum("bthd,hbld->bhtl", q, k, preferred_element_type=jnp.float32)
    s = jnp.where(visible[:, None], s / math.sqrt(q.shape[-1]), _NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)  # [B, H, T, L]
    out = jnp.einsum("bhtl,hbld->bthd", p, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def paged_decode_attention_reference(
    q: jax.Array,  # [B, H' >= H, D]: the first H heads are the queries
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    lengths: jax.Array,  # [B] int32
) -> jax.Array:  # [B, H, D]
    """The XLA reference of `paged_decode_attention`: a padded row (length 0) gives zeros."""
    q = q[:, : k_cache.shape[0]]  # [B, H, D]
    out = paged_attention_xla(q[:, None], k_cache, v_cache, block_tables, (lengths - 1)[:, None])
    return jnp.where(lengths[:, None, None] > 0, out[:, 0], 0).astype(q.dtype)
