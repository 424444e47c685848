"""Attention over the paged KV cache.

Every forward writes its new K/V into the pages first and then attends over the pages, so prefill,
prefix-cached prefill (the cached blocks are already there) and decode share one path. Query token
`t` of row `b` at absolute position `p` sees the keys at logical positions `0..p` of its block table.

- `paged_attention_xla`: plain XLA (gather the row's pages, masked softmax), any number of
  queries per row: prefill.
- `decode_attention`: one query per row. On the GPU, rosejax's Pallas kernel
  (`pallas_kernels/paged_attention.py`, ROSEJAX_PALLAS_ATTENTION=0 turns it off); elsewhere XLA.
"""

from __future__ import annotations

import os

import jax

from pallas_kernels.paged_attention import (
    paged_attention_xla,
    paged_decode_attention,
    paged_decode_attention_reference,
)

__all__ = ["decode_attention", "paged_attention_xla", "pallas_attention_enabled"]


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
