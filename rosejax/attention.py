"""Attention over the paged KV cache.

Every forward writes its new K/V into the pages first and then attends over the pages, so prefill,
prefix-cached prefill (the cached blocks are already there) and decode share one path. Query token
`t` of row `b` at absolute position `p` sees the keys at logical positions `0..p` of its block table.

- `prefill_attention`: any number of queries per row, plain XLA. A batch in which no row continues
  a cached prefix (every chunk starts at position 0) attends among its own tokens
  (`causal_attention_xla`); otherwise every row's pages are gathered (`paged_attention_xla`).
- `decode_attention`: one query per row. On the GPU, rosejax's Pallas kernel
  (`pallas_kernels/paged_attention.py`, ROSEJAX_PALLAS_ATTENTION=0 turns it off); elsewhere XLA.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import gpu_kernel_enabled
from pallas_kernels.paged_attention import (
    causal_attention_xla,
    paged_attention_xla,
    paged_decode_attention,
    paged_decode_attention_reference,
)

__all__ = ["decode_attention", "prefill_attention", "pallas_attention_enabled"]


def pallas_attention_enabled() -> bool:
    return gpu_kernel_enabled("ROSEJAX_PALLAS_ATTENTION")


def decode_attention(
    q: jax.Array,  # [B, H' >= H, D]: the first H heads are the queries
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    seq_lens: jax.Array,  # [B] int32, tokens in the cache for each row, this step's included
) -> jax.Array:  # [B, H, D]
    if pallas_attention_enabled():
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens)


def prefill_attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, T, H, D], this chunk's keys (already written to the cache)
    v: jax.Array,  # [B, T, H, D]
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    positions: jax.Array,  # [B, T] int32
    fresh: jax.Array,  # bool[]: no row continues a cached prefix (every chunk starts at 0)
) -> jax.Array:  # [B, T, H, D]
    # Gathering whole block tables reads MB * block_size keys per row (the model's full context)
    # however short the prompts: for 8-token prompts that was most of a prefill's time.
    return jax.lax.cond(
        fresh,
        lambda: causal_attention_xla(q, k, v, positions),
        lambda: paged_attention_xla(q, k_cache, v_cache, block_tables, positions),
    )
