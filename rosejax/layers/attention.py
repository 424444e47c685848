"""Attention over the paged KV cache.

Every forward attends over the pages as if its new K/V were already written there: prefill chunks
(and unfused decode steps) write them first through `append_kv`; the fused decode kernel writes
them itself and takes the new token from its projection. Prefill, prefix-cached prefill (the cached
blocks are already there) and decode therefore see the same cache. Query token `t` of row `b` at
absolute position `p` sees the keys at logical positions `0..p` of its block table.

- `prefill_attention`: any number of queries per row: the Pallas flash-attention kernel, or XLA.
  In XLA a batch in which no row continues a cached prefix (every chunk starts at position 0)
  attends among its own tokens (`causal_attention_xla`); otherwise `paged_attention_xla` walks the
  rows' pages a chunk at a time, as far as the batch's last query needs.
- `decode_attention`: one query per row, K/V written and attended in one call: rosejax's Pallas
  kernel (`pallas_kernels/paged_attention.py`; split over each row's pages where few rows leave
  the GPU idle or walk their pages in long chains: `default_decode_splits`, and finer in the
  windows the engine runs while one row is far longer than the rest: `long_row_decode_splits`,
  `decode_num_splits`), which writes the
  K/V itself unless `kernels.fused_kv_append` is off (then `append_kv` does), or XLA
  (`paged_decode_attention_xla`, the same chunked walk), as the `KernelConfig` says and for
  caches the kernel does not tile.
  The kernel that writes K/V itself can also take q and k before their RoPE (and q/k RMSNorm).
- `append_kv`: the `kv_append` dispatcher's kernels (or its XLA scatter), for prefill chunks and
  unfused decode steps.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels import kv_append
from pallas_kernels.paged_attention import (
    DEFAULT_MATRIX_MIN_GROUP,
    decode_kernel_supported,
    paged_decode_attention,
    paged_decode_attention_append,
    uses_matrix_units,
)
from pallas_kernels.paged_prefill_attention import (
    paged_prefill_attention,
    prefill_kernel_supported,
)
from rosejax.settings import KernelConfig


@flax.struct.dataclass
class ForwardMetadata:
    """Where each token sits. Token (b, t) is real iff positions[b, t] < seq_lens[b]; padding
    tokens and padded rows (seq_lens 0) write their K/V to the scratch block 0."""

    positions: jax.Array  # [B, T] int32, absolute position of each token
    seq_lens: jax.Array  # [B] int32, the row's context length once this forward's tokens are in
    block_tables: jax.Array  # [B, MB] int32, physical block of each logical block of the row


def cache_slots(
    block_tables: jax.Array,  # [B, MB] int32
    positions: jax.Array,  # [B, T] int32, absolute position of each token
    seq_lens: jax.Array,  # [B] int32, the row's length once these tokens are in
    block_size: int,
) -> tuple[jax.Array, jax.Array]:  # block, offset: int32 [B, T]
    """The slot each token's K/V goes to. Token (b, t) is real iff positions[b, t] < seq_lens[b];
    padding tokens and padded rows (seq_lens 0) go to scratch block 0, offset 0."""
    real = positions < seq_lens[:, None]  # [B, T]
    logical = jnp.clip(positions // block_size, 0, block_tables.shape[1] - 1)  # padding may overrun
    physical = jnp.take_along_axis(block_tables, logical, axis=1)  # [B, T]
    block = jnp.where(real, physical, 0).astype(jnp.int32)
    return block, jnp.where(real, positions % block_size, 0).astype(jnp.int32)


def cache_writes(
    meta: ForwardMetadata, block_size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:  # block, offset: int32 [B, T]; fresh: bool[]
    """What every layer's attention needs of `meta`, computed once per forward: each token's
    K/V slot (`cache_slots`) and whether no row continues a cached prefix (all start at 0)."""
    block, offset = cache_slots(meta.block_tables, meta.positions, meta.seq_lens, block_size)
    return block, offset, jnp.all(meta.positions[:, 0] == 0)


def append_kv(
    qkv: jax.Array,  # [N, Hq + 2H, D]: the new tokens' fused q/k/v projection
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    write_block: jax.Array,  # [N] int32, each token's physical block
    write_offset: jax.Array,  # [N] int32, its slot in that block
    kernels: KernelConfig,
    num_q_heads: int | None = None,  # Hq; None: H (multi-head attention, qkv [N, 3H, D])
) -> tuple[jax.Array, jax.Array]:
    """Write each token's K/V (heads Hq..Hq+H and Hq+H..Hq+2H of qkv) into its slot -> the
    caches."""
    h = k_cache.shape[0]
    hq = num_q_heads or h
    return kv_append(
        k_cache,
        v_cache,
        qkv,
        qkv,
        write_block,
        write_offset,
        new_head_offsets=(hq, hq + h),
        use_kernels=kernels.kv_append == "pallas",
        min_batch=kernels.kv_append_min_batch,
        interpret=kernels.interpret,
        **kernels.tile_kwargs("kv_append"),
    )


# Split-K decode attention (`default_decode_splits`; measured: docs/performance-log.md).
GPU_SMS = 132  # an H100 SXM's SMs (an H200's too)
SPLIT_PROGRAMS_PER_SM = 2  # programs the splits aim for a SM, to hide each one's memory latency
MIN_SPLIT_TOKENS = 256  # of a full table a split covers at least (4 pages at block size 64)
# A vector-path program (one query head, GPT-2) keeps a SM less busy than a matrix-unit one (a
# group of heads): it splits while B x H < 2 x GPU_SMS, and then at least this many ways.
MIN_SPLITS_VECTOR = 4


def default_decode_splits(
    batch: int, kv_heads: int, max_pages: int, block_size: int, matrix_units: bool
) -> int:
    """Programs per (row, KV head) of the Pallas decode attention of a compiled program: 1 where
    the B x H programs already fill the GPU (GPU_SMS of them on the matrix units, twice that
    on the vector path) or a full table (max_pages) splits into fewer than two runs of
    MIN_SPLIT_TOKENS; else enough for SPLIT_PROGRAMS_PER_SM programs a SM (at least
    MIN_SPLITS_VECTOR on the vector path), but no more than give each split MIN_SPLIT_TOKENS of a
    full table. Why: one program per (row, KV head) walks its pages as a chain of loads (B=1, 8
    KV heads: 8 programs on 132 SMs), and a split shorter than that costs more in its partials
    and their merge than its pages take to read."""
    programs = batch * kv_heads
    most = max_pages * block_size // MIN_SPLIT_TOKENS
    full = GPU_SMS if matrix_units else SPLIT_PROGRAMS_PER_SM * GPU_SMS
    if programs >= full or most < 2:
        return 1
    fewest = 1 if matrix_units else MIN_SPLITS_VECTOR
    return min(max(-(-SPLIT_PROGRAMS_PER_SM * GPU_SMS // programs), fewest), most)


# A decode window while one row is far longer than the others (one 30k-token row among short
# ones): the default splits leave that row's pages to a few programs walking them in a long chain
# (H200, Qwen3-0.6B heads, 128 rows: 0.70 ms a layer against 0.06 without it). Such windows run
# a program whose splits give each run of a full table about LONG_SPLIT_TOKENS, up to
# LONG_SPLIT_PROGRAMS programs in all (the best of 1-64 splits at 1-256 rows there: 0.14 ms).
LONG_SPLIT_TOKENS = 1024
LONG_SPLIT_PROGRAMS = 16384
# ... once a row's run under the default splits would be longer than this.
LONG_CHAIN_TOKENS = 4096


def long_row_decode_splits(
    batch: int, kv_heads: int, max_pages: int, block_size: int, matrix_units: bool
) -> int:
    """Programs per (row, KV head) of a decode window while a row far longer than the rest
    runs: runs of LONG_SPLIT_TOKENS of a full table, within LONG_SPLIT_PROGRAMS programs, and
    never fewer than `default_decode_splits`. Splits cover each row's own live pages, so the
    short rows' splits are mostly empty (what costs the window when no row is long)."""
    by_tokens = max_pages * block_size // LONG_SPLIT_TOKENS
    by_programs = LONG_SPLIT_PROGRAMS // (batch * kv_heads)
    default = default_decode_splits(batch, kv_heads, max_pages, block_size, matrix_units)
    return max(default, min(by_tokens, by_programs))


def decode_num_splits(
    kernels: KernelConfig,
    batch: int,
    kv_heads: int,  # this shard's
    group: int,  # query heads per KV head
    max_pages: int,
    block_size: int,
    head_dim: int,
    long_rows: bool = False,
) -> int | None:
    """Programs per (row, KV head) of the Pallas decode attention of a program of these shapes:
    the kernels' `attention.num_splits` tile if set, else `default_decode_splits` (with
    `long_rows`: `long_row_decode_splits`); None where the kernel does not run."""
    if not _decode_kernel_runs(kernels, head_dim, block_size):
        return None
    tiles = kernels.tile_kwargs("attention")
    if "num_splits" in tiles:
        return tiles["num_splits"]
    min_group = tiles.get("matrix_min_group", DEFAULT_MATRIX_MIN_GROUP)
    matrix = uses_matrix_units(group, block_size, head_dim, min_group)
    rule = long_row_decode_splits if long_rows else default_decode_splits
    return rule(batch, kv_heads, max_pages, block_size, matrix)


def _decode_kernel_runs(kernels: KernelConfig, head_dim: int, block_size: int) -> bool:
    """Whether `decode_attention` runs a Pallas kernel: chosen, and tiling the cache (Triton
    tiles are powers of two: other head dims or block sizes take XLA's path)."""
    return kernels.attention == "pallas" and decode_kernel_supported(head_dim, block_size)


def decode_kernel_appends(kernels: KernelConfig, k_cache: jax.Array) -> bool:
    """Whether `decode_attention` runs the Pallas kernel that writes the step's K/V itself: the
    one that can also normalize and rotate q and k (`rope`, `qk_norm`)."""
    return _decode_kernel_runs(kernels, k_cache.shape[3], k_cache.shape[2]) and (
        kernels.fused_kv_append
    )


def decode_attention(
    qkv: jax.Array,  # [B, Hq + 2H, D]: each row's one new token
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    seq_lens: jax.Array,  # [B] int32, tokens in the cache for each row, this step's included
    write_block: jax.Array,  # [B] int32: the slot of position seq_lens - 1 (scratch if padded)
    write_offset: jax.Array,  # [B] int32
    kernels: KernelConfig,
    num_q_heads: int | None = None,  # Hq, a multiple of H (grouped queries); None: H
    rope: tuple[jax.Array, jax.Array] | None = None,  # float32 (cos, sin) [B, D/2] each
    qk_norm: tuple[jax.Array, jax.Array] | None = None,  # (q scale, k scale) [D] each
    eps: float = 1e-6,  # qk_norm's
) -> tuple[jax.Array, jax.Array, jax.Array]:  # [B, Hq, D], k_cache, v_cache
    """Write each row's new K/V, then attend over the row's `seq_lens` tokens. With `rope` (and
    `qk_norm`), q and k of qkv are first rotated (and normalized) in the kernel: only where
    `decode_kernel_appends`."""
    h, _, bs, d = k_cache.shape
    splits = decode_num_splits(
        kernels, qkv.shape[0], h, (num_q_heads or h) // h, block_tables.shape[1], bs, d
    )
    pallas = splits is not None  # else XLA's path, which takes no tiles
    tiles = kernels.tile_kwargs("attention") | {"num_splits": splits}
    tiles["interpret"] = kernels.interpret
    if num_q_heads is not None and num_q_heads != h:
        tiles["num_q_heads"] = num_q_heads
    if decode_kernel_appends(kernels, k_cache):  # finds the slots from block_tables and seq_lens
        return paged_decode_attention_append(
            qkv, k_cache, v_cache, block_tables, seq_lens, rope, qk_norm, eps=eps, **tiles
        )
    if rope is not None:
        raise ValueError("only the decode kernel that appends K/V itself rotates q and k")
    k_cache, v_cache = append_kv(
        qkv, k_cache, v_cache, write_block, write_offset, kernels, num_q_heads
    )
    if pallas:
        out = paged_decode_attention(qkv, k_cache, v_cache, block_tables, seq_lens, **tiles)
    else:
        out = paged_decode_attention_xla(
            qkv, k_cache, v_cache, block_tables, seq_lens, num_q_heads=num_q_heads
        )
    return out, k_cache, v_cache


def prefill_attention(
    q: jax.Array,  # [B, T, Hq, D], Hq a multiple of H (grouped queries)
    k: jax.Array,  # [B, T, H, D], this chunk's keys (already written to the cache)
    v: jax.Array,  # [B, T, H, D]
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    positions: jax.Array,  # [B, T] int32
    fresh: jax.Array,  # bool[]: no row continues a cached prefix (every chunk starts at 0)
    seq_lens: jax.Array,  # [B] int32, the row's length once this chunk is in
    kernels: KernelConfig | None = None,
) -> jax.Array:  # [B, T, Hq, D]
    """XLA, or (`kernels.prefill_attention` "pallas", pages it tiles) the Pallas flash-attention
    kernel over the pages. Both read only the pages below the queries' last positions."""
    if (
        kernels is not None
        and kernels.prefill_attention == "pallas"
        and prefill_kernel_supported(k_cache.shape[3], k_cache.shape[2])
    ):
        tiles = kernels.tile_kwargs("prefill_attention") | {"interpret": kernels.interpret}
        return paged_prefill_attention(
            q, k_cache, v_cache, block_tables, positions, seq_lens, **tiles
        )
    # A fresh batch's keys are its own chunk's: no page gather at all.
    return jax.lax.cond(
        fresh,
        lambda: causal_attention_xla(q, k, v, positions),
        lambda: paged_attention_xla(q, k_cache, v_cache, block_tables, positions, seq_lens),
    )


_NEG_INF = -1e30
# Keys each step of the XLA paged attention's loop reads per row (8 pages at block size 16): fewer
# waste less of a row's last chunk, more mean fewer steps. Not measured on a GPU yet.
DEFAULT_CHUNK_TOKENS = 128


def paged_attention_xla(
    q: jax.Array,  # [B, T, Hq, D], Hq a multiple of H (grouped queries)
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    positions: jax.Array,  # [B, T] int32, absolute position of each query
    seq_lens: jax.Array,  # [B] int32, the row's length (0: a padded row)
    *,
    pages_per_chunk: int | None = None,
) -> jax.Array:  # [B, T, Hq, D]
    """Plain XLA, any number of queries per row, any head dim and block size: query (b, t) sees
    the row's cached keys at logical positions 0..positions[b, t] below seq_lens[b] (the Pallas
    prefill kernel's semantics); a row with seq_lens 0 gives zeros. Query head j reads KV head
    j // (Hq / H), each KV page once for its group.

    Flash attention over the block tables: a loop over chunks of `pages_per_chunk` pages (None:
    about DEFAULT_CHUNK_TOKENS keys; at most the table) gathers the chunk's pages of every row
    and folds them into a running max, sum and numerator in float32; it stops after the chunk
    that holds the batch's last key needed, so the rows' lengths, not the table's MB * BS (the
    model's context), set what it reads. A row's pages past its own keys read scratch block 0
    instead."""
    b, t, hq, d = q.shape
    h, _, bs, _ = k_cache.shape
    if hq % h:
        raise ValueError(f"{hq} query heads are not a multiple of the cache's {h} KV heads")
    if pages_per_chunk is not None and pages_per_chunk < 1:
        raise ValueError(f"pages_per_chunk must be >= 1, got {pages_per_chunk}")
    mb = block_tables.shape[1]
    # No chunk longer than the table: a short one would be padded with pages never needed.
    pages_per_chunk = min(pages_per_chunk or max(1, DEFAULT_CHUNK_TOKENS // bs), mb)
    group, chunk = hq // h, pages_per_chunk * bs
    # Whole chunks of table: a dynamic_slice that overran the end would be shifted back.
    tables = jnp.pad(block_tables, ((0, 0), (0, -mb % pages_per_chunk)))  # [B, MB']
    # Keys each row needs: through its last query, never past its length.
    num_keys = jnp.minimum(jnp.max(positions, axis=1) + 1, seq_lens)  # [B]
    num_chunks = jnp.minimum(
        (jnp.max(num_keys) + chunk - 1) // chunk, tables.shape[1] // pages_per_chunk
    )
    qg = q.reshape(b, t, h, group, d)

    def body(c, carry):
        m, denom, acc = carry  # [B, H, G, T], [B, H, G, T], [B, H, G, T, D] float32
        pages = jax.lax.dynamic_slice_in_dim(tables, c * pages_per_chunk, pages_per_chunk, 1)
        first_key = (c * pages_per_chunk + jnp.arange(pages_per_chunk)) * bs  # [P]
        # Every row's dead pages are the same block: on a GPU those reads hit the L2 cache.
        pages = jnp.where(first_key[None, :] < num_keys[:, None], pages, 0)  # [B, P]
        key_pos = c * chunk + jnp.arange(chunk)  # [C]
        key_ok = key_pos[None, :] < num_keys[:, None]  # [B, C]
        k = k_cache[:, pages].reshape(h, b, chunk, d)  # [H, B, C, D]
        # Zeroed where a row has no key: unwritten slots may hold anything (NaN, and 0 * NaN is
        # NaN), and a padded row, all of whose scores are _NEG_INF, weighs each slot exp(0) = 1.
        v = jnp.where(key_ok[None, :, :, None], v_cache[:, pages].reshape(h, b, chunk, d), 0)
        s = jnp.einsum("btkgd,kbcd->bkgtc", qg, k, preferred_element_type=jnp.float32)
        visible = (key_pos[None, None, :] <= positions[:, :, None]) & key_ok[:, None, :]
        visible = visible[:, None, None]  # [B, 1, 1, T, C]
        s = jnp.where(visible, s / math.sqrt(d), _NEG_INF)  # [B, H, G, T, C]
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])  # [B, H, G, T, C]
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum(
            "bkgtc,kbcd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        return m_new, denom * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

    init = (
        jnp.full((b, h, group, t), _NEG_INF, jnp.float32),
        jnp.zeros((b, h, group, t), jnp.float32),
        jnp.zeros((b, h, group, t, d), jnp.float32),
    )
    if tables.shape[1] == pages_per_chunk:  # one chunk is the table: no loop to compile or run
        _, denom, acc = body(0, init)
    else:
        _, denom, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # [B, H, G, T, D]; no keys: zeros
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d).astype(q.dtype)


def paged_decode_attention_xla(
    q: jax.Array,  # [B, H' >= Hq, D]: the first Hq heads are the queries
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    lengths: jax.Array,  # [B] int32
    *,
    num_q_heads: int | None = None,  # Hq, a multiple of H; None: H
    pages_per_chunk: int | None = None,
) -> jax.Array:  # [B, Hq, D]
    """`paged_decode_attention` in XLA: each row's one query, at position lengths[b] - 1, over
    the row's first lengths[b] cached tokens through `paged_attention_xla`, which reads only the
    chunks of pages the longest row fills. A padded row (length 0) gives zeros."""
    hq = num_q_heads or k_cache.shape[0]
    out = paged_attention_xla(
        q[:, None, :hq],
        k_cache,
        v_cache,
        block_tables,
        (lengths - 1)[:, None],
        lengths,
        pages_per_chunk=pages_per_chunk,
    )
    return out[:, 0]


def causal_attention_xla(
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [B, T, H, D]
    v: jax.Array,  # [B, T, H, D]
    positions: jax.Array,  # [B, T] int32, increasing along T
) -> jax.Array:  # [B, T, Hq, D]
    """Causal attention among a chunk's own tokens: what `paged_attention_xla` computes (for the
    real tokens) when no row has anything cached before its chunk, without a page gather."""
    visible = positions[:, None, :] <= positions[:, :, None]  # [B, T, T]
    return _masked_attention(q, k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3), visible)


def _masked_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [H, B, L, D]
    v: jax.Array,  # [H, B, L, D]
    visible: jax.Array,  # [B, T, L] bool
) -> jax.Array:  # [B, T, Hq, D]
    """Query head j attends with KV head j // (Hq / H) (grouped-query attention; one group per
    head for multi-head attention)."""
    b, t, hq, d = q.shape
    h = k.shape[0]
    q = q.reshape(b, t, h, hq // h, d)
    s = jnp.einsum("btkgd,kbld->bkgtl", q, k, preferred_element_type=jnp.float32)
    s = jnp.where(visible[:, None, None], s / math.sqrt(d), _NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)  # [B, H, G, T, L]
    out = jnp.einsum("bkgtl,kbld->btkgd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)
