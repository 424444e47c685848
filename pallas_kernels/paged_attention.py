"""Paged decode attention with one query per row and head (a decode step), for multi-head (GPT-2)
and grouped-query attention (Llama, Qwen: Hq query heads over H KV heads).

jax's `pallas.ops.gpu.paged_attention` is built for grouped queries: it pads each KV head's queries
to a block of 16 rows for the matrix units, so with GPT-2's one query per KV head 15/16 of its work
and a padding copy of q are waste. Here every program owns one (row, KV head) pair and streams that
head's pages through an online softmax with vector arithmetic: [pp x block_size, D] tiles of
`pages_per_tile` pages (with pages of 16, one page a tile is a trip round the loop for 16 keys).
With grouped queries the program computes every query head of its group (G = Hq / H, 1 to 8 in
today's models) over each page it loads, so each KV page is read once per group, not once per
query head. From `matrix_min_group` query heads up the group's scores and weighted sums run on the
matrix units instead (two Triton dots a page, the group padded to 16 rows): with two or more
query heads a page the vector path's reductions, not the bytes, bound it. There a program may
also own several KV heads (`heads_per_program`): their pages are one tile, scored against all
their query heads with the keys of other heads masked.

Layout: k_cache, v_cache [H, num_blocks, block_size, D] (rosejax's KV cache); block_tables
[B, MB] int32; lengths [B] int32 (tokens in the cache for the row, 0 for a padded row). q may carry
more heads than it has queries, [B, H' >= Hq, D], of which the first Hq (`num_q_heads`, default H)
are the queries: a model passes its fused q/k/v projection [B, Hq + 2H, D] whole, and XLA copies
no q out of it first.

`paged_decode_attention_append` attends as if each row's new K/V (heads Hq..Hq+2H of that projection)
were already in its slot, taking them from the projection, and writes them into the slot after
its page loop. A decode step then needs no `kv_append` kernel: one kernel a layer fewer, out of
the ~100 small kernels that bound a one-request step. Given `rope` (and `qk_norm`), it also
rotates (and first normalizes) the q and k heads it reads, as the model's XLA path would before
the call (`pallas_kernels.qk_norm_rope`): the projection goes to it straight from the matmul.

Split-K ("flash-decoding"): B x H programs leave most of a GPU idle at small batch, each walking
its row's whole context (at B=1 and 32k tokens, 8 programs of 512 pages on 132 SMs). With
`num_splits` S > 1 the grid is (B, H, S): split s walks the s-th of S contiguous runs of the row's
live pages and writes its float32 partials (running max, denominator, numerator), and a second
small kernel merges the S partials of each query head. S = 1 is the one-pass kernel, unchanged.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import filter_triton_deprecation, is_power_of_2, next_power_of_2
from pallas_kernels.qk_norm_rope import check_qk_norm_rope, load_heads, qk_norm_rope_reference

_NEG_INF = -1e30

# Tuned defaults: the card each was tuned on and why, in a line (figures: docs/performance-log.md,
# section "Paged decode attention").
DEFAULT_NUM_STAGES = 2  # H100, one process: 1 and 3 stages within 0.4% of 2 at B=1 and B=256
PREFETCH_TABLE_MIN_BATCH = 128  # H200, whole table up front: B=256 -1.1% a step, 64 even, 1 +0.4%
PREFETCH_TABLE_MAX_BLOCKS = 64  # not tuned (16 entries measured): the select costs a lane an entry
# H100, Qwen3-0.6B B=256: 0.84x the step's time on the vector path (decode attention 73 against
# 91 us a call at context 136); Llama-8B's group 4 at B=1: 17 against 35 us.
DEFAULT_MATRIX_MIN_GROUP = 2
MATRIX_NUM_WARPS = 4  # H100, the same engine: 0.947x the step of 8 warps at B=256, 0.984x at B=1
MATRIX_MIN_ROWS = 16  # Triton's smallest matmul operand side: a group is padded to it
# H200, Qwen3-0.6B bf16 at 256 rows, against one head a program at block size 64: two heads at
# 64 0.975x the step, two at 32 0.964x, four at 16 0.908-0.917x (two 1.022x, eight 0.952x).
MANY_ROWS = 256  # from here: several heads a program, one page of them a tile
# Page rows of K a program's tile holds by default (several heads' pages from MANY_ROWS, at
# least 2 heads; below, several pages of one head). H200, pages of 16 against 64: Qwen3-0.6B at
# 32 rows 1.117x the step with a page a tile, 1.006x with 4; a 32k prompt's decode 1.51x, 0.96x.
# At 256 rows GPT-2 (vector path) 0.878x with a page a tile, 1.044x with 4.
TILE_ROWS = 64
HEADS_PER_PROGRAM_MAX_TILE_BYTES = 32 * 1024  # of K a page: the largest measured
# _default_num_warps, vector path: a warp per 1,024 page elements  (H200: best at BS 16 and 32,
# 1.2% off at 64)


def _tile_rows(hp: int, pp: int, block_size: int):
    """Each row of a program's [hp x pp x BS, D] tile of K or V: its head (of the hp), its page
    (of the pp) and its token in the page, as [hp x pp x BS] vectors (head after head, a head's
    pages in order)."""
    rows = jnp.arange(hp * pp * block_size, dtype=jnp.int32)
    zeros = jnp.zeros_like(rows)  # one head or one page: no integer division a tile row
    head = rows // (pp * block_size) if hp > 1 else zeros
    slot = rows // block_size % pp if pp > 1 else zeros
    return head, slot, rows % block_size if hp * pp > 1 else rows


def _load_tile(
    k_cache_ref, v_cache_ref, block_tables_ref, b, h0, hp: int, pp: int, i, num_tokens, table
):
    """Tile i of row b, logical pages [i x pp, (i + 1) x pp), for KV heads [h0, h0 + hp) -> K, V
    [hp x pp x BS, D] in the cache's dtype (keys at or past `num_tokens` zero) and which of its
    rows are cached keys [hp x pp x BS]. `table`: (the row's prefetched block table [MB'], its
    slot indices) or None to read entries from memory."""
    block_size, head_dim = k_cache_ref.shape[2], k_cache_ref.shape[3]
    max_blocks = block_tables_ref.shape[1]

    def page_of(logical):  # past the table: any page (its keys are past num_tokens)
        logical = jnp.minimum(logical, max_blocks - 1)
        if table is None:
            return block_tables_ref[b, logical]
        entries, slots = table  # a register vector takes no dynamic index: select by mask
        return jnp.sum(jnp.where(slots == logical, entries, 0))

    head, slot, token = _tile_rows(hp, pp, block_size)
    cached = (i * pp + slot) * block_size + token < num_tokens  # [hp x pp x BS]
    # Masked loads: the last page's unused tail is never read (at block size 64 and GPT-2's
    # decode contexts that tail is a fifth to a half of the bytes).
    mask = cached[:, None]
    if hp == 1 and pp == 1:
        page = page_of(i)
        k = plgpu.load(k_cache_ref.at[h0, page, :, :], mask=mask, other=0.0)
        v = plgpu.load(v_cache_ref.at[h0, page, :, :], mask=mask, other=0.0)
        return k, v, cached  # [BS, D]
    # Several heads or pages: pointers of one 2-D tile, not a [hp, pp, BS, D] load reshaped (a
    # reshape between the load and the dot keeps Triton from pipelining the load).
    if pp == 1:
        pages = page_of(i)
    else:  # pp scalar entries, then each row's by select
        pages = jnp.zeros_like(slot)
        for j in range(pp):
            pages = jnp.where(slot == j, page_of(i * pp + j), pages)
        pages = pages[:, None]
    dims = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    at = ((h0 + head)[:, None], pages, token[:, None], dims)
    k = plgpu.load(k_cache_ref.at[at], mask=mask, other=0.0)
    v = plgpu.load(v_cache_ref.at[at], mask=mask, other=0.0)
    return k, v, cached


def _pick_row(x, rows, g):
    """Row g of x [M] or [M, ...]: a register tile takes no dynamic index, so by mask."""
    mask = rows == g if x.ndim == 1 else rows[:, None] == g
    return jnp.sum(jnp.where(mask, x, 0.0), axis=0)


def _vector_update(qs, k, v, valid, carry):
    """One tile of pages into each query's online softmax with vector arithmetic, the queries one
    after another (qs: [D] float32, scaled; `valid` [pp x BS]: the cached keys)."""
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    out = []
    for q, (m, denom, acc) in zip(qs, carry, strict=True):
        s = jnp.sum(q[None, :] * k, axis=1)  # [pp x BS]
        s = jnp.where(valid, s, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s))
        p = jnp.exp(s - m_new)  # [pp x BS]
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha + jnp.sum(p[:, None] * v, axis=0)
        out.append((m_new, denom * alpha + jnp.sum(p), acc))
    return tuple(out)


def _matrix_update(q, sm_scale, k, v, visible, carry):
    """One tile of the program's KV heads into its queries' online softmax on the matrix units:
    q [M, D] (its query heads in the cache's dtype) against K and V [R, D] (R = hp x pp x BS) as
    two Triton dots; `visible` [M, R]: the keys of each query's own KV head that are cached."""
    m, denom, acc = carry  # [M], [M], [M, D] float32
    precision = jax.lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale  # [M, R] float32
    s = jnp.where(visible, s, _NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])  # [M, R]
    alpha = jnp.exp(m - m_new)
    pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)  # [M, D] float32
    return m_new, denom * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv


def _attend_pages(
    q,
    sm_scale: float,
    k_cache_ref,
    v_cache_ref,
    block_tables_ref,
    b,
    h0,
    group: int,
    hp: int,
    pp: int,
    num_tokens,
    tiles,
    prefetch_table: bool,
    matrix_units: bool,
):
    """Online softmax of the program's queries q [M, D] (unscaled; row r is query head r % group
    of KV head h0 + r // group, rows past hp x group padding) over the row's first `num_tokens`
    cached keys of KV heads [h0, h0 + hp) that lie in its tiles of pp logical pages [first, end)
    = `tiles` -> per query row (running max [M], softmax denominator [M], numerator [M, D]), all
    float32. Each page of K and V is loaded once for every query of its head. With
    `matrix_units` the scores and weighted sums are two Triton dots a tile (probabilities
    rounded to the cache's dtype as flash attention does); otherwise (one KV head) vector
    arithmetic in float32, one query after another."""
    block_size, head_dim = k_cache_ref.shape[2], k_cache_ref.shape[3]
    tile_tokens = pp * block_size
    max_blocks = block_tables_ref.shape[1]
    table = None
    if prefetch_table:
        slots = jnp.arange(next_power_of_2(max_blocks), dtype=jnp.int32)
        entries = plgpu.load(
            block_tables_ref.at[b, pl.ds(0, slots.shape[0])], mask=slots < max_blocks, other=0
        )  # [MB']
        table = (entries, slots)
    first, end = tiles
    # No tile without a cached key: its scores would all be _NEG_INF, each weighing exp(0) = 1.
    end = jnp.minimum(end, (num_tokens + tile_tokens - 1) // tile_tokens)
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)  # [M]

    def tile(i):
        return _load_tile(
            k_cache_ref, v_cache_ref, block_tables_ref, b, h0, hp, pp, i, num_tokens, table
        )

    if not matrix_units:
        scaled = q.astype(jnp.float32) * sm_scale
        qs = tuple(_pick_row(scaled, rows, g) for g in range(group))  # [D] each
        init = (jnp.float32(_NEG_INF), jnp.float32(0.0), jnp.zeros((head_dim,), jnp.float32))

        def vector_tile(i, carry):
            return _vector_update(qs, *tile(i), carry)

        states = jax.lax.fori_loop(first, end, vector_tile, (init,) * group)
        m = jnp.full(rows.shape, _NEG_INF, jnp.float32)
        denom, acc = jnp.zeros(rows.shape, jnp.float32), jnp.zeros(q.shape, jnp.float32)
        for g, (m_g, denom_g, acc_g) in enumerate(states):
            m, denom = jnp.where(rows == g, m_g, m), jnp.where(rows == g, denom_g, denom)
            acc = jnp.where(rows[:, None] == g, acc_g[None, :], acc)
        return m, denom, acc
    head = _tile_rows(hp, pp, block_size)[0]  # [hp x pp x BS]: each key's head, of the hp
    own_head = (rows // group)[:, None] == head[None, :]  # [M, hp x pp x BS]
    q = q.astype(k_cache_ref.dtype)

    def matrix_tile(i, carry):
        k, v, cached = tile(i)
        return _matrix_update(q, sm_scale, k, v, own_head & cached[None, :], carry)

    init = (
        jnp.full(rows.shape, _NEG_INF, jnp.float32),
        jnp.zeros(rows.shape, jnp.float32),
        jnp.zeros((rows.shape[0], head_dim), jnp.float32),
    )
    return jax.lax.fori_loop(first, end, matrix_tile, init)


def _split_tiles(length, tile_tokens: int, num_splits: int):
    """The tiles [first, end) of `tile_tokens` (pp pages) of a row of `length` tokens that this
    program's split (grid axis 2) attends, and the row's live tile count: the live tiles in
    `num_splits` contiguous runs of cdiv(live, num_splits), so a short row's work is spread as
    evenly as a long one's; splits past the row's last tile get none."""
    live = (length + tile_tokens - 1) // tile_tokens
    if num_splits == 1:
        return 0, live, live
    per = (live + num_splits - 1) // num_splits
    first = jnp.minimum(pl.program_id(2) * per, live)
    return first, jnp.minimum(first + per, live), live


def _gather_rows(x, index):
    """x [n, D] -> [M, D] (M = len(index)): row r is x[index[r]], zeros where index[r] is no row
    of x (a register tile takes no dynamic index: a select a row of x)."""
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)
    out = jnp.zeros((index.shape[0], x.shape[1]), x.dtype)
    for j in range(x.shape[0]):
        out = jnp.where((index == j)[:, None], _pick_row(x, rows, j)[None, :], out)
    return out


def _load_queries(qkv_ref, b, first_head, group: int, hp: int, matrix_units: bool, *prologue):
    """The program's query tile [M, D] in qkv's dtype and which of its rows are real: its hp x group
    query heads from `first_head`, through `load_heads` (`prologue`: its rope_refs, scale_ref
    and eps), in rows padded with zeros to a power of two (to MATRIX_MIN_ROWS on the matrix
    units). The padding rows load a real head again and are zeroed after the norm and RoPE: the
    wider tile costs nothing measurable, and padding a tile of the real heads took selects."""
    real_heads = group * hp
    n = next_power_of_2(real_heads)
    rows = jnp.arange(max(MATRIX_MIN_ROWS, n) if matrix_units else n, dtype=jnp.int32)  # [M]
    real = rows < real_heads
    heads = first_head + jnp.minimum(rows, real_heads - 1)  # [M]
    q = load_heads(qkv_ref, b, heads, *prologue)  # [M, D]
    return jnp.where(real[:, None], q, 0), real


def _store_states(out_refs, b, first_head, real, states, num_splits: int) -> None:
    """The program's softmax states (max [M], denominator [M], numerator [M, D]) of query heads
    first_head + r, for the `real` rows r -> its outputs (one split: o_ref [B, Hq, D]), or this
    split's partials m_ref, l_ref [B, Hq, S] and acc_ref [B, Hq, S, D] float32, which
    `_combine_splits` merges."""
    m, denom, acc = states
    heads = pl.ds(first_head, m.shape[0])
    if num_splits == 1:
        (o_ref,) = out_refs
        # A padded row (length 0) has denom = 0: write zeros, not NaN.
        out = (acc / jnp.maximum(denom, 1e-30)[:, None]).astype(o_ref.dtype)
        plgpu.store(o_ref.at[b, heads, :], out, mask=real[:, None])
        return
    m_ref, l_ref, acc_ref = out_refs
    split = pl.program_id(2)
    plgpu.store(m_ref.at[b, heads, split], m, mask=real)
    plgpu.store(l_ref.at[b, heads, split], denom, mask=real)
    plgpu.store(acc_ref.at[b, heads, split, :], acc, mask=real[:, None])


def paged_decode_attention_kernel(
    q_ref,  # [B, H' >= Hq, D], heads [0, Hq) read
    k_cache_ref,  # [H, NB, BS, D]
    v_cache_ref,  # [H, NB, BS, D]
    block_tables_ref,  # [B, MB]
    lengths_ref,  # [B]
    *out_refs,  # o_ref [B, Hq, D]; with splits: m_ref, l_ref [B, Hq, S], acc_ref [B, Hq, S, D]
    sm_scale: float,
    prefetch_table: bool,
    group: int,
    heads_per_program: int,
    pages_per_tile: int,
    num_splits: int,
    matrix_units: bool,
):
    b, h0 = pl.program_id(0), pl.program_id(1) * heads_per_program
    length = lengths_ref[b]
    first, end, _ = _split_tiles(length, pages_per_tile * k_cache_ref.shape[2], num_splits)
    q, real = _load_queries(
        q_ref, b, h0 * group, group, heads_per_program, matrix_units, None, None, 0.0
    )  # [M, D]
    states = _attend_pages(
        q,
        sm_scale,
        k_cache_ref,
        v_cache_ref,
        block_tables_ref,
        b,
        h0,
        group,
        heads_per_program,
        pages_per_tile,
        length,
        (first, end),
        prefetch_table,
        matrix_units,
    )
    _store_states(out_refs, b, h0 * group, real, states, num_splits)


def paged_decode_attention_append_kernel(
    qkv_ref,  # [B, Hq + 2H, D]: q, k, v of the row's new token
    k_cache_in_ref,  # [H, NB, BS, D], aliased to k_cache_ref
    v_cache_in_ref,  # [H, NB, BS, D], aliased to v_cache_ref
    block_tables_ref,  # [B, MB]
    lengths_ref,  # [B]
    *refs,  # with rope: cos_ref, sin_ref [B, D/2]; with qk_norm: q_scale_ref, k_scale_ref [D];
    #         then the outputs (`paged_decode_attention_kernel`'s), k_cache_ref, v_cache_ref
    sm_scale: float,
    prefetch_table: bool,
    group: int,
    heads_per_program: int,
    pages_per_tile: int,
    num_splits: int,
    matrix_units: bool,
    rope: bool,
    qk_norm: bool,
    eps: float,
):
    num_inputs = 2 * rope + 2 * qk_norm
    out_refs, (k_cache_ref, v_cache_ref) = refs[num_inputs:-2], refs[-2:]
    rope_refs = refs[:2] if rope else None
    q_scale_ref, k_scale_ref = refs[2:4] if qk_norm else (None, None)
    hp = heads_per_program
    b, h0 = pl.program_id(0), pl.program_id(1) * hp
    num_heads, block_size = k_cache_ref.shape[0], k_cache_ref.shape[2]
    num_q_heads = num_heads * group
    length = lengths_ref[b]
    first, end, live = _split_tiles(length, pages_per_tile * block_size, num_splits)
    # The older tokens come from the cache; the new one from registers, so no program reads a
    # slot that this launch writes (a row's write slot is private to it: shared blocks are full,
    # and a shared partial block is copied before anyone writes into it). The new token is in
    # the row's last live tile: the split whose tiles end there adds it.
    holds_new = (first < end) & (end == live)
    q, real = _load_queries(
        qkv_ref, b, h0 * group, group, hp, matrix_units, rope_refs, q_scale_ref, eps
    )  # [M, D]
    m, denom, acc = _attend_pages(
        q,
        sm_scale,
        k_cache_in_ref,
        v_cache_in_ref,
        block_tables_ref,
        b,
        h0,
        group,
        hp,
        pages_per_tile,
        length - 1,
        (first, end),
        prefetch_table,
        matrix_units,
    )
    new_heads = num_q_heads + h0 + jnp.arange(hp, dtype=jnp.int32)  # [hp]
    k_new = load_heads(qkv_ref, b, new_heads, rope_refs, k_scale_ref, eps)  # [hp, D]
    v_new = load_heads(qkv_ref, b, new_heads + num_heads, None, None, eps)  # [hp, D]
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)  # [M]
    kv_of_row = jnp.where(real, rows // group, -1)  # [M]: each query's KV head, of the hp
    k_f = _gather_rows(k_new.astype(jnp.float32), kv_of_row)  # [M, D]
    v_f = _gather_rows(v_new.astype(jnp.float32), kv_of_row)
    s = jnp.sum(q.astype(jnp.float32) * sm_scale * k_f, axis=1)  # [M]
    m_new = jnp.maximum(m, s)
    alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new)
    with_new = (m_new, denom * alpha + p, acc * alpha[:, None] + p[:, None] * v_f)
    states = tuple(
        jnp.where(holds_new, x, y) for x, y in zip(with_new, (m, denom, acc), strict=True)
    )
    _store_states(out_refs, b, h0 * group, real, states, num_splits)

    # Stored last: with these stores ahead of the page loop the kernel took 6.7 us a call at
    # B=1 on an H100, 1.4 us more than the attention alone.
    # The new token's slot is position length - 1; a padded row (length 0) writes scratch block 0.
    def store_new():
        pos = jnp.maximum(length - 1, 0)
        # At most the table's last entry, as the model clips.
        logical = jnp.minimum(pos // block_size, block_tables_ref.shape[1] - 1)
        block = jnp.where(length > 0, block_tables_ref[b, logical], 0)
        k_cache_ref[pl.ds(h0, hp), block, pos % block_size, :] = k_new
        v_cache_ref[pl.ds(h0, hp), block, pos % block_size, :] = v_new

    if num_splits == 1:
        store_new()
    else:  # once a row: by the split that adds the new token, or split 0 of a padded row
        pl.when(holds_new | ((live == 0) & (pl.program_id(2) == 0)))(store_new)


def _check_decode_args(q, k_cache, v_cache, block_tables, lengths, append: bool, hq: int) -> None:
    """Static checks shared by both decode ops. q needs >= Hq heads (Hq a multiple of the
    cache's H), or exactly Hq + 2H of the cache's dtype to `append` (its K/V are stored)."""
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"need q [B, H, D] and caches [H, NB, BS, D], got {q.shape}, "
            f"{k_cache.shape}, {v_cache.shape}"
        )
    b, _, d = q.shape
    h = k_cache.shape[0]
    if hq % h:
        raise ValueError(f"{hq} query heads are not a multiple of the cache's {h} KV heads")
    if append:
        need = "3H" if hq == h else f"Hq + 2H = {hq + 2 * h}"
    else:
        need = ">= H" if hq == h else f">= Hq = {hq}"
    if (q.shape[1] != hq + 2 * h if append else q.shape[1] < hq) or k_cache.shape[3] != d:
        raise ValueError(
            f"q heads/dim {q.shape[1:]} do not cover the cache's "
            f"{(h, k_cache.shape[3])} (need {need} heads)"
        )
    if append and (q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype):
        raise ValueError(
            f"qkv and the caches must share a dtype to append, got {q.dtype}, "
            f"{k_cache.dtype}, {v_cache.dtype}"
        )
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.dtype != jnp.int32:
        raise ValueError(
            f"block_tables must be int32 [{b}, MB], got {block_tables.dtype} {block_tables.shape}"
        )
    if lengths.shape != (b,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32 [{b}], got {lengths.dtype} {lengths.shape}")
    bs = k_cache.shape[2]
    if not (is_power_of_2(bs) and is_power_of_2(d)):
        raise ValueError(f"block size and head dim must be powers of two, got {bs}, {d}")


def uses_matrix_units(
    group: int, block_size: int, head_dim: int, matrix_min_group: int = DEFAULT_MATRIX_MIN_GROUP
) -> bool:
    """Whether a group of `group` query heads a KV head attends on the matrix units: from
    `matrix_min_group` heads up (0: never), on pages and heads Triton's dots take."""
    return 0 < matrix_min_group <= group and min(block_size, head_dim) >= MATRIX_MIN_ROWS


def decode_kernel_supported(head_dim: int, block_size: int) -> bool:
    """Whether the Pallas decode kernels tile this cache (Triton tiles are powers of two)."""
    return is_power_of_2(head_dim) and is_power_of_2(block_size)


def default_heads_per_program(
    batch: int, num_heads: int, block_size: int, head_dim: int, itemsize: int, matrix_units: bool
) -> int:
    """KV heads a decode program attends by default: on the matrix units from
    MANY_ROWS rows up, the heads whose pages fill TILE_ROWS rows of K (at
    least 2), halved until they divide the heads and their [hp x BS, D] K tile stays within
    HEADS_PER_PROGRAM_MAX_TILE_BYTES; else 1."""
    if not matrix_units or batch < MANY_ROWS:
        return 1
    hp = max(2, TILE_ROWS // block_size)
    while hp > 1 and (
        num_heads % hp or hp * block_size * head_dim * itemsize > HEADS_PER_PROGRAM_MAX_TILE_BYTES
    ):
        hp //= 2
    return hp


def default_pages_per_tile(batch: int, heads_per_program: int, block_size: int) -> int:
    """Pages of each of its heads a decode program loads as one tile by default: below
    MANY_ROWS rows as many as fill TILE_ROWS rows with its heads' pages (with pages of 16 a
    tile of one page is a trip round the loop for 16 keys), else 1 (the many programs hide the
    trips, and a row's last tile reads less past its length)."""
    if batch >= MANY_ROWS:
        return 1
    return max(1, TILE_ROWS // (heads_per_program * block_size))


def _default_num_warps(tile_tokens: int, head_dim: int, matrix_units: bool) -> int:
    if matrix_units:
        return MATRIX_NUM_WARPS
    # One warp per 1,024 elements of a [tile_tokens, D] tile, at most 8 (the table at the top).
    return max(1, min(tile_tokens * head_dim // 1024, 8))


def combine_splits_kernel(
    m_ref,  # [B, Hq, S] float32: each split's running max
    l_ref,  # [B, Hq, S] float32: its softmax denominator
    acc_ref,  # [B, Hq, S, D] float32: its numerator
    o_ref,  # [B, Hq, D]
):
    b, j = pl.program_id(0), pl.program_id(1)
    num_splits = m_ref.shape[2]
    splits = jnp.arange(next_power_of_2(num_splits), dtype=jnp.int32)  # Triton tiles: 2^k
    real = splits < num_splits
    m = plgpu.load(m_ref.at[b, j, pl.ds(0, splits.shape[0])], mask=real, other=_NEG_INF)
    denom = plgpu.load(l_ref.at[b, j, pl.ds(0, splits.shape[0])], mask=real, other=0.0)
    acc = plgpu.load(
        acc_ref.at[b, j, pl.ds(0, splits.shape[0]), :], mask=real[:, None], other=0.0
    )  # [S', D]
    # Each split's sums rescaled to the largest max; a split with no keys has weight 0 (or
    # denominator 0 in a padded row, whose output is then zeros).
    weight = jnp.exp(m - jnp.max(m))  # [S']
    out = jnp.sum(weight[:, None] * acc, axis=0) / jnp.maximum(jnp.sum(weight * denom), 1e-30)
    o_ref[b, j, :] = out.astype(o_ref.dtype)


def _combine_splits(
    m: jax.Array,  # [B, Hq, S] float32
    denom: jax.Array,  # [B, Hq, S] float32
    acc: jax.Array,  # [B, Hq, S, D] float32
    dtype,
    *,
    interpret: bool = False,
) -> jax.Array:  # [B, Hq, D]
    """The split decode kernels' online-softmax partials merged (rescaled to their largest max,
    summed, normalized) -> the output: one program per (row, query head)."""
    b, hq, _, d = acc.shape
    return pl.pallas_call(
        combine_splits_kernel,
        grid=(b, hq),
        out_shape=jax.ShapeDtypeStruct((b, hq, d), dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        name=f"paged_decode_combine_s{m.shape[2]}",
    )(m, denom, acc)


def _decode_call(
    kernel,
    name: str,
    q,
    k_cache,
    v_cache,
    block_tables,
    lengths,
    *prologue,
    append: bool,
    num_q_heads: int,
    heads_per_program: int | None,
    pages_per_tile: int | None,
    num_splits: int,
    num_warps: int | None,
    num_stages: int,
    prefetch_table: bool | None,
    matrix_min_group: int,
    interpret: bool,
):
    """One program per (row, `heads_per_program` KV heads, split), for all the query heads of
    their groups; with `append` the caches are outputs too, in place. `prologue`: more inputs, after the lengths.
    More than one split: the kernel writes float32 partials, `_combine_splits` merges them."""
    b, d = q.shape[0], q.shape[2]
    h, _, bs, _ = k_cache.shape
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if not isinstance(matrix_min_group, int) or matrix_min_group < 0:
        raise ValueError(f"matrix_min_group must be an int >= 0, got {matrix_min_group!r}")
    group = num_q_heads // h
    matrix_units = uses_matrix_units(group, bs, d, matrix_min_group)
    hp = heads_per_program
    if hp is None:
        hp = default_heads_per_program(b, h, bs, d, k_cache.dtype.itemsize, matrix_units)
    if not isinstance(hp, int) or hp < 1 or not is_power_of_2(hp) or h % hp:
        raise ValueError(
            f"heads_per_program must be a power of two dividing the cache's {h} KV heads, "
            f"got {hp!r}"
        )
    if hp > 1 and not matrix_units:
        raise ValueError(
            f"heads_per_program {hp} needs the matrix units (group {group} >= matrix_min_group "
            f"{matrix_min_group} > 0, block size and head dim >= {MATRIX_MIN_ROWS})"
        )
    pp = default_pages_per_tile(b, hp, bs) if pages_per_tile is None else pages_per_tile
    if not isinstance(pp, int) or pp < 1 or not is_power_of_2(pp):
        raise ValueError(f"pages_per_tile must be a power of two >= 1, got {pp!r}")
    if num_warps is None:
        num_warps = _default_num_warps(pp * bs, d, matrix_units)
    if prefetch_table is None:
        prefetch_table = (
            b >= PREFETCH_TABLE_MIN_BATCH and block_tables.shape[1] <= PREFETCH_TABLE_MAX_BLOCKS
        )
    if not interpret:
        filter_triton_deprecation()
    if num_splits == 1:
        out_shapes = (jax.ShapeDtypeStruct((b, num_q_heads, d), q.dtype),)
    else:
        stat = jax.ShapeDtypeStruct((b, num_q_heads, num_splits), jnp.float32)
        acc = jax.ShapeDtypeStruct((b, num_q_heads, num_splits, d), jnp.float32)
        out_shapes = (stat, stat, acc)
    cache_shape = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    n = len(out_shapes)
    outs = pl.pallas_call(
        functools.partial(
            kernel,
            sm_scale=1.0 / math.sqrt(d),
            prefetch_table=bool(prefetch_table),
            group=group,
            heads_per_program=hp,
            pages_per_tile=pp,
            num_splits=num_splits,
            matrix_units=matrix_units,
        ),
        grid=(b, h // hp) if num_splits == 1 else (b, h // hp, num_splits),
        out_shape=(*out_shapes, cache_shape, cache_shape) if append else out_shapes,
        input_output_aliases={1: n, 2: n + 1} if append else {},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"{name}_bs{bs}_g{group}{'_mma' if matrix_units else ''}_w{num_warps}"
        + (f"_hp{hp}" if hp > 1 else "")
        + (f"_pp{pp}" if pp > 1 else "")
        + (f"_s{num_splits}" if num_splits > 1 else ""),
    )(q, k_cache, v_cache, block_tables, lengths, *prologue)
    out = outs[0] if num_splits == 1 else _combine_splits(*outs[:3], q.dtype, interpret=interpret)
    return (out, *outs[n:]) if append else out


_STATIC = [
    "num_q_heads",
    "heads_per_program",
    "pages_per_tile",
    "num_splits",
    "num_warps",
    "num_stages",
    "prefetch_table",
    "matrix_min_group",
    "interpret",
]


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_decode_attention(
    q: jax.Array,  # [B, H' >= Hq, D]: the first Hq heads are the queries
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    lengths: jax.Array,  # [B] int32
    *,
    num_q_heads: int | None = None,
    heads_per_program: int | None = None,
    pages_per_tile: int | None = None,
    num_splits: int = 1,
    num_warps: int | None = None,
    num_stages: int = DEFAULT_NUM_STAGES,
    prefetch_table: bool | None = None,
    matrix_min_group: int = DEFAULT_MATRIX_MIN_GROUP,
    interpret: bool = False,
) -> jax.Array:  # [B, Hq, D]
    """softmax(q k^T / sqrt(D)) v over each row's first `lengths[b]` cached tokens; query head
    j reads KV head j // (Hq / H) (grouped-query attention).

    `num_q_heads` None: H (multi-head attention). `num_warps` None: MATRIX_NUM_WARPS on the
    matrix units, else one warp per 1,024 elements of a tile. `prefetch_table` None: a program
    reads its row's whole block table up front from PREFETCH_TABLE_MIN_BATCH rows up, an entry
    per page below that. `num_splits`: programs per (row, KV head), each over a run of the
    row's tiles, merged by a second kernel (1: one pass, no merge). `matrix_min_group`: groups
    of at least this many query heads (and pages and heads of at least MATRIX_MIN_ROWS) compute
    on the matrix units; 0: never. `heads_per_program` (matrix units only; a power of two
    dividing H; None: `default_heads_per_program`): KV heads a program attends, their pages
    loaded as one tile and scored against all their query heads at once (a query's keys of
    other heads masked), so fewer programs each stream more of a row: at many rows and short
    contexts a program's fixed latency (its row's length and table, its queries, its stores)
    is shared by hp heads. `pages_per_tile` (a power of two; None: `default_pages_per_tile`):
    consecutive pages of each head in one [hp x pp x BS, D] tile, one trip round the loop."""
    hq = num_q_heads or k_cache.shape[0]
    _check_decode_args(q, k_cache, v_cache, block_tables, lengths, append=False, hq=hq)
    return _decode_call(
        paged_decode_attention_kernel,
        "paged_decode_attention",
        q,
        k_cache,
        v_cache,
        block_tables,
        lengths,
        append=False,
        num_q_heads=hq,
        heads_per_program=heads_per_program,
        pages_per_tile=pages_per_tile,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        prefetch_table=prefetch_table,
        matrix_min_group=matrix_min_group,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=[*_STATIC, "eps"], donate_argnums=(1, 2))
def paged_decode_attention_append(
    qkv: jax.Array,  # [B, Hq + 2H, D]: each row's new token's q, k and v heads
    k_cache: jax.Array,  # [H, NB, BS, D], donated
    v_cache: jax.Array,  # [H, NB, BS, D], donated
    block_tables: jax.Array,  # [B, MB] int32
    lengths: jax.Array,  # [B] int32, the new token included
    rope: tuple[jax.Array, jax.Array] | None = None,  # float32 (cos, sin) [B, D/2] each
    qk_norm: tuple[jax.Array, jax.Array] | None = None,  # (q scale, k scale) [D] each
    *,
    num_q_heads: int | None = None,
    eps: float = 1e-6,
    heads_per_program: int | None = None,
    pages_per_tile: int | None = None,
    num_splits: int = 1,
    num_warps: int | None = None,
    num_stages: int = DEFAULT_NUM_STAGES,
    prefetch_table: bool | None = None,
    matrix_min_group: int = DEFAULT_MATRIX_MIN_GROUP,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # [B, Hq, D], k_cache, v_cache
    """`kv_append` of each row's new K/V at position lengths[b] - 1, then
    `paged_decode_attention`, in one kernel: a decode step's layer launches one kernel fewer.
    A padded row (length 0) writes scratch block 0 and gives zeros. Updates the caches in place
    (donate them in the calling jit). `num_q_heads` and tiles (`num_splits` too) as
    `paged_decode_attention`: the split holding the row's last page writes the new K/V.

    With `rope`, q and k are rotated first (and with `qk_norm`, RMSNorm'd with eps before
    that), as `qk_norm_rope_reference` does: K goes to the cache rotated, V as given."""
    hq = num_q_heads or k_cache.shape[0]
    _check_decode_args(qkv, k_cache, v_cache, block_tables, lengths, append=True, hq=hq)
    check_qk_norm_rope(qkv, rope, qk_norm)
    prologue = (*(rope or ()), *(qk_norm or ()))
    suffix = ("_qknorm" if qk_norm else "") + ("_rope" if rope else "")
    kernel = functools.partial(
        paged_decode_attention_append_kernel,
        rope=rope is not None,
        qk_norm=qk_norm is not None,
        eps=eps,
    )
    return _decode_call(
        kernel,
        "paged_decode_attention_append" + suffix,
        qkv,
        k_cache,
        v_cache,
        block_tables,
        lengths,
        *prologue,
        append=True,
        num_q_heads=hq,
        heads_per_program=heads_per_program,
        pages_per_tile=pages_per_tile,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        prefetch_table=prefetch_table,
        matrix_min_group=matrix_min_group,
        interpret=interpret,
    )


def paged_decode_attention_reference(
    q: jax.Array,  # [B, H' >= Hq, D]: the first Hq heads are the queries
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    lengths: jax.Array,  # [B] int32
    *,
    num_q_heads: int | None = None,  # Hq, a multiple of H; None: H
) -> jax.Array:  # [B, Hq, D]
    """The XLA reference of `paged_decode_attention`: gathers each row's pages, softmax in
    float32; a padded row (length 0) gives zeros. Query head j reads KV head j // (Hq / H)."""
    h, _, bs, d = k_cache.shape
    hq = num_q_heads or h
    b, mb = block_tables.shape
    k = k_cache[:, block_tables].reshape(h, b, mb * bs, d)  # [H, B, L, D]
    v = v_cache[:, block_tables].reshape(h, b, mb * bs, d)  # [H, B, L, D]
    qg = q[:, :hq].reshape(b, h, hq // h, d)  # [B, H, G, D]
    s = jnp.einsum("bhgd,hbld->bhgl", qg, k, preferred_element_type=jnp.float32)
    visible = jnp.arange(mb * bs)[None, None, None, :] < lengths[:, None, None, None]
    p = jax.nn.softmax(jnp.where(visible, s / math.sqrt(d), _NEG_INF), axis=-1)
    out = jnp.einsum("bhgl,hbld->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(b, hq, d)
    return jnp.where(lengths[:, None, None] > 0, out, 0).astype(q.dtype)


def paged_decode_attention_append_reference(
    qkv: jax.Array,  # [B, Hq + 2H, D]
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    lengths: jax.Array,  # [B] int32
    rope: tuple[jax.Array, jax.Array] | None = None,  # float32 (cos, sin) [B, D/2] each
    qk_norm: tuple[jax.Array, jax.Array] | None = None,  # (q scale, k scale) [D] each
    *,
    num_q_heads: int | None = None,  # Hq, a multiple of H; None: H
    eps: float = 1e-6,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The XLA reference of `paged_decode_attention_append`: q and k normalized and rotated
    (`qk_norm_rope_reference`), the append (a scatter), then the attention. Returns new caches;
    the arguments are left as they were."""
    h, _, bs, _ = k_cache.shape
    hq = num_q_heads or h
    qkv = qk_norm_rope_reference(qkv, rope, qk_norm, num_q_heads=hq, eps=eps)
    # The slot of position lengths - 1; a padded row (length 0) writes to scratch block 0.
    last = jnp.maximum(lengths - 1, 0)  # [B]
    real = lengths > 0
    block = jnp.where(real, jnp.take_along_axis(block_tables, (last // bs)[:, None], 1)[:, 0], 0)
    offset = jnp.where(real, last % bs, 0)  # [B]
    # k_cache[:, block, offset] is [H, B, D]
    k_cache = k_cache.at[:, block, offset].set(jnp.swapaxes(qkv[:, hq : hq + h], 0, 1))
    v_cache = v_cache.at[:, block, offset].set(jnp.swapaxes(qkv[:, hq + h :], 0, 1))
    out = paged_decode_attention_reference(
        qkv, k_cache, v_cache, block_tables, lengths, num_q_heads=hq
    )
    return out, k_cache, v_cache
