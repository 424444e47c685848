"""Attention over the paged KV cache.

Every forward writes its new K/V into the pages first and then attends over the pages, so prefill,
prefix-cached prefill (the cached blocks are already there) and decode share one path. Query token
`t` of row `b` at absolute position `p` sees the keys at logical positions `0..p` of its block table.

- `paged_attention_reference`: plain XLA (gather the row's pages, masked softmax). Used on CPU, for
  prefill, and as the test oracle.
- `decode_attention`: one query per row. On the GPU, rosejax's Pallas kernel
  (`pallas_kernels/paged_attention.py`, ROSEJAX_PALLAS_ATTENTION=0 turns it off); elsewhere XLA.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)

_MASK_VALUE = -1e30


def paged_attention_reference(
    q: jax.Array,  # [B, T, H, D]
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    positions: jax.Array,  # [B, T] int32, absolute position of each query
) -> jax.Array:  # [B, T, H, D]
    b, t, h, d = q.shape
    _, _, bs, _ = k_cache.shape
    context = block_tables.shape[1] * bs
    k = k_cache[:, block_tables].reshape(h, b, context, d)  # [H, B, L, D]
    v = v_cache[:, block_tables].reshape(h, b, context, d)  # [H, B, L, D]
    scores = jnp.einsum("bthd,hbld->bhtl", q, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(d))
    visible = jnp.arange(context)[None, None, :] <= positions[:, :, None]  # [B, T, L]
    scores = jnp.where(visible[:, None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, H, T, L]
    return jnp.einsum("bhtl,hbld->bthd", probs, v, preferred_element_type=jnp.float32).astype(q.dtype)


def pallas_attention_enabled() -> bool:
    return jax.default_backend() == "gpu" and os.environ.get("ROSEJAX_PALLAS_ATTENTION", "1") != "0"


def decode_attention(
    q: jax.Array,  # [B, H, D]
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    seq_lens: jax.Array,  # [B] int32, tokens in the cache for each row, this step's included
) -> jax.Array:  # [B, H, D]
    if pallas_attention_enabled():
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens)
