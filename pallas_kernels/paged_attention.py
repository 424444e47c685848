"""Paged decode attention with one query per row and head (a decode step), for multi-head (GPT-2)
and grouped-query attention (Llama, Qwen: Hq query heads over H KV heads).

jax's `pallas.ops.gpu.paged_attention` is built for grouped queries: it pads each KV head's queries
to a block of 16 rows for the matrix units, so with GPT-2's one query per KV head 15/16 of its work
and a padding copy of q are waste. Here every program owns one (row, KV head) pair and streams that
head's pages through an online softmax with vector arithmetic: [block_size, D] tiles, no padding.
With grouped queries the program computes every query head of its group (G = Hq / H, 1 to 8 in
today's models) over each page it loads, so each KV page is read once per group, not once per
query head.

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
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import filter_triton_deprecation, is_power_of_2, next_power_of_2
from pallas_kernels.qk_norm_rope import check_qk_norm_rope, load_head, qk_norm_rope_reference

_NEG_INF = -1e30

# Tuned defaults: the card each was tuned on and why, in a line (figures: docs/performance-log.md,
# section "Paged decode attention").
DEFAULT_NUM_STAGES = 2  # H100, one process: 1 and 3 stages within 0.4% of 2 at B=1 and B=256
PREFETCH_TABLE_MIN_BATCH = 128  # H200, whole table up front: B=256 -1.1% a step, 64 even, 1 +0.4%
PREFETCH_TABLE_MAX_BLOCKS = 64  # not tuned (16 entries measured): the select costs a lane an entry
# _default_num_warps: a warp per 1,024 page elements  (H200: best at BS 16 and 32, 1.2% off at 64)


def _attend_pages(qs, k_cache_ref, v_cache_ref, block_tables_ref, b, h, num_tokens, prefetch_table):
    """Online softmax of each query of `qs` (a tuple of [D] float32, already scaled: the group of
    query heads that share KV head h) over the row's first `num_tokens` cached keys of head h ->
    per query (running max, softmax denominator, numerator [D]), all float32. Each page of K and V
    is loaded once for the whole group; the queries' arithmetic runs one after another."""
    block_size, head_dim = k_cache_ref.shape[2], k_cache_ref.shape[3]
    max_blocks = block_tables_ref.shape[1]
    if prefetch_table:
        slots = jnp.arange(next_power_of_2(max_blocks), dtype=jnp.int32)
        table = plgpu.load(
            block_tables_ref.at[b, pl.ds(0, slots.shape[0])], mask=slots < max_blocks, other=0
        )  # [MB']

    def body(i, carry):
        if prefetch_table:  # a register vector takes no dynamic index: select by mask
            page = jnp.sum(jnp.where(slots == i, table, 0))
        else:
            page = block_tables_ref[b, i]
        valid = i * block_size + jnp.arange(block_size, dtype=jnp.int32) < num_tokens  # [BS]
        # Masked loads: the last page's unused tail is never read (at block size 64 and GPT-2's
        # decode contexts that tail is a fifth to a half of the bytes).
        k = plgpu.load(k_cache_ref.at[h, page, :, :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_cache_ref.at[h, page, :, :], mask=valid[:, None], other=0.0)
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        out = []
        for q, (m, denom, acc) in zip(qs, carry, strict=True):
            s = jnp.sum(q[None, :] * k, axis=1)  # [BS]
            s = jnp.where(valid, s, _NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s))
            p = jnp.exp(s - m_new)  # [BS]
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha + jnp.sum(p[:, None] * v, axis=0)
            out.append((m_new, denom * alpha + jnp.sum(p), acc))
        return tuple(out)

    num_pages = (num_tokens + block_size - 1) // block_size
    init = (jnp.float32(_NEG_INF), jnp.float32(0.0), jnp.zeros((head_dim,), jnp.float32))
    return jax.lax.fori_loop(0, num_pages, body, (init,) * len(qs))


def paged_decode_attention_kernel(
    q_ref,  # [B, H' >= Hq, D], heads [0, Hq) read
    k_cache_ref,  # [H, NB, BS, D]
    v_cache_ref,  # [H, NB, BS, D]
    block_tables_ref,  # [B, MB]
    lengths_ref,  # [B]
    o_ref,  # [B, Hq, D]
    *,
    sm_scale: float,
    prefetch_table: bool,
    group: int,
):
    b, h = pl.program_id(0), pl.program_id(1)
    heads = [h * group + g for g in range(group)]  # the query heads of KV head h
    qs = tuple(q_ref[b, j, :].astype(jnp.float32) * sm_scale for j in heads)  # [D] each
    states = _attend_pages(
        qs, k_cache_ref, v_cache_ref, block_tables_ref, b, h, lengths_ref[b], prefetch_table
    )
    for j, (_, denom, acc) in zip(heads, states, strict=True):
        # A padded row (length 0) has denom = 0: write zeros, not NaN.
        o_ref[b, j, :] = (acc / jnp.maximum(denom, 1e-30)).astype(o_ref.dtype)


def paged_decode_attention_append_kernel(
    qkv_ref,  # [B, Hq + 2H, D]: q, k, v of the row's new token
    k_cache_in_ref,  # [H, NB, BS, D], aliased to k_cache_ref
    v_cache_in_ref,  # [H, NB, BS, D], aliased to v_cache_ref
    block_tables_ref,  # [B, MB]
    lengths_ref,  # [B]
    *refs,  # with rope: cos_ref, sin_ref [B, D/2]; with qk_norm: q_scale_ref, k_scale_ref [D];
    #         then o_ref [B, Hq, D], k_cache_ref, v_cache_ref [H, NB, BS, D]
    sm_scale: float,
    prefetch_table: bool,
    group: int,
    rope: bool,
    qk_norm: bool,
    eps: float,
):
    o_ref, k_cache_ref, v_cache_ref = refs[-3:]
    rope_refs = refs[:2] if rope else None
    q_scale_ref, k_scale_ref = refs[2:4] if qk_norm else (None, None)
    b, h = pl.program_id(0), pl.program_id(1)
    num_heads, block_size = k_cache_ref.shape[0], k_cache_ref.shape[2]
    num_q_heads = num_heads * group
    length = lengths_ref[b]
    # The older tokens come from the cache; the new one from registers, so no program reads a
    # slot that this launch writes (a row's write slot is private to it: shared blocks are full,
    # and a shared partial block is copied before anyone writes into it).
    heads = [h * group + g for g in range(group)]
    qs = tuple(
        load_head(qkv_ref, b, j, rope_refs, q_scale_ref, eps).astype(jnp.float32) * sm_scale
        for j in heads
    )  # [D] each
    states = _attend_pages(
        qs, k_cache_in_ref, v_cache_in_ref, block_tables_ref, b, h, length - 1, prefetch_table
    )
    k_new = load_head(qkv_ref, b, num_q_heads + h, rope_refs, k_scale_ref, eps)  # [D]
    v_new = qkv_ref[b, num_q_heads + num_heads + h, :]  # [D]
    k_f, v_f = k_new.astype(jnp.float32), v_new.astype(jnp.float32)
    for j, q, (m, denom, acc) in zip(heads, qs, states, strict=True):
        s = jnp.sum(q * k_f)
        m_new = jnp.maximum(m, s)
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new)
        out = (acc * alpha + p * v_f) / (denom * alpha + p)  # [D]
        o_ref[b, j, :] = jnp.where(length > 0, out, 0.0).astype(o_ref.dtype)
    # Stored last: with these stores ahead of the page loop the kernel took 6.7 us a call at
    # B=1 on an H100, 1.4 us more than the attention alone.
    # The new token's slot is position length - 1; a padded row (length 0) writes scratch block 0.
    pos = jnp.maximum(length - 1, 0)
    logical = jnp.minimum(pos // block_size, block_tables_ref.shape[1] - 1)  # as the model clips
    block = jnp.where(length > 0, block_tables_ref[b, logical], 0)
    k_cache_ref[h, block, pos % block_size, :] = k_new
    v_cache_ref[h, block, pos % block_size, :] = v_new


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


def decode_kernel_supported(head_dim: int, block_size: int) -> bool:
    """Whether the Pallas decode kernels tile this cache (Triton tiles are powers of two)."""
    return is_power_of_2(head_dim) and is_power_of_2(block_size)


def _default_num_warps(block_size: int, head_dim: int) -> int:
    # One warp per 1,024 elements of a [block_size, D] page, at most 8 (the table at the top).
    return max(1, min(block_size * head_dim // 1024, 8))


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
    num_warps: int | None,
    num_stages: int,
    prefetch_table: bool | None,
    interpret: bool,
):
    """One program per (row, KV head), for all the query heads of its group; with `append` the
    caches are outputs too, in place. `prologue`: more inputs, after the lengths."""
    b, d = q.shape[0], q.shape[2]
    h, _, bs, _ = k_cache.shape
    if num_warps is None:
        num_warps = _default_num_warps(bs, d)
    if prefetch_table is None:
        prefetch_table = (
            b >= PREFETCH_TABLE_MIN_BATCH and block_tables.shape[1] <= PREFETCH_TABLE_MAX_BLOCKS
        )
    if not interpret:
        filter_triton_deprecation()
    group = num_q_heads // h
    out_shape = jax.ShapeDtypeStruct((b, num_q_heads, d), q.dtype)
    cache_shape = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    return pl.pallas_call(
        functools.partial(
            kernel, sm_scale=1.0 / math.sqrt(d), prefetch_table=bool(prefetch_table), group=group
        ),
        grid=(b, h),
        out_shape=(out_shape, cache_shape, cache_shape) if append else out_shape,
        input_output_aliases={1: 1, 2: 2} if append else {},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"{name}_bs{bs}_g{group}_w{num_warps}",
    )(q, k_cache, v_cache, block_tables, lengths, *prologue)


_STATIC = ["num_q_heads", "num_warps", "num_stages", "prefetch_table", "interpret"]


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_decode_attention(
    q: jax.Array,  # [B, H' >= Hq, D]: the first Hq heads are the queries
    k_cache: jax.Array,  # [H, NB, BS, D]
    v_cache: jax.Array,  # [H, NB, BS, D]
    block_tables: jax.Array,  # [B, MB] int32
    lengths: jax.Array,  # [B] int32
    *,
    num_q_heads: int | None = None,
    num_warps: int | None = None,
    num_stages: int = DEFAULT_NUM_STAGES,
    prefetch_table: bool | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, Hq, D]
    """softmax(q k^T / sqrt(D)) v over each row's first `lengths[b]` cached tokens; query head
    j reads KV head j // (Hq / H) (grouped-query attention).

    `num_q_heads` None: H (multi-head attention). `num_warps` None: one warp per 1,024 elements
    of a [block_size, D] page. `prefetch_table` None: a program reads its row's whole block table
    up front from PREFETCH_TABLE_MIN_BATCH rows up, an entry per page below that."""
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
        num_warps=num_warps,
        num_stages=num_stages,
        prefetch_table=prefetch_table,
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
    num_warps: int | None = None,
    num_stages: int = DEFAULT_NUM_STAGES,
    prefetch_table: bool | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # [B, Hq, D], k_cache, v_cache
    """`kv_append` of each row's new K/V at position lengths[b] - 1, then
    `paged_decode_attention`, in one kernel: a decode step's layer launches one kernel fewer.
    A padded row (length 0) writes scratch block 0 and gives zeros. Updates the caches in place
    (donate them in the calling jit). `num_q_heads` and tiles as `paged_decode_attention`.

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
        num_warps=num_warps,
        num_stages=num_stages,
        prefetch_table=prefetch_table,
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
