"""Paged prefill attention: a chunk of T query tokens per row over the row's cached pages, as a
flash-attention kernel (online softmax over `pages_per_tile` consecutive [block_size, D] pages at
a time, one [pages_per_tile x block_size, D] key tile).

What it replaces: XLA's prefill path for rows that continue a cached prefix (a prefix-cache hit,
or a chunk of a long prompt after its first) gathers every row's *whole* block table, MB *
block_size keys (the model's full context) however short the cached part, then masks. Here a
program reads only the pages below its queries' last position.

Grid: (row, query head, tile of `block_q` query tokens); query head j reads KV head j // G
(grouped-query attention: each KV page is read once per query head here, G times per group; a
group-packed variant would read it once). Query (b, t) at absolute position positions[b, t] sees
the keys at logical positions 0..positions[b, t] of its block table, those below seq_lens[b];
its own chunk's K/V must already be in the cache (the model writes them first). Matmuls run on
the matrix units (Triton dots of [block_q, D] x [D, pp x block_size] and [block_q, pp x
block_size] x [pp x block_size, D]), so Triton needs block_q, block_size and D powers of two of at
least 16. Key tiles every query of a q tile sees whole (below its first query and the row's
length) skip the masks, and the q tiles with the most keys (the chunk's last) are started first.

Layout: q [B, T, Hq, D]; k_cache, v_cache [H, NB, BS, D]; block_tables [B, MB] int32; positions
[B, T] int32 (increasing along T); seq_lens [B] int32. Tokens at or past seq_lens (padding) get
finite values that no one should read; rows with seq_lens 0 get zeros.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import filter_triton_deprecation, is_power_of_2, next_power_of_2

_NEG_INF = -1e30
_LOG2_E = math.log2(math.e)
# H200, Qwen3's heads (D=128, pages of 64), a 32k prompt, a 2k chunk at 30k, a 4k prompt: 128 rows
# 2.0-2.3x faster than 32, 1.2-1.3x than 64; 8 warps lost at every size, 3 stages were a tie.
DEFAULT_BLOCK_Q = 128
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
MIN_TILE = 16  # Triton's smallest matmul operand side
# H200, Qwen3 (D=128), a 32k prompt: pages of 64 (one a key tile) were the best key tile; pages of
# 16 took 1.63x the TTFT. Smaller pages are gathered pages_per_tile at a time up to this many keys.
KEY_TILE_ROWS = 64


def paged_prefill_attention_kernel(
    q_ref,  # [B, T, Hq, D]
    k_cache_ref,  # [H, NB, BS, D]
    v_cache_ref,  # [H, NB, BS, D]
    block_tables_ref,  # [B, MB]
    positions_ref,  # [B, T]
    seq_lens_ref,  # [B]
    o_ref,  # [B, T, Hq, D]
    *,
    sm_scale: float,
    block_q: int,
    group: int,
    pages_per_tile: int,
):
    b, j = pl.program_id(0), pl.program_id(1)
    # Later tiles see more keys: they start first, so the grid does not end on its longest work.
    qi = pl.num_programs(2) - 1 - pl.program_id(2)
    h = j // group
    t = q_ref.shape[1]
    block_size, max_blocks = k_cache_ref.shape[2], block_tables_ref.shape[1]
    first = qi * block_q
    row_ok = first + jnp.arange(block_q, dtype=jnp.int32) < t  # [BQ]
    tokens = pl.ds(first, block_q)
    q = plgpu.load(q_ref.at[b, tokens, j, :], mask=row_ok[:, None], other=0.0)  # [BQ, D]
    pos = plgpu.load(positions_ref.at[b, tokens], mask=row_ok, other=-1)  # [BQ]
    tile = pages_per_tile * block_size  # keys an iteration: logical pages i*pp .. i*pp + pp-1
    # Keys this q tile needs: up to its last query's position, never past the row's length (or
    # its table).
    num_keys = jnp.minimum(jnp.minimum(jnp.max(pos) + 1, seq_lens_ref[b]), max_blocks * block_size)
    num_tiles = (num_keys + tile - 1) // tile
    # Key tiles below the q tile's first query and the row's length are whole to every query: no
    # mask.
    first_pos = jnp.min(jnp.where(row_ok, pos, jnp.iinfo(jnp.int32).max))
    full_tiles = jnp.minimum(first_pos + 1, num_keys) // tile
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scale = sm_scale * _LOG2_E  # scores in base 2: exp2 is the GPU's native exponential
    cols = jnp.arange(tile, dtype=jnp.int32)  # [pp x BS]: token c % BS of the tile's page c // BS
    slots, page_tokens = (cols // block_size)[:, None], (cols % block_size)[:, None]
    dims = jnp.arange(k_cache_ref.shape[3], dtype=jnp.int32)[None, :]

    def load_tile(i, key_ok):
        """Iteration i's K, V [pp x BS, D]; `key_ok` [pp x BS] (None: every key) masks the keys
        at or past num_keys (so pages past the table too): zeros, never read."""
        mask = None if key_ok is None else key_ok[:, None]  # [pp x BS, 1]
        other = None if key_ok is None else 0
        if pages_per_tile == 1:
            page = block_tables_ref[b, i]
            k_at, v_at = k_cache_ref.at[h, page, :, :], v_cache_ref.at[h, page, :, :]
        else:
            # Pointers of one [pp x BS, D] tile, not a [pp, BS, D] load reshaped (a reshape
            # between the load and the dot keeps Triton from pipelining the load).
            table_at = block_tables_ref.at[b, i * pages_per_tile + slots]
            pages = plgpu.load(table_at, mask=mask, other=other)  # [pp x BS, 1]
            at = (h, pages, page_tokens, dims)
            k_at, v_at = k_cache_ref.at[at], v_cache_ref.at[at]
        return plgpu.load(k_at, mask=mask, other=other), plgpu.load(v_at, mask=mask, other=other)

    def body(i, carry, *, masked: bool):
        m, denom, acc = carry  # [BQ], [BQ], [BQ, D] float32
        key_pos = i * tile + cols  # [pp x BS]
        key_ok = key_pos < num_keys if masked else None
        k, v = load_tile(i, key_ok)  # [pp x BS, D] each
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [BQ, pp x BS] float32
        if masked:
            visible = (key_pos[None, :] <= pos[:, None]) & key_ok[None, :]
            s = jnp.where(visible, s, _NEG_INF)  # [BQ, pp x BS]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])  # [BQ, pp x BS]
        alpha = jnp.exp2(m - m_new)
        pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)  # [BQ, D] float32
        return m_new, denom * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    d = q.shape[1]
    init = (
        jnp.full((block_q,), _NEG_INF, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, d), jnp.float32),
    )
    whole = jax.lax.fori_loop(0, full_tiles, functools.partial(body, masked=False), init)
    _, denom, acc = jax.lax.fori_loop(
        full_tiles, num_tiles, functools.partial(body, masked=True), whole
    )
    out = acc / jnp.maximum(denom, 1e-30)[:, None]
    plgpu.store(o_ref.at[b, tokens, j, :], out.astype(o_ref.dtype), mask=row_ok[:, None])


def default_block_q(t: int) -> int:
    """Query rows a program: DEFAULT_BLOCK_Q, or the chunk rounded up to a power of two if shorter
    (a burst of short prompts would otherwise compute mostly masked rows)."""
    return min(DEFAULT_BLOCK_Q, max(MIN_TILE, next_power_of_2(t)))


def default_pages_per_tile(block_size: int) -> int:
    """Pages an iteration of the key loop takes: as many as fill KEY_TILE_ROWS keys (at least 1)."""
    return max(1, KEY_TILE_ROWS // block_size)


def prefill_kernel_supported(head_dim: int, block_size: int) -> bool:
    """Whether the kernel tiles these pages (Triton matmul operands: powers of two >= 16)."""
    return all(is_power_of_2(n) and n >= MIN_TILE for n in (head_dim, block_size))


def _check_args(q, k_cache, v_cache, block_tables, positions, seq_lens) -> None:
    if q.ndim != 4 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"need q [B, T, Hq, D] and caches [H, NB, BS, D], got {q.shape}, {k_cache.shape}, "
            f"{v_cache.shape}"
        )
    b, t, hq, d = q.shape
    h, _, bs, dk = k_cache.shape
    if dk != d or hq % h:
        raise ValueError(f"q heads/dim {(hq, d)} do not fit the cache's {(h, dk)}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32 [{b}, MB], got {block_tables.shape}")
    if positions.shape != (b, t) or positions.dtype != jnp.int32:
        raise ValueError(f"positions must be int32 [{b}, {t}], got {positions.shape}")
    if seq_lens.shape != (b,) or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be int32 [{b}], got {seq_lens.shape}")
    if not prefill_kernel_supported(d, bs):
        raise ValueError(f"head dim and block size must be powers of two >= 16, got {d}, {bs}")


@functools.partial(
    jax.jit, static_argnames=["block_q", "pages_per_tile", "num_warps", "num_stages", "interpret"]
)
def paged_prefill_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    positions: jax.Array,  # [B, T] int32
    seq_lens: jax.Array,  # [B] int32
    *,
    block_q: int | None = None,
    pages_per_tile: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    interpret: bool = False,
) -> jax.Array:  # [B, T, Hq, D]
    """Causal attention of each chunk token over its row's pages (see the module docstring).
    block_q None: `default_block_q` of the chunk's length. pages_per_tile (a power of two; None:
    `default_pages_per_tile`): consecutive pages of a row one key-loop iteration takes, as one
    [pp x block_size, D] tile, so small pages do not cost a loop trip each."""
    _check_args(q, k_cache, v_cache, block_tables, positions, seq_lens)
    block_q = default_block_q(q.shape[1]) if block_q is None else block_q
    if not (is_power_of_2(block_q) and block_q >= MIN_TILE):
        raise ValueError(f"block_q must be a power of two >= {MIN_TILE}, got {block_q}")
    bs = k_cache.shape[2]
    pp = default_pages_per_tile(bs) if pages_per_tile is None else pages_per_tile
    if not is_power_of_2(pp):
        raise ValueError(f"pages_per_tile must be a power of two >= 1, got {pp}")
    b, t, hq, d = q.shape
    if not interpret:
        filter_triton_deprecation()
    kernel = functools.partial(
        paged_prefill_attention_kernel,
        sm_scale=1.0 / math.sqrt(d),
        block_q=block_q,
        group=hq // k_cache.shape[0],
        pages_per_tile=pp,
    )
    return pl.pallas_call(
        kernel,
        grid=(b, hq, pl.cdiv(t, block_q)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_prefill_attention_q{block_q}_bs{bs}" + (f"_pp{pp}" if pp > 1 else ""),
    )(q, k_cache, v_cache, block_tables, positions, seq_lens)


def paged_prefill_attention_reference(
    q: jax.Array,  # [B, T, Hq, D]
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    positions: jax.Array,  # [B, T] int32
    seq_lens: jax.Array,  # [B] int32
) -> jax.Array:  # [B, T, Hq, D]
    """Plain XLA: every row's pages gathered (all MB of them), keys masked to 0..position and
    below seq_lens, softmax in float32."""
    b, t, hq, d = q.shape
    h = k_cache.shape[0]
    context = block_tables.shape[1] * k_cache.shape[2]
    k = k_cache[:, block_tables].reshape(h, b, context, d)
    v = v_cache[:, block_tables].reshape(h, b, context, d)
    key_pos = jnp.arange(context)[None, None, :]
    visible = (key_pos <= positions[:, :, None]) & (key_pos < seq_lens[:, None, None])
    qg = q.reshape(b, t, h, hq // h, d)
    s = jnp.einsum("btkgd,kbld->bkgtl", qg, k, preferred_element_type=jnp.float32)
    s = jnp.where(visible[:, None, None], s / math.sqrt(d), _NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgtl,kbld->btkgd", p, v, preferred_element_type=jnp.float32)
    out = jnp.where((seq_lens > 0)[:, None, None, None, None], out, 0.0)
    return out.reshape(b, t, hq, d).astype(q.dtype)
